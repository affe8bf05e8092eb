"""Which LM head weights a refit may receive into (``unread_lm_head_weight``): vLLM CPU
keeps an LM head's weight after packing its GEMM, and on the paths where the logits come
from the packed copy alone nothing reads the weight again. Checked against vLLM 0.32's
own dispatch (``dispatch_cpu_unquantized_gemm``, the kernel this host picks) by
behaviour, and for the paths that do read it (no packing, ``F.linear``, a closure on the
weight's storage or on the module)."""

from __future__ import annotations

import pytest
import torch

from reshard.integrations.vllm.kernels import unread_lm_head_weight

from ._cpu_gemm import packs_a_copy

utils = pytest.importorskip("vllm.model_executor.layers.utils")


class ParallelLMHead(torch.nn.Module):
    """vLLM's LM head as far as the check reads it: its class name and its weight."""

    def __init__(self, rows: int = 256, hidden: int = 128,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(
            torch.randn(rows, hidden, generator=g).to(dtype), requires_grad=False)


class Linear(ParallelLMHead):
    """Any other module: never an unread LM head."""


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [8, 256])  # the small-GEMM kernel's size and oneDNN's
def test_vllm_packed_lm_head_never_reads_its_weight(dtype, rows):
    """Whichever kernel this host's vLLM picks (``_cpu_gemm``): a weight the check calls
    unread is never read, and one it does not is read (bf16 on an AVX2-only host: no
    packed copy, ``F.linear`` of the weight)."""
    head = ParallelLMHead(rows=rows, dtype=dtype)
    utils.dispatch_cpu_unquantized_gemm(head, remove_weight=False)
    held = unread_lm_head_weight(head)
    assert held is not None or not packs_a_copy(dtype)  # float32: unread on every host
    x = torch.randn(3, head.weight.shape[1]).to(dtype)
    before = head.cpu_linear(x, head.weight, None)
    head.weight.data.zero_()  # what a refit's receive may write there before its commit
    after = head.cpu_linear(x, head.weight, None)
    if held is None:  # this host's kernel reads the weight: it must keep its buffer
        assert not torch.equal(after, before) and not after.any()
    else:
        assert held.data_ptr() == head.weight.data_ptr()
        assert torch.equal(after, before)


def test_gemms_that_read_the_weight_are_refused():
    head = ParallelLMHead()
    assert unread_lm_head_weight(head) is None  # not packed
    head.cpu_linear = torch.nn.functional.linear
    assert unread_lm_head_weight(head) is None
    view = head.weight.detach()  # zentorch unprepacked: the weight's own storage
    head.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, view, bias)
    assert unread_lm_head_weight(head) is None
    head.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, head.weight, bias)
    assert unread_lm_head_weight(head) is None  # reads it through the module
    head.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)
    assert unread_lm_head_weight(head) is None  # nothing of its own: the argument
    packed = head.weight.detach().clone()
    head.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, packed, bias)
    held = unread_lm_head_weight(head)  # its own copy (oneDNN's, small-GEMM's)
    assert held is not None and held.data_ptr() == head.weight.data_ptr()
    other = Linear()
    other.cpu_linear = head.cpu_linear
    assert unread_lm_head_weight(other) is None  # not an LM head

"""Which GEMM vLLM 0.32 CPU runs for an unquantized linear on this host
(``dispatch_cpu_unquantized_gemm``), for the tests whose expectations depend on it:

* float32: a oneDNN copy on every x86 host (measured on an AVX2-only one:
  ``brg_matmul:avx2``; with ``ONEDNN_MAX_CPU_ISA=SSE41``, ``gemm:jit:f32``);
* bfloat16 on an AVX2-only host: no copy. oneDNN has no bf16 matmul there ("could not
  create a primitive descriptor for the matmul primitive"; ``ONEDNN_VERBOSE=all`` says
  "unsupported datatype", its reference matmul too), so vLLM falls back to ``F.linear``
  of the live weight (measured);
* bfloat16 elsewhere, from vLLM's code (not measured here): the small-GEMM kernel's copy
  where there is AMX (``check_cpu_sgl_kernel``: weights up to 1 MiB), else oneDNN's,
  wherever oneDNN creates the bf16 matmul (AVX-512);
* on an AMD CPU with AVX-512 and the zentorch package (``make setup`` does not install
  it): zentorch, whose unprepacked GEMM reads the weight's own storage.
"""

from __future__ import annotations

import torch


def zentorch_gemms() -> bool:
    """Whether vLLM CPU computes unquantized GEMMs with zentorch here (then a float32
    one may read the live weight, as with ``VLLM_ZENTORCH_WEIGHT_PREPACK=0``)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_zen_cpu()
                and hasattr(torch.ops.zentorch, "zentorch_linear_unary"))


def packs_a_copy(dtype: torch.dtype) -> bool | None:
    """True where vLLM CPU certainly packs a GEMM copy of a ``dtype`` weight on this
    host (float32 without zentorch), None where that depends on the host's ISA."""
    return True if dtype == torch.float32 and not zentorch_gemms() else None

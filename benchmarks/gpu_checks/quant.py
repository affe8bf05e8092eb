"""Probe: FP8 block quantization throughput. A Kimi-K2-sized expert weight (7168 x 2048
bf16; 1024 x 1024 with ``--quick``) held as FSDP2 row shards of 3 ranks that end
mid-block (so blocks straddle two sources), quantized shard by shard on the device as
a refit does (partial amax of each shard, the shared blocks' max, codes and scales),
timed as a whole and in GB/s of bf16 read; the shards put together are checked bit for
bit against the reference quantizer of the full tensor (a mismatch fails the check)."""

from __future__ import annotations

import argparse

import torch

import reshard as R
from reshard.quant import BlockFormat, plan_fp8, quantize_reference, quantize_shards
from reshard.quant.fp8 import Fp8Shard, assemble

from .results import FAIL, PASS, Check
from .timing import time_median

NAME = "FP8 block quantization, shard by shard"


def _layout(shape: tuple[int, int]) -> R.Layout:
    """Rows over 3 ranks, cut mid-block: 40 % / 35 % / 25 %."""
    cuts = [0, int(shape[0] * 0.4) + 5, int(shape[0] * 0.75) + 3, shape[0]]
    return R.Layout.explicit(shape, {
        r: ((b - a, shape[1]), [((a, 0), (b - a, shape[1]), (0, 0))])
        for r, (a, b) in enumerate(zip(cuts, cuts[1:]))}, "bfloat16")


def measure_quantization(args: argparse.Namespace) -> Check:
    shape = (1024, 1024) if args.quick else (7168, 2048)
    layout, fmt = _layout(shape), BlockFormat((128, 128))
    blocks = plan_fp8(layout, fmt).tensors[0]
    g = torch.Generator().manual_seed(0)
    full = torch.randn(shape, generator=g).bfloat16()
    locals_ = {r: layout.shard(full, r).to(args.device) for r in layout.ranks}
    shards = quantize_shards(locals_, layout, blocks, fmt)
    host = {r: Fp8Shard(s.qdata.cpu(), tuple((b, x.cpu()) for b, x in s.scales))
            for r, s in shards.items()}
    q, scale = assemble(host, layout, blocks)
    # the truth is the reference quantizer on the same device: an engine there quantizes
    # a checkpoint with that device's arithmetic (on CUDA, PyTorch divides by a Python
    # number as a multiplication by its reciprocal, so amax / 448 may differ in the last
    # bit from the host's); how far the host's reference lies is reported beside it
    here = _differences(q, scale, *quantize_reference(full.to(args.device), fmt))
    host_diff = _differences(q, scale, *quantize_reference(full, fmt))
    exact = here == (0, 0)
    seconds = time_median(lambda: quantize_shards(locals_, layout, blocks, fmt), args.device,
                          args.repeats)
    gbps = full.numel() * 2 / seconds / 1e9
    detail = (f"{shape[0]} x {shape[1]} bf16 on 3 ranks ({len(blocks.shared)} blocks on two "
              f"of them): {seconds * 1e3:.2f} ms, {gbps:.2f} GB/s of bf16 read; "
              f"{'bit for bit' if exact else 'NOT bit for bit'} the reference on "
              f"{args.device} ({here[0]} codes, {here[1]} scales differ); against the "
              f"host's reference, {host_diff[0]} codes and {host_diff[1]} scales differ")
    return Check(NAME, PASS if exact else FAIL, detail, seconds)


def _differences(q, scale, q_ref, scale_ref) -> tuple[int, int]:
    """(codes, scales) that differ bit for bit from the reference's."""
    q_ref, scale_ref = q_ref.cpu(), scale_ref.cpu()
    return (int((q.view(torch.uint8) != q_ref.view(torch.uint8)).sum()),
            int((scale.view(torch.int32) != scale_ref.view(torch.int32)).sum()))

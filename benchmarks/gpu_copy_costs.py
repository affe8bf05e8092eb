"""What a staging copy costs on a GPU, piece by piece: the device time of a strided
region's copy in its own dtype and as 8-byte words, the host's cost of one ``copy_``
call from Python, and what batching the calls (``_foreach_copy_``, a CUDA graph
replaying the same copies) gives back, each alone. It is the groundwork for the
packing figures of ``benchmarks/gpu_check.py`` (docs/gpu-check.md: on an H200 both
batching and 8-byte words measured slower inside the executor's packing, whose host
work per region they add to; a CUDA graph per bound geometry is the lead). Run on a
CUDA machine:

    PYTHONPATH=src python3 benchmarks/gpu_copy_costs.py [--repeats 20]

Every case is timed with CUDA events around the whole batch (launch gaps count), median
of ``--repeats`` after a warm-up, and checked: the destination must equal the source."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

MIB = 1 << 20


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _host_seconds_per_call(fn: Callable[[], object], calls: int, repeats: int) -> float:
    """Host seconds one call of ``fn`` takes to issue (the device may lag behind)."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        torch.cuda.synchronize()
    return best / calls


def _row(name: str, nbytes: int, seconds: float, regions: int, ok: bool) -> str:
    return (f"{name:<58} {regions:>7} {nbytes / MIB:>9.1f} {nbytes / seconds / 1e9:>8.1f} "
            f"{seconds / regions * 1e6:>9.2f}  {'exact' if ok else 'WRONG'}")


def strided(repeats: int) -> list[str]:
    """A row-parallel shard (4096 x 3072 bf16) into half the columns of a 4096 x 6144
    destination, and back out: bf16 elements, then the same bytes as int64 words."""
    src = torch.randn(4096, 3072, device="cuda").bfloat16()
    big = torch.zeros(4096, 6144, device="cuda", dtype=torch.bfloat16)
    dst, nbytes, out = big[:, :3072], src.numel() * 2, []
    back = torch.empty_like(src)
    for label, d, s, b in (("bf16", dst, src, back),
                           ("int64 words", dst.view(torch.int64), src.view(torch.int64),
                            back.view(torch.int64))):
        seconds = _median_seconds(lambda d=d, s=s: d.copy_(s), repeats)
        out.append(_row(f"strided write (unpack), {label}", nbytes, seconds, 1,
                        torch.equal(dst, src)))
        seconds = _median_seconds(lambda b=b, d=d: b.copy_(d), repeats)
        out.append(_row(f"strided read (pack), {label}", nbytes, seconds, 1,
                        torch.equal(back, src)))
    return out


def batches(repeats: int, count: int, each: int, label: str) -> list[str]:
    """``count`` contiguous copies of ``each`` bytes: a Python loop of ``copy_``, the same
    with an ``as_strided`` per region (what a run's views cost), ``_foreach_copy_``, and
    a CUDA graph of the loop replayed."""
    srcs = [torch.randint(0, 255, (each,), dtype=torch.uint8, device="cuda")
            for _ in range(count)]
    arena = torch.zeros(count * each, dtype=torch.uint8, device="cuda")
    dsts = [arena[i * each:(i + 1) * each] for i in range(count)]
    nbytes, out = count * each, []

    def check() -> bool:
        ok = all(torch.equal(d, s) for d, s in zip(dsts, srcs))
        arena.zero_()
        return ok

    def loop() -> None:
        for d, s in zip(dsts, srcs):
            d.copy_(s)

    def loop_views() -> None:
        for d, s in zip(dsts, srcs):
            d.as_strided(d.shape, d.stride(), d.storage_offset()).copy_(
                s.as_strided(s.shape, s.stride(), s.storage_offset()))

    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        loop()  # warm-up on the side stream, as capture wants
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        loop()
    cases = (("loop of copy_", loop), ("loop of as_strided + copy_", loop_views),
             ("_foreach_copy_", lambda: torch._foreach_copy_(dsts, srcs)),
             ("CUDA graph of the loop, replayed", graph.replay))
    for name, fn in cases:
        seconds = _median_seconds(fn, repeats)
        out.append(_row(f"{label}: {name}", nbytes, seconds, count, check()))
    for name, fn in cases[:3]:
        host = _host_seconds_per_call(fn, count, repeats)
        out.append(f"{label}: {name}: host {host * 1e6:.2f} us per region to issue")
    return out


def _one_big_copy(repeats: int) -> float:
    whole = torch.empty(1024 * MIB, dtype=torch.uint8, device="cuda")
    copy = torch.empty_like(whole)
    return _median_seconds(lambda: copy.copy_(whole), repeats)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_copy_costs: no CUDA device; nothing measured")
        return 0
    ref = _one_big_copy(args.repeats)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; one 1024 MiB copy: "
          f"{1024 * MIB / ref / 1e9:.1f} GB/s")
    print(f"{'case':<58} {'regions':>7} {'MiB':>9} {'GB/s':>8} {'us/region':>9}")
    rows = strided(args.repeats)
    rows += batches(args.repeats, 361, int(2.4 * MIB) // 16 * 16, "361 x 2.4 MiB")
    rows += batches(args.repeats, 361, 8192, "361 x 8 KiB")
    rows += batches(args.repeats, 60, 39 * MIB, "60 x 39 MiB")
    print("\n".join(rows))
    return 0 if all("WRONG" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

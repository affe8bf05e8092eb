"""Soak: many consecutive refits across a process group, checking every destination.

    python benchmarks/soak.py [--refits 200] [--trainer 2] [--inference 2] [--hidden 256]
                              [--checksum none|sum|crc32] [--json PATH]

A trainer job and an inference job (local processes meeting at a TCP store, exactly as
two real jobs do) run ``--refits`` refits through ``RefitSender`` / ``RefitReceiver``.
Before each one the trainer applies a random update to every parameter (the same update
on every process: a generator seeded by the version, so each side can compute the
global tensor); after each one every inference rank compares a CRC-32 of each local
tensor with that of the shard it should hold. Each process reports its resident memory
(RSS), open file descriptors and threads after the first refit and after the last; the
summary prints them side by side. Exit status 1 if any destination was ever wrong.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import zlib
from datetime import timedelta

import torch

import reshard as R
from reshard.refit import RefitReceiver, RefitSender
from reshard.tools.launch import free_port, run_processes


def resources() -> dict[str, float]:
    """RSS (MiB), open file descriptors and threads of this process, after a collection."""
    gc.collect()
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    with open("/proc/self/status") as f:
        threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    return {"rss_mib": rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**20,
            "fds": len(os.listdir("/proc/self/fd")), "threads": threads}


def model(trainer: int, inference: int, hidden: int):
    """A small transformer-shaped state: FSDP-style row shards on the trainer, TP on the
    inference side (bf16), a replicated norm."""
    tm, im = R.Mesh(list(range(trainer))), R.Mesh(list(range(inference)))
    shapes = {"embed": (4 * hidden, hidden), "qkv": (3 * hidden, hidden),
              "o": (hidden, hidden), "up": (4 * hidden, hidden), "down": (hidden, 4 * hidden),
              "norm": (hidden,)}
    src = {n: R.Layout(s, tm, [R.Shard(0)]) for n, s in shapes.items()}
    dst = {"embed": R.Layout(shapes["embed"], im, [R.Shard(0)], "bfloat16"),
           "qkv": R.Layout(shapes["qkv"], im, [R.Shard(0)], "bfloat16"),
           "o": R.Layout(shapes["o"], im, [R.Shard(1)], "bfloat16"),
           "up": R.Layout(shapes["up"], im, [R.Shard(0)], "bfloat16"),
           "down": R.Layout(shapes["down"], im, [R.Shard(1)], "bfloat16"),
           "norm": R.Layout(shapes["norm"], im, [R.Replicate()], "bfloat16")}
    return shapes, src, dst


def update(full: dict[str, torch.Tensor], version: int) -> None:
    """The "optimizer step": the same random update on every process."""
    g = torch.Generator().manual_seed(version)
    for name in sorted(full):
        full[name].add_(torch.randn(full[name].shape, generator=g), alpha=0.01)


def crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().view(-1).view(torch.uint8).numpy())


def _rank(rank: int, world: int, port: int, a) -> dict:
    shapes, src, dst = model(a.trainer, a.inference, a.hidden)
    full = {n: torch.zeros(s) for n, s in shapes.items()}
    opts = dict(host="127.0.0.1", port=port, trainer_size=a.trainer,
                inference_size=a.inference, timeout=timedelta(seconds=120),
                refit_timeout=timedelta(seconds=60),
                checksum=False if a.checksum == "none" else a.checksum)
    trainer = rank < a.trainer
    if trainer:
        params = {n: torch.zeros(src[n].local_shape(rank)) for n in shapes}
        side = RefitSender(params, layouts=src, rank=rank, sparse="off", **opts)  # dense
    else:
        r = rank - a.trainer
        targets = {n: torch.zeros(dst[n].local_shape(r), dtype=torch.bfloat16) for n in shapes}
        side = RefitReceiver(targets, dst, rank=r, **opts)
    first = None
    mismatches, seconds, trace = [], [], []
    every = max(1, a.refits // 10)
    for version in range(1, a.refits + 1):
        update(full, version)
        if trainer:
            for n in shapes:
                params[n].copy_(src[n].shard(full[n], rank))
            stats = side.refit(version)
        else:
            stats = side.refit()
            for n in shapes:
                expected = dst[n].shard(full[n].to(torch.bfloat16), r)
                if crc(targets[n]) != crc(expected):
                    mismatches.append((version, n))
        seconds.append(stats.seconds)
        if version == 1:
            first = resources()
        if version % every == 0:
            trace.append((version, round(resources()["rss_mib"], 2)))
    last = resources()
    return {"rank": rank, "side": "trainer" if trainer else "inference", "first": first,
            "last": last, "mismatches": mismatches, "refits": a.refits, "rss_trace": trace,
            "mean_refit_ms": 1000 * sum(seconds) / len(seconds),
            "max_refit_ms": 1000 * max(seconds)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--refits", type=int, default=200)
    ap.add_argument("--trainer", type=int, default=2)
    ap.add_argument("--inference", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--checksum", choices=["none", "sum", "crc32"], default="none")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    shapes, src, _ = model(a.trainer, a.inference, a.hidden)
    nbytes = sum(lay.nbytes for lay in src.values())
    t0 = time.perf_counter()
    results = run_processes(_rank, a.trainer + a.inference, free_port(), a, init=False,
                            timeout=max(300, a.refits * 5))
    wall = time.perf_counter() - t0
    print(f"soak: {a.refits} refits of {nbytes / 2**20:.1f} MiB (fp32 -> bf16), "
          f"{a.trainer} trainer + {a.inference} inference ranks, checksum={a.checksum}, "
          f"{wall:.1f} s")
    print(f"{'rank':>4} {'side':<9} {'RSS MiB first':>13} {'last':>7} {'delta':>6} "
          f"{'fds':>4} {'->':>4} {'thr':>4} {'->':>4} {'mean ms':>8} {'max ms':>7} {'bad':>4}")
    for res in results:
        f, last = res["first"], res["last"]
        print(f"{res['rank']:>4} {res['side']:<9} {f['rss_mib']:>13.1f} {last['rss_mib']:>7.1f} "
              f"{last['rss_mib'] - f['rss_mib']:>+6.1f} {f['fds']:>4} {last['fds']:>4} "
              f"{f['threads']:>4} {last['threads']:>4} {res['mean_refit_ms']:>8.1f} "
              f"{res['max_refit_ms']:>7.1f} {len(res['mismatches']):>4}")
    print("RSS MiB every", max(1, a.refits // 10), "refits:")
    for res in results:
        print(f"{res['rank']:>4} " + " ".join(f"{m:.1f}" for _, m in res["rss_trace"]))
    bad = sum(len(res["mismatches"]) for res in results)
    checked = a.refits * a.inference * len(shapes)
    print(f"destinations checked: {checked}, wrong: {bad}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"refits": a.refits, "mib": nbytes / 2**20, "wall_s": wall,
                       "checksum": a.checksum, "ranks": results}, fh, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

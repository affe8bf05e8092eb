"""What the integrity option costs: refit time without and with per-message checksums.

    python benchmarks/checksum_cost.py [--hidden 1024] [--repeats 8] [--trainer 2]
                                       [--inference 2]

First the raw digest speed on one core (``sum``: wrapping int64 sums on the tensor's
own device; ``crc32``: zlib on the host; ``hmac``: keyed HMAC-SHA256, the default
with a token), then refits of a transformer-shaped state (fp32 trainer shards -> bf16
TP shards, ``benchmarks/soak.py``'s model) between local processes meeting with a
token, the four modes interleaved refit by refit (so drift hits them alike); the
median refit time of each and its cost over no checksum. Every refit is checked.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from reshard._transport.integrity import digest  # noqa: E402
from reshard.refit import RefitReceiver, RefitSender  # noqa: E402
from reshard.tools.launch import free_port, run_processes  # noqa: E402
from soak import crc, model  # noqa: E402

MODES = (None, "sum", "crc32", "hmac")


def digest_speed(mib: int = 64) -> dict[str, float]:
    torch.set_num_threads(1)
    buf = torch.randint(0, 255, (mib << 20,), dtype=torch.uint8)
    out = {}
    for kind in ("sum", "crc32", "hmac"):
        digest(buf, kind, key=b"k" * 32)
        t0 = time.perf_counter()
        for _ in range(5):
            digest(buf, kind, key=b"k" * 32)
        out[kind] = mib * 5 / 1024 / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(5):
        buf.clone()
    out["memcpy (clone)"] = mib * 5 / 1024 / (time.perf_counter() - t0)
    return out


def _rank(rank: int, world: int, port: int, a) -> dict:
    shapes, src, dst = model(a.trainer, a.inference, a.hidden)
    opts = dict(host="127.0.0.1", port=port, trainer_size=a.trainer,
                inference_size=a.inference, timeout=timedelta(seconds=300),
                checksum="sum",  # built with it; each refit below sets the mode it measures
                token="checksum-cost-token-0123456789")  # the key of "hmac"
    trainer = rank < a.trainer
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    if trainer:
        params = {n: src[n].shard(full[n], rank) for n in shapes}
        side = RefitSender(params, layouts=src, rank=rank, sparse="off", **opts)  # dense
    else:
        r = rank - a.trainer
        targets = {n: torch.zeros(dst[n].local_shape(r), dtype=torch.bfloat16) for n in shapes}
        side = RefitReceiver(targets, dst, rank=r, **opts)
        expected = {n: crc(dst[n].shard(full[n].to(torch.bfloat16), r)) for n in shapes}
    times: dict[str, list[float]] = {str(m): [] for m in MODES}
    bad = 0
    version = 0
    for _ in range(a.repeats + 1):  # the first round warms up and is dropped
        for mode in MODES:
            for ex in side.executors:
                ex._runner.checksum = mode
            version += 1
            stats = side.refit(version) if trainer else side.refit()
            times[str(mode)].append(stats.seconds)
            if not trainer:
                bad += sum(crc(targets[n]) != expected[n] for n in shapes)
    return {"rank": rank, "times": {m: v[1:] for m, v in times.items()}, "bad": bad}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--trainer", type=int, default=2)
    ap.add_argument("--inference", type=int, default=2)
    a = ap.parse_args(argv)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    print("digest speed, one core, 64 MiB buffer (GB/s):",
          ", ".join(f"{k} {v:.1f}" for k, v in digest_speed().items()))
    _, src, dst = model(a.trainer, a.inference, a.hidden)
    fp32 = sum(lay.nbytes for lay in src.values())
    bf16 = sum(lay.nbytes for lay in dst.values())
    results = run_processes(_rank, a.trainer + a.inference, free_port(), a, init=False,
                            timeout=1800)
    # a refit takes as long as its slowest rank: per refit, the max over ranks
    per_refit = {m: [max(res["times"][m][i] for res in results) for i in range(a.repeats)]
                 for m in map(str, MODES)}
    base = statistics.median(per_refit["None"])
    print(f"refit of {fp32 / 2**20:.0f} MiB fp32 -> {bf16 / 2**20:.0f} MiB bf16 received, "
          f"{a.trainer} trainer -> {a.inference} inference ranks, {a.repeats} refits per mode:")
    for m in map(str, MODES):
        med = statistics.median(per_refit[m])
        name = "no checksum" if m == "None" else f"checksum={m}"
        extra = "" if m == "None" else f"  (+{med - base:.3f} s, {100 * (med / base - 1):+.1f}%)"
        print(f"  {name:<16} median {med:.3f} s  min {min(per_refit[m]):.3f} s{extra}")
    bad = sum(res["bad"] for res in results)
    print(f"destinations wrong: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

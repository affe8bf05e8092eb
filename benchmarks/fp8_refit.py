"""Bytes and time of a refit into an FP8 block engine against a bf16 one.

    PYTHONPATH=src python benchmarks/fp8_refit.py [--layers 4] [--trainer 3] [--repeats 3]

A Qwen3-shaped model (hidden 2048, 16 query heads and 4 key/value heads of 128,
intermediate 6144, ``--layers`` decoder layers, bf16) on ``--trainer`` FSDP2 ranks
(row shards: with 3 ranks they end mid-block, so blocks straddle two of them) refits an
engine of TP2 through the refit API (``RefitSender`` / ``RefitReceiver``, two jobs
meeting at a TCP store, local gloo processes): once with the engine in bf16, once with
its linears in FP8 blocks (``quant=BlockFormat()``: each trainer rank quantizes its own
rows after one ``all_reduce(MAX)`` of the blocks split across the trainer ranks, and
sends FP8 codes and scale rows). Per engine rank: the bytes received (and how many of
them are scales); per trainer rank: the amax bytes exchanged; the refit's time (the
slowest rank, median of ``--repeats`` refits after a first one) and, of it, the
trainer ranks' quantizing (amax exchange included). Each FP8 engine rank
checks one tensor bit for bit against the reference quantizer of the full tensor.
"""

from __future__ import annotations

import argparse
from datetime import timedelta

import torch

import reshard as R
from benchtools import slowest_median
from reshard.quant import BlockFormat, quantize_reference
from reshard.quant.targets import SCALE_SUFFIX, fp8_engine_layouts
from reshard.refit import RefitReceiver, RefitSender
from reshard.tools.launch import free_port, run_processes
from reshard.tools.synthetic import fill_local

H, Q, KV, INTER, TP = 2048, 2048, 512, 6144, 2
CHECKED = "model.layers.0.mlp.down_proj.weight"


def shapes(layers: int) -> dict[str, tuple[tuple[int, ...], int | None]]:
    """name -> (shape, the engine's split dim: 0 column-parallel, 1 row-parallel)."""
    out = {}
    for i in range(layers):
        p = f"model.layers.{i}"
        out.update({f"{p}.self_attn.q_proj.weight": ((Q, H), 0),
                    f"{p}.self_attn.k_proj.weight": ((KV, H), 0),
                    f"{p}.self_attn.v_proj.weight": ((KV, H), 0),
                    f"{p}.self_attn.o_proj.weight": ((H, Q), 1),
                    f"{p}.mlp.gate_proj.weight": ((INTER, H), 0),
                    f"{p}.mlp.up_proj.weight": ((INTER, H), 0),
                    f"{p}.mlp.down_proj.weight": ((H, INTER), 1),
                    f"{p}.input_layernorm.weight": ((H,), None)})
    return out


def trainer_layouts(layers: int, trainer: int) -> dict[str, R.Layout]:
    mesh = R.Mesh(list(range(trainer)))
    return {n: R.Layout(s, mesh, [R.Shard(0)], "bfloat16") for n, (s, _) in
            shapes(layers).items()}


def engine_layouts(layers: int, fp8: bool) -> dict[str, R.Layout]:
    mesh = R.Mesh(list(range(TP)))
    out = {n: R.Layout(s, mesh, [R.Replicate() if d is None else R.Shard(d)], "bfloat16")
           for n, (s, d) in shapes(layers).items()}
    return fp8_engine_layouts(out) if fp8 else out


def _job(rank: int, _world: int, port: int, args, fp8: bool) -> dict:
    opts = dict(host="127.0.0.1", port=port, trainer_size=args.trainer, inference_size=TP,
                timeout=timedelta(seconds=300))
    if rank < args.trainer:
        layouts = trainer_layouts(args.layers, args.trainer)
        params = {n: fill_local(lay, rank) for n, lay in layouts.items()}
        side = RefitSender(params, layouts=layouts, rank=rank, sparse="off", **opts)  # dense
        runs = [side.refit(v) for v in range(1, args.repeats + 2)]
    else:
        r = rank - args.trainer
        layouts = engine_layouts(args.layers, fp8)
        targets = {n: torch.zeros(lay.local_shape(r), dtype=getattr(torch, lay.dtype))
                   for n, lay in layouts.items()}
        side = RefitReceiver(targets, layouts, rank=r, quant=BlockFormat() if fp8 else None,
                             **opts)
        runs = [side.refit() for _ in range(args.repeats + 1)]
    side.comm.close()
    out = {"seconds": [s.seconds for s in runs[1:]], "received": runs[-1].bytes_received,
           "amax": runs[-1].amax_bytes, "quantize": [s.quantize_seconds for s in runs[1:]]}
    if rank >= args.trainer:
        out["scales"] = sum(t.numel() * 4 for n, t in targets.items()
                            if n.endswith(SCALE_SUFFIX))
        out["exact"] = _exact(targets, layouts, rank - args.trainer) if fp8 else None
    return out


def _exact(targets, layouts, r: int) -> bool:
    """One tensor's codes and scales against the reference quantizer of the full one."""
    lay = layouts[CHECKED]
    full = fill_local(R.Layout(lay.shape, R.Mesh([0]), [R.Replicate()], "bfloat16"), 0)
    q, scale = quantize_reference(full)
    scales = layouts[CHECKED + SCALE_SUFFIX]
    return (torch.equal(targets[CHECKED].view(torch.uint8), lay.shard(q.view(torch.uint8), r))
            and torch.equal(targets[CHECKED + SCALE_SUFFIX], scales.shard(scale, r)))


def run(args, fp8: bool) -> dict:
    results = run_processes(_job, args.trainer + TP, free_port(), args, fp8, init=False,
                            timeout=1200)
    engine = results[args.trainer:]
    return {"received": [e["received"] for e in engine], "scales": [e["scales"] for e in engine],
            "amax": results[0]["amax"], "exact": [e["exact"] for e in engine],
            "seconds": slowest_median(r["seconds"] for r in results),
            "quantize": slowest_median(r["quantize"] for r in results[:args.trainer])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--trainer", type=int, default=3, help="FSDP2 trainer ranks")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model = sum(2 * torch.Size(s).numel() for s, _ in shapes(args.layers).values())
    print(f"{args.layers} Qwen3-shaped layers ({model / 2**20:.0f} MiB bf16), FSDP2 "
          f"{args.trainer} ranks -> TP{TP}")
    print("| engine | bytes per engine rank | of which scales | amax per trainer rank | "
          "refit (s) | of which quantizing (s) |")
    print("|---|---|---|---|---|---|")
    for fp8 in (False, True):
        res = run(args, fp8)
        assert not fp8 or all(res["exact"]), res["exact"]
        print(f"| {'FP8 blocks 128x128' if fp8 else 'bf16'} | "
              f"{' / '.join(f'{b:,}' for b in res['received'])} | "
              f"{' / '.join(f'{b:,}' for b in res['scales'])} | {res['amax']:,} B | "
              f"{res['seconds']:.3f} | {res['quantize']:.3f} |")


if __name__ == "__main__":
    main()

"""The ``reshard`` command: ``reshard plan`` and ``reshard bench``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from reshard.errors import ReshardError
from reshard.tools.report import human_bytes, parse_bytes, print_table

__all__ = ["main"]


def cmd_bench(args: argparse.Namespace) -> int:
    if args.nodes:  # c10d warns once per rank that a namespace has no hostname entry
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from reshard.tools.bench import BenchConfig, run_bench

    cfg = BenchConfig(src=args.src, dst=args.dst, model_bytes=parse_bytes(args.model_bytes),
                      methods=tuple(args.methods.split(",")), repeats=args.repeats,
                      budget_bytes=parse_bytes(args.budget), dtype=args.dtype, nodes=args.nodes,
                      link_mbit=args.link_mbit, nic_per_rank=args.nic_per_rank,
                      dst_dtype=args.dst_dtype)
    if cfg.nic_per_rank and not cfg.nodes:
        print("reshard: error: --nic-per-rank needs --nodes K", file=sys.stderr)
        return 2
    if cfg.nodes:
        from reshard.tools.netns import cards_unavailable_reason, netns_unavailable_reason

        reason = netns_unavailable_reason()
        if reason is None and cfg.nic_per_rank:
            reason = cards_unavailable_reason()
        if reason:
            print(f"reshard: error: --nodes needs emulated nodes, which are unavailable "
                  f"here: {reason}", file=sys.stderr)
            return 2
    if not args.json:
        links = "a card per rank" if cfg.nic_per_rank else "links"
        where = (f" on {cfg.nodes} emulated nodes ({cfg.link_mbit:g} Mbit/s {links})"
                 if cfg.nodes else " on local processes")
        print(f"reshard bench: {cfg.src} -> {cfg.dst}, {human_bytes(cfg.model_bytes)} {cfg.dtype}"
              f"{where}, methods {','.join(cfg.methods)}, {cfg.repeats} timed refits each",
              flush=True)
    result = run_bench(cfg)
    floor = result["floor_seconds"]
    rows = [[m, f"{r['seconds']:.3f}", human_bytes(r["bytes"]), f"{r['gbps']:.2f}",
             f"{r['vs_floor']:.2f}x", human_bytes(r["peak_staging_bytes"]),
             "yes" if r["verified"] else "NO"] for m, r in result["methods"].items()]
    rows.append(["floor", f"{floor:.3f}", "", "", "1.00x", "", ""])
    if not args.json:
        print_table("refit time (median; slowest rank)", ["method", "seconds", "bytes sent",
               "GB/s", "vs floor", "peak staging", "bit-exact"], rows)
        if "quantize" in result:
            q = result["quantize"]
            print(f"FP8 blocks: the trainer ranks quantize in {q['seconds']:.3f} s (slowest "
                  f"rank; its amax exchange of {q['amax_bytes_per_source_rank']} B a rank "
                  "included), before any method moves the FP8 codes and scales above")
        if "link_bytes" in result:
            lb = result["link_bytes"]
            hb = human_bytes
            print(f"inter-node bytes: reshard {hb(lb['reshard']['inter'])} (lower bound "
                  f"{hb(lb['inter_lower_bound'])}), p2p {hb(lb['p2p']['inter'])}; "
                  f"intra-node forwarding: reshard {hb(lb['reshard']['intra'])}")
        if "speedup_vs_gather_broadcast" in result:
            print(f"reshard is {result['speedup_vs_gather_broadcast']:.2f}x faster than "
                  "gather_broadcast")
    print(json.dumps(result) if args.json else "", end="\n" if args.json else "")
    return 0 if all(r["verified"] for r in result["methods"].values()) else 1


def cmd_plan(args: argparse.Namespace) -> int:
    from reshard import planner
    from reshard.sim.models import preset, synthetic_model
    from reshard.sim.specs import ParallelSpec, model_layouts

    model = (synthetic_model(parse_bytes(args.model_bytes), dtype=args.dtype) if args.model is None
             else preset(args.model))
    src_spec = ParallelSpec.parse(args.src)
    t0 = time.perf_counter()
    src = model_layouts(model.tensors, src_spec)
    dst = model_layouts(model.tensors, args.dst, first_rank=src_spec.world_size)
    p = planner.plan(src, dst)
    s = p.stats()
    seconds = time.perf_counter() - t0
    if args.json:
        print(json.dumps({"model": model.name, "seconds": seconds, **s.as_dict()}))
        return 0
    rows = [["tensors", str(s.num_tensors)], ["bytes sent", human_bytes(s.bytes_sent)],
            ["bytes local", human_bytes(s.bytes_local)],
            ["max send / rank", f"{human_bytes(s.max_send_bytes)} (lower bound "
                                f"{human_bytes(s.send_lower_bound)})"],
            ["max recv / rank", f"{human_bytes(s.max_recv_bytes)} (lower bound "
                                f"{human_bytes(s.recv_lower_bound)})"],
            ["gather+broadcast payload", human_bytes(s.gather_broadcast_bytes)],
            ["gather+broadcast on the wire", human_bytes(s.gather_broadcast_wire_bytes)],
            ["planning time", f"{seconds:.3f} s"]]
    print_table(f"plan {model.name}: {args.src} -> {args.dst}", ["", ""], rows)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reshard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="time every method on local gloo processes")
    b.add_argument("--src", required=True, help="trainer layout, e.g. tp4, fsdp4, pp2,tp2")
    b.add_argument("--dst", required=True, help="inference layout, e.g. tp2,dp2")
    b.add_argument("--model-bytes", default="1GiB", help="size of the synthetic state")
    b.add_argument("--methods", default="reshard,p2p,gather_broadcast",
                   help="comma-separated; add +sum or +crc32 to a method (e.g. reshard+sum) "
                        "to time it with per-message checksums")
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--budget", default="256MiB", help="staging budget per rank")
    b.add_argument("--dtype", default="float32")
    b.add_argument("--dst-dtype", default=None, choices=["float8_e4m3fn"],
                   help="float8_e4m3fn: an FP8 block engine (linears quantized in 128x128 "
                        "blocks on the trainer ranks, shard by shard, sent with their scales)")
    b.add_argument("--nodes", type=int, default=0,
                   help="run on K emulated nodes (network namespaces + tc; needs root): "
                        "trainer ranks on the first half, inference ranks on the rest")
    b.add_argument("--link-mbit", type=float, default=500.0,
                   help="each emulated node's link rate (Mbit/s)")
    b.add_argument("--nic-per-rank", action="store_true",
                   help="with --nodes: every rank gets its own network card of --link-mbit "
                        "(a GPU node has one NIC per GPU) instead of one link per node")
    b.add_argument("--json", action="store_true", help="last line: one JSON object")
    b.set_defaults(func=cmd_bench)
    p = sub.add_parser("plan", help="print the statistics of a plan")
    p.add_argument("--model", default=None, help="a model preset, e.g. deepseek-v3")
    p.add_argument("--model-bytes", default="1GiB", help="synthetic model size (no --model)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--src", required=True)
    p.add_argument("--dst", required=True)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)
    from reshard.tools.simulate_cmd import register as register_simulate
    register_simulate(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ReshardError as e:
        print(f"reshard: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

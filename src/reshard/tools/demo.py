"""``make demo``: the brief's example, an RL loop refitting a real vLLM engine, and a
refit benchmark.

1. An 8x8 matrix row-sharded on 2 trainer ranks goes to 4 inference ranks that shard
   it by columns: every destination takes a 4x2 region from each source.
2. The main job (``reshard.tools.demo_rl``): a transformers Qwen3 trainer sharded with FSDP2
   over 2 gloo ranks and a vLLM engine (CPU, tensor parallel 2); each RL step generates
   with vLLM, trains, refits, and checks vLLM against transformers and vLLM's own loader.
3. A synthetic transformer state moves from a tp4 trainer to a tp2 x dp2 inference
   side on 8 local gloo processes with reshard, p2p and gather-and-broadcast, each
   verified bit for bit, timed against the floor.

It prints its own lines and errors only; ``--verbose`` (or ``RESHARD_VERBOSE=1``) shows
vLLM's, transformers' and torch's logs, warnings and progress bars too.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import reshard as R


def brief_example() -> None:
    src = R.Layout((8, 8), R.Mesh([0, 1], ["trainer_tp"]), [R.Shard(0)])
    dst = R.Layout((8, 8), R.Mesh([2, 3, 4, 5], ["infer_tp"]), [R.Shard(1)])
    plan = R.plan(src, dst)
    print("1) the brief's example: 8x8, rows on trainer ranks 0-1 -> columns on ranks 2-5")
    print(f"   {plan}")
    for t in plan.transfers():
        print(f"   rank {t.src_rank} rows {t.src_offset[0]}:{t.src_offset[0] + t.size[0]} "
              f"cols {t.src_offset[1]}:{t.src_offset[1] + t.size[1]} -> rank {t.dst_rank} "
              f"at {t.dst_offset} ({t.size[0]}x{t.size[1]}, {t.nbytes} B)")
    full = torch.arange(64.0).reshape(8, 8)
    out = R.execute_local(plan, {r: src.shard(full, r) for r in src.ranks})
    assert all(torch.equal(out[r], dst.shard(full, r)) for r in dst.ranks)
    s = plan.stats()
    print(f"   every destination verified; {s.bytes_sent} B sent vs {s.gather_broadcast_bytes} B "
          "logical payload for gather-and-broadcast\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verbose", action="store_true",
                    help="show the libraries' logs, warnings and progress bars (also "
                         "RESHARD_VERBOSE=1)")
    args = ap.parse_args(argv)
    brief_example()
    print("2) RL refit: FSDP2 trainer (2 gloo ranks) -> vLLM engine (TP=2, CPU)", flush=True)
    from reshard.tools.demo_rl import main as rl_main

    status = rl_main(["--verbose"] if args.verbose else [])
    if status == 2:
        print("   (vLLM is not installed: `make demo` installs it; skipping this part)")
    size = os.environ.get("RESHARD_DEMO_BYTES", "256MiB")
    print(f"\n3) refit of a {size} synthetic transformer: trainer tp4 (ranks 0-3) -> "
          "inference tp2 x dp2 (ranks 4-7)", flush=True)
    from reshard.tools.cli import main as cli_main

    bench = cli_main(["bench", "--src", "tp4", "--dst", "tp2,dp2", "--model-bytes", size])
    print("   (the README's figures are for 1 GiB, where the fixed cost per message weighs "
          "less against the floor: RESHARD_DEMO_BYTES=1GiB make demo, or `reshard bench "
          "--src tp4 --dst tp2,dp2 --model-bytes 1GiB --repeats 8`)")
    return status if status == 1 else bench


if __name__ == "__main__":
    sys.exit(main())

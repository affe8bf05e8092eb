"""How the gain of the domain-aware schedule depends on the speed of the network.

    sudo python benchmarks/link_sweep.py [--src tp4] [--dst tp2,dp2] [--model-bytes 256MiB]
        [--nodes 2] [--rates 500,1000,2000,4000,8000,16000] [--repeats 5]
        [--nic-per-rank] [--plot sweep.png] [--json]

Runs ``reshard bench`` once on plain local processes (one node, no slow link) and
once on emulated nodes per link rate (network namespaces and ``tc``: needs root),
every destination verified, and prints for each run ``reshard``'s speed-up over
``p2p`` and over ``gather_broadcast``. ``--plot`` draws both against the link rate,
with the single-node speed-up over ``gather_broadcast`` as a line. ``--nic-per-rank``
gives every rank its own card of each rate (as every GPU has its own NIC) instead of
one link per node.
"""

from __future__ import annotations

import argparse
import json

from benchtools import pyplot
from reshard.tools.bench import BenchConfig, run_bench
from reshard.tools.cli import parse_bytes


def _row(label: str, out: dict) -> dict:
    m = out["methods"]
    row = {"run": label, **{f"{k}_s": m[k]["seconds"] for k in m},
           "floor_s": out["floor_seconds"],
           "vs_p2p": m["p2p"]["seconds"] / m["reshard"]["seconds"],
           "vs_gather_broadcast": out["speedup_vs_gather_broadcast"],
           "verified": all(v["verified"] for v in m.values())}
    if "link_bytes" in out:
        row["link_bytes"] = out["link_bytes"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default="tp4")
    ap.add_argument("--dst", default="tp2,dp2")
    ap.add_argument("--model-bytes", default="256MiB")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--rates", default="500,1000,2000,4000,8000,16000",
                    help="node link rates in Mbit/s, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--nic-per-rank", action="store_true",
                    help="every rank gets its own card of each rate, not one link per node")
    ap.add_argument("--plot", help="write a chart of the speed-ups to this file")
    ap.add_argument("--json", action="store_true", help="last line: one JSON object")
    a = ap.parse_args()
    rates = [float(r) for r in a.rates.split(",")]
    base = dict(src=a.src, dst=a.dst, model_bytes=parse_bytes(a.model_bytes),
                methods=("reshard", "p2p", "gather_broadcast"), repeats=a.repeats)
    rows = [_row("one node", run_bench(BenchConfig(**base)))]
    print(_line(rows[-1]), flush=True)
    for rate in rates:
        out = run_bench(BenchConfig(**base, nodes=a.nodes, link_mbit=rate,
                                    nic_per_rank=a.nic_per_rank))
        per = "card" if a.nic_per_rank else "node"
        rows.append(_row(f"{a.nodes} nodes, {rate:g} Mbit/s per {per}", out)
                    | {"link_mbit": rate})
        print(_line(rows[-1]), flush=True)
    if a.plot:
        _plot(rows, a)
    if a.json:
        print(json.dumps({"src": a.src, "dst": a.dst, "model_bytes": base["model_bytes"],
                          "nic_per_rank": a.nic_per_rank, "runs": rows}))


def _line(row: dict) -> str:
    return (f"{row['run']:>33}: reshard {row['reshard_s']:.3f} s, p2p {row['p2p_s']:.3f} s, "
            f"gather_broadcast {row['gather_broadcast_s']:.3f} s, floor {row['floor_s']:.3f}"
            f" s -> {row['vs_p2p']:.2f}x vs p2p, {row['vs_gather_broadcast']:.2f}x vs G+B"
            f"{'' if row['verified'] else '  NOT VERIFIED'}")


def _plot(rows: list[dict], a: argparse.Namespace) -> None:
    plt = pyplot()

    net = [r for r in rows if "link_mbit" in r]
    x = [r["link_mbit"] for r in net]
    fig, ax = plt.subplots(figsize=(6.4, 4.4), layout="constrained")
    ax.plot(x, [r["vs_gather_broadcast"] for r in net], "o-", label="vs gather_broadcast")
    ax.plot(x, [r["vs_p2p"] for r in net], "s-", label="vs p2p")
    ax.axhline(rows[0]["vs_gather_broadcast"], ls="--", color="gray",
               label="vs gather_broadcast, one node")
    ax.set_xscale("log")
    ax.set_xticks(x, [f"{r:g}" for r in x])
    ax.minorticks_off()
    ax.set_ylim(0, 1.15 * max(r["vs_gather_broadcast"] for r in rows))
    ax.set_xlabel("link rate per " + ("rank's card" if a.nic_per_rank
                                      else "node") + " (Mbit/s)")
    ax.set_ylabel("reshard speed-up (x)")
    cards = ", a card per rank" if a.nic_per_rank else ""
    ax.set_title(f"{a.src} -> {a.dst}, {a.model_bytes}, {a.nodes} emulated nodes{cards}")
    fig.legend(loc="outside lower center", ncols=2, fontsize="small")
    fig.savefig(a.plot, dpi=120)
    print(f"wrote {a.plot}")


if __name__ == "__main__":
    main()

"""Predicted refit time against the number of inference replicas R, direct and relayed
(``reshard.sim.fleet``): DeepSeek-V3 and Qwen3-235B on the DGX H100 and GB200 presets,
and Kimi-K2 (1T, FP8) at checkpoint-engine's published scale.

    python benchmarks/simulate_fleet.py [--replicas 1,2,4,8,16,32,64] [--changed 0.01] [--json]

Each case plans and simulates one replica from the trainer's layout (the cost model of
``reshard simulate``), then every fleet size from its loads. Prints one markdown table
per case (the docs/fleets.md tables). ``--changed F``: a sparse refit's columns too, F
of the engine-dtype values changed (of an FP8 engine's codes and scales), direct and
relayed (``reshard.sim.fleet``).
"""

from __future__ import annotations

import argparse
import json

from reshard.quant.targets import FP8
from reshard.sim.fleet import fleet_curve
from reshard.sim.models import preset

#: (model preset, trainer spec, replica spec, engine dtype, clusters, fleet sizes or None)
CASES = (
    ("deepseek-v3", "pp16,ep16", "tp8", FP8, ("dgx-h100", "gb200-nvl72"), None),
    ("qwen3-235b-a22b", "pp4,ep16", "tp8", "bfloat16", ("dgx-h100", "gb200-nvl72"), None),
    # checkpoint-engine: Kimi-K2 on 256 H20 (~16 s) and "thousands of GPUs" (~20 s)
    ("kimi-k2", "pp16,ep16", "tp16", FP8, ("dgx-h100",), (1, 16, 64, 128)),
)


def run(replicas: tuple[int, ...], changed: float | None = None) -> list[dict]:
    out = []
    for name, src, replica, dtype, clusters, sizes in CASES:
        model = preset(name)
        for cluster in clusters:
            points = fleet_curve(model, src, replica, cluster, sizes or replicas,
                                 dst_dtype=dtype, changed=changed)
            out.append({"model": name, "src": src, "replica": replica, "dtype": dtype,
                        "cluster": cluster, "points": [p.as_dict() for p in points]})
    return out


def table(case: dict) -> str:
    gpus = int(case["replica"][2:])
    sparse = case["points"][0]["sparse_s"] is not None
    lines = [f"{case['model']} ({case['dtype']}), trainer {case['src']} -> replicas of "
             f"{case['replica']}, {case['cluster']}", "",
             "| R | GPUs | replica domains | direct s | relay s | trainer link copies "
             "(direct / relay) |" + (" sparse s (direct / relay) | sparse copies "
                                     "(direct / relay) |" if sparse else ""),
             "|---|---|---|---|---|---|" + ("---|---|" if sparse else "")]
    for p in case["points"]:
        lines.append(f"| {p['replicas']} | {p['replicas'] * gpus} | {p['domains']} | "
                     f"{p['direct_s']:.2f} | {p['relay_s']:.2f} | "
                     f"{p['trainer_copies_direct']} / {p['trainer_copies_relay']} |"
                     + (f" {p['sparse_s']:.2f} / {p['sparse_relay_s']:.2f} | "
                        f"{p['trainer_copies_sparse']:.2f} / "
                        f"{p['trainer_copies_sparse_relay']:.2f} |" if sparse else ""))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", default="1,2,4,8,16,32,64")
    ap.add_argument("--changed", type=float, default=None,
                    help="also a sparse refit with this fraction of the values changed")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    cases = run(tuple(int(x) for x in a.replicas.split(",")), a.changed)
    if a.json:
        print(json.dumps(cases, indent=2))
        return
    for case in cases:
        print(table(case) + "\n")


if __name__ == "__main__":
    main()

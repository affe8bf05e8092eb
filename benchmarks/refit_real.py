"""Refit at real model sizes into vLLM, against the ways RL frameworks refit vLLM today.

One run per model: an FSDP2 trainer (2 gloo ranks, float32 master weights, random values,
built on the meta device and sharded before any weight exists) and a vLLM CPU engine
(TP2, bfloat16, ``load_format="dummy"``). Models at real sizes from their configs:
Qwen3-0.6B, Llama-3.2-1B (tied), Qwen2.5-1.5B (tied), a Qwen3-MoE shape scaled down
(``--models``). Methods, each refitting the same engine ``1 + --repeats`` times (the
first is a warm-up; the median of the rest is reported):

* ``reshard``: ``RefitSender`` / ``reshard_refit`` (each engine rank receives its shard,
  then commits through vLLM's reload);
* ``gather_broadcast``: as OpenRLHF, TRL, verl's NCCL engine, NeMo RL and prime-rl run it
  and as vLLM's own ``nccl`` backend receives it: every trainer rank ``full_tensor()``s
  each parameter, rank 0 casts it to the engine's dtype and packs 1 GiB buckets, and
  broadcasts each to every engine worker (gloo), which unpacks it and calls vLLM's
  ``load_weights`` inside vLLM's layerwise reload;
* ``disk``: rank 0 writes safetensors shards (1 GiB, bf16, gathered tensor by tensor),
  then every engine worker runs vLLM's ``reload_weights`` over them (prime-rl's and
  AReaL's file modes);
* vLLM 0.32's own weight-transfer backends: none runs on CPU (:data:`VLLM_BACKENDS`);
* ``reshard_sparse`` (not run unless named): reshard with ``sparse="on"`` (issue 39,
  ``docs/sparse.md``). After a dense refit (the base), at each fraction of ``--changed``,
  ``--repeats`` times: the trainer changes about that fraction of its bf16 values (each
  element with that probability, by two bf16 ulps: ``sparse_refit.change``) before each of
  a dense refit of the same sender (``dense=True``), an untimed sparse one, and the timed
  sparse one; reported per fraction (``refit_real_report.sparse_table``): the trainer
  ranks' wire bytes against the dense bytes they replaced, each refit's time before vLLM's
  commit (the trainer's ``refit()``) and with it (the driver's wall clock), the detection.

vLLM 0.32 CPU redoes MoE experts' pad + prepack only on a first load: its own reload
leaves them unpacked under a kernel that reads them packed. The gather-and-broadcast and
disk methods here get the work-around reshard's commit uses (``reset_moe_kernels``).

Per model x method (reshard_sparse: per fraction, above): refit seconds (driver wall
clock, from the command to both jobs done), bytes each engine rank received, peak extra
resident memory of trainer rank 0 and of each engine rank over the method's set-up and
refits, and the floor (a bare exchange of exactly the bytes each engine rank needs, per
rank pair, over reshard's gloo group, as ``reshard bench`` measures it). After each method
the engine's fingerprint (every parameter as held, every packed CPU GEMM through its
output; ``refit_real_engine.BenchExtension``) must equal that of vLLM's own reload of the
trainer's state from disk at the same version (the disk method's own check reloads
through gather-and-broadcast's ``load_weights``; reshard_sparse's last refit, the one
checked, is sparse).

    PYTHONPATH=src .venv/bin/python benchmarks/refit_real.py --models qwen3-0.6b \\
        --repeats 3 --out /tmp/refit_real
    PYTHONPATH=src .venv/bin/python benchmarks/refit_real.py --models qwen3-0.6b \\
        --methods reshard_sparse --changed 0.001,0.01,0.05,1 --repeats 2
    PYTHONPATH=src .venv/bin/python benchmarks/refit_real.py --plot /tmp/refit_real/results.json \\
        --png docs/refit_real.png
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from benchtools import MemoryWatch, available_bytes, write_json
from refit_real_models import METHODS, MODELS, VLLM_BACKENDS, GiB, count_params, expected_peak_bytes
from refit_real_report import breakdown, cpu_table, plot, sparse_table, table
from refit_real_run import Run
from reshard.defaults import DEFAULT_COMMIT_HEAP_SLACK_BYTES, DEFAULT_REFIT_BUDGET_BYTES

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen3-0.6b,llama-3.2-1b,qwen2.5-1.5b,qwen3-moe-1.4b",
                    help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help=f"comma-separated, of {', '.join(METHODS)}, reshard_sparse")
    ap.add_argument("--changed", default="0.01,1",
                    help="reshard_sparse: the fractions of values changed before its refits")
    ap.add_argument("--repeats", type=int, default=3, help="timed refits per method (median)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/refit_real"))
    ap.add_argument("--plot", type=Path, help="only plot this results.json (with --png)")
    ap.add_argument("--png", type=Path, default=None)
    ap.add_argument("--max-gib", type=float, default=12.0,
                    help="skip a model whose expected peak is above this (this run's share "
                         "of the host)")
    ap.add_argument("--margin-gib", type=float, default=2.0,
                    help="skip a model unless its expected peak plus this fits in memory")
    ap.add_argument("--budget-mib", type=int, default=DEFAULT_REFIT_BUDGET_BYTES >> 20,
                    help="reshard's staging budget per rank and round (MiB)")
    ap.add_argument("--heap-slack-mib", type=int,
                    default=DEFAULT_COMMIT_HEAP_SLACK_BYTES >> 20,
                    help="the freed heap reshard's commit keeps resident before handing it "
                         "back (MiB; -1: keep it all, for a faster commit)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one reshard refit on trainer rank 0 and engine rank 0")
    a = ap.parse_args(argv)
    if a.plot:
        results = json.loads(a.plot.read_text())["results"]
        print(*tables(results), sep="\n\n")
        if a.png:
            plot(results, a.png)
        return 0
    cores = sorted(os.sched_getaffinity(0))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{cores[0]}|{cores[-1]}")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # vLLM's workers import the extension from here
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(HERE), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    sys.path.insert(0, str(HERE))
    a.out.mkdir(parents=True, exist_ok=True)
    header = {"uptime_start": subprocess.run(["uptime"], capture_output=True, text=True
                                             ).stdout.strip(),
              "command": " ".join(sys.argv), "vllm_backends": VLLM_BACKENDS}
    results, watch = [], MemoryWatch()
    for name in a.models.split(","):
        need, free = expected_peak_bytes(count_params(*MODELS[name])), available_bytes()
        if need + a.margin_gib * GiB > free or need > a.max_gib * GiB:
            print(f"[{name}] skipped: it needs about {need / GiB:.1f} GiB (at most "
                  f"{a.max_gib} GiB allowed) and {free / GiB:.1f} GiB is available (margin "
                  f"{a.margin_gib} GiB)")
            header.setdefault("skipped", {})[name] = {"need": need, "available": free}
            continue
        run = Run(name, a.repeats, a.out / name, watch)
        run.profile, run.budget = a.profile, a.budget_mib << 20
        run.heap_slack = None if a.heap_slack_mib < 0 else a.heap_slack_mib << 20
        run.changed = [float(f) for f in a.changed.split(",")]
        try:
            results.append(run.run(a.methods.split(",")))
        finally:
            run.close()
        shutil.rmtree(a.out / name / "checkpoint", ignore_errors=True)
        write_json(a.out / "results.json", {**header, "results": results})
    header["uptime_end"] = subprocess.run(["uptime"], capture_output=True, text=True
                                          ).stdout.strip()
    write_json(a.out / "results.json", {**header, "results": results})
    print(*tables(results), sep="\n\n")
    print(f"load: start {header['uptime_start']}; end {header['uptime_end']}")
    if a.png:
        plot(results, a.png)
    return 0 if all(m["check"]["ok"] for r in results for m in r["methods"].values()) else 1


def tables(results: list[dict]) -> list[str]:
    """The tables of a run that have rows (those of methods that ran): each method's,
    reshard's breakdown, CPU, reshard_sparse's."""
    out = [table(results), breakdown(results), cpu_table(results), sparse_table(results)]
    return [t for t in out if t.count("\n") > 1]  # more than the header and its rule


if __name__ == "__main__":
    sys.exit(main())

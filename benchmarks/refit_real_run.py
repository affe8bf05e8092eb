"""One model of ``benchmarks/refit_real.py`` (:class:`Run`): the trainer, the engine
(``refit_real_engine.BenchExtension``), every method in turn, each checked against a fresh
reload from disk.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

from benchtools import MemoryWatch, cpu_medians, cpu_spent, load_avg, median, tree_cpu
from refit_real_models import ARCHITECTURES, BUCKET_BYTES, MODELS
from refit_real_trainer import Trainer
from reshard.defaults import DEFAULT_COMMIT_HEAP_SLACK_BYTES, DEFAULT_REFIT_BUDGET_BYTES


def start_engine(kind: str, cfg: dict, work: Path) -> Any:
    from transformers import AutoConfig
    from vllm import LLM

    from reshard.tools.rl_task import KV_CACHE_BYTES

    model_dir = work / "config"
    config = AutoConfig.for_model(kind, **cfg)
    config.architectures = [ARCHITECTURES[kind]]
    config.save_pretrained(model_dir)
    return LLM(model=str(model_dir), load_format="dummy", tensor_parallel_size=2,
               dtype="bfloat16", enforce_eager=True, max_model_len=512, max_num_seqs=4,
               skip_tokenizer_init=True, seed=0, kv_cache_memory_bytes=KV_CACHE_BYTES,
               worker_extension_cls="refit_real_engine.BenchExtension")


def mismatches(got: list[dict], ref: list[dict]) -> list[str]:
    """Fingerprint entries that differ between two engines' states, per rank."""
    bad = []
    for rank, (a, b) in enumerate(zip(got, ref)):
        keys = sorted(set(a) | set(b))
        bad += [f"rank {rank}: {k}" for k in keys if a.get(k) != b.get(k)]
    return bad


class Run:
    """One model: the trainer, the engine, every method in turn."""

    def __init__(self, name: str, repeats: int, work: Path, watch: MemoryWatch) -> None:
        from reshard.tools.launch import free_port

        self.name, self.repeats, self.work, self.watch = name, repeats, work, watch
        self.budget = DEFAULT_REFIT_BUDGET_BYTES  # reshard's staging budget (--budget-mib)
        # the freed heap a commit keeps resident (--heap-slack-mib; None: all of it)
        self.heap_slack: int | None = DEFAULT_COMMIT_HEAP_SLACK_BYTES
        self.changed = [0.01, 1.0]  # reshard_sparse's fractions of values changed (--changed)
        self.kind, self.cfg = MODELS[name]
        self.free_port = free_port
        t0 = time.perf_counter()
        self.trainer = Trainer(self.kind, self.cfg)
        self.params = self.trainer.ready[0]["params"]
        self.meta = self.trainer.ready[0]["meta"]
        print(f"[{name}] trainer built ({self.params:,} parameters) in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        t0 = time.perf_counter()
        self.llm = start_engine(self.kind, self.cfg, work)
        print(f"[{name}] vLLM engine (TP2, bf16) up in {time.perf_counter() - t0:.1f} s",
              flush=True)
        self.version, self.profile = 0, False
        self.cpu: list[dict[str, float]] = []  # per timed refit: CPU seconds per role
        self.result: dict[str, Any] = {"model": name, "params": self.params, "methods": {}}

    def collective(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        from reshard.integrations.vllm import collective

        return collective(self.llm, method, *args, **kwargs)

    def mem_start(self) -> None:
        self.trainer.call("mem_start")
        self.collective("bench_mem_start")

    def mem_peaks(self) -> dict[str, Any]:
        return {"trainer0_peak_extra": self.trainer.call("mem_peak")[0]["peak_extra"],
                "engine_peak_extra": self.collective("bench_mem_peak")}

    def timed(self, refit) -> tuple[list[float], list[Any]]:
        """``1 + repeats`` refits, each after a perturbation (untimed); the first is a
        warm-up. Returns the timed seconds and each refit's details."""
        seconds, details = [], []
        for i in range(1 + self.repeats):
            self.version += 1
            self.trainer.call("perturb")
            cpu0, t0 = tree_cpu(os.getpid()), time.perf_counter()
            detail = refit(self.version)
            if i:
                seconds.append(time.perf_counter() - t0)
                self.cpu.append(cpu_spent(cpu0, tree_cpu(os.getpid())))
                details.append(detail)
        return seconds, details

    def cpu_medians(self) -> dict[str, float]:
        """The median CPU seconds per role over the refits timed since the last call."""
        spent, self.cpu = self.cpu, []
        return cpu_medians(spent)

    # -- methods -------------------------------------------------------------------------
    def meet(self, sparse: str) -> tuple[float, list[dict]]:
        """Meet the engine (RefitSender's ``sparse`` mode): the seconds, each rank's info."""
        port = self.free_port()
        t0 = time.perf_counter()
        self.trainer.send("reshard_init", port, 2, self.budget, sparse)
        infos = self.collective("reshard_init", "127.0.0.1", port, 2, timeout_s=600.0,
                                budget_bytes=self.budget, heap_slack_bytes=self.heap_slack)
        self.trainer.wait("reshard_init")
        return time.perf_counter() - t0, infos

    def refit(self, version: int, dense: bool = False) -> dict:
        """One refit: the trainer's send and the engine's receive and commit at once."""
        self.trainer.send("reshard", version, dense)
        engine = self.collective("reshard_refit")
        return {"engine": engine, "trainer": self.trainer.wait("reshard")}

    def reshard(self, before: list[dict]) -> dict[str, Any]:
        init_s, infos = self.meet("off")
        seconds, details = self.timed(self.refit)
        if self.profile:
            self.version += 1
            self.trainer.send("reshard_profile", self.version)
            print(self.collective("bench_profile_refit")[0])
            print(self.trainer.wait("reshard_profile")[0]["profile"], flush=True)
        out = {"seconds": seconds, "init_seconds": init_s, "cpu_seconds": self.cpu_medians(),
               "budget_bytes": self.budget, "heap_slack_bytes": self.heap_slack,
               "bytes_received": [r["bytes_received"] for r in details[-1]["engine"]],
               "expected_bytes": [i["expected_bytes"] for i in infos],
               "buffer_bytes": [i["buffer_bytes"] for i in infos],
               # received into the engine's own unread LM head weight: no buffer
               "own_storage_bytes": [i.get("own_storage_bytes", 0) for i in infos],
               "shadow_bytes": [i["shadow_bytes"] for i in infos],
               "breakdown": [{
                   "trainer_transfer": max(t["transfer_seconds"] for t in d["trainer"]),
                   "receive": max(e["receive_seconds"] for e in d["engine"]),
                   "commit": max(e["commit_seconds"] for e in d["engine"]),
                   "engine_total": max(e["seconds"] for e in d["engine"])} for d in details],
               "staging_bytes": [e["staging_bytes"] for e in details[-1]["engine"]],
               # the last refit's resident memory beyond the engine's at init, per rank:
               # at the start, its peak while receiving, its peak in all, at the end
               "engine_memory_phases": [
                   {k: e.get(k) for k in ("rss_extra_start", "peak_rss_extra_receive",
                                          "peak_rss_extra", "rss_extra")}
                   for e in details[-1]["engine"]]}
        out.update(self.mem_peaks())
        out["check"] = self.check(before)
        out["floor"] = self.floor()
        self.trainer.call("reshard_close")
        self.collective("reshard_close")
        return out

    def reshard_sparse(self, before: list[dict]) -> dict[str, Any]:
        """Sparse refits (``sparse="on"``) against dense ones of the same sender, in turn,
        at each fraction of ``self.changed``: before each refit the trainer changes about
        that fraction of its values (``sparse_refit.change``). After a first dense refit
        (every weight changed: the base), each repeat is a dense refit, an untimed sparse
        one, then the timed sparse one (which so follows a sparse refit, as in an RL
        loop); the last refit is sparse, and so is the state checked."""
        init_s, infos = self.meet("on")
        self.version += 1
        self.trainer.call("perturb")
        self.refit(self.version)
        rows = []
        for fraction in self.changed:
            row: dict[str, Any] = {"changed": fraction, "sparse": [], "dense": []}
            for _ in range(self.repeats):
                for kind in ("dense", "lead", "sparse"):
                    self.version += 1
                    self.trainer.call("change", fraction)
                    t0 = time.perf_counter()
                    detail = self.refit(self.version, dense=kind == "dense")
                    detail["seconds"] = time.perf_counter() - t0
                    if kind == "sparse" and any(t["sparse"] is None for t in detail["trainer"]):
                        raise RuntimeError(f"refit {self.version} was to be sparse: "
                                           f"{detail['trainer']}")
                    if kind != "lead":
                        row[kind].append(detail)
            rows.append(row)
            print(f"[{self.name}] reshard_sparse at {fraction:g}: sparse "
                  f"{median([d['seconds'] for d in row['sparse']]):.3f} s, dense "
                  f"{median([d['seconds'] for d in row['dense']]):.3f} s (with vLLM's "
                  "commit)", flush=True)
        out = {"changed": rows, "init_seconds": init_s, "budget_bytes": self.budget,
               "state_bytes": [t["state_bytes"] for t in rows[-1]["sparse"][-1]["trainer"]],
               "shadow_bytes": [i["shadow_bytes"] for i in infos],
               "bytes_received": [e["bytes_received"]
                                  for e in rows[-1]["sparse"][-1]["engine"]]}
        out.update(self.mem_peaks())
        out["check"] = self.check(before)
        self.trainer.call("reshard_close")
        self.collective("reshard_close")
        return out

    def floor(self) -> dict[str, Any]:
        seconds, cpu = [], []
        for _ in range(1 + self.repeats):
            cpu0, t0 = tree_cpu(os.getpid()), time.perf_counter()
            self.trainer.send("floor")
            inner = self.collective("bench_floor")
            self.trainer.wait("floor")
            seconds.append(time.perf_counter() - t0)
            cpu.append(cpu_spent(cpu0, tree_cpu(os.getpid())))
        self.collective("bench_floor_close")
        return {"seconds": seconds[1:], "inner_seconds": max(r["seconds"] for r in inner),
                "cpu_seconds": cpu_medians(cpu[1:])}

    def gather_broadcast(self, before: list[dict]) -> dict[str, Any]:
        port = self.free_port()
        self.trainer.send("gb_init", port, 2)
        self.collective("bench_gb_init", "127.0.0.1", port, self.meta, BUCKET_BYTES)
        self.trainer.wait("gb_init")

        def refit(version: int) -> dict:
            self.trainer.send("gb", BUCKET_BYTES)
            engine = self.collective("bench_gb_refit")
            return {"engine": engine, "trainer": self.trainer.wait("gb")}

        seconds, details = self.timed(refit)
        out = {"seconds": seconds,
               "bytes_received": [e["bytes_received"] for e in details[-1]["engine"]],
               "load_seconds": median([max(e["load_seconds"] for e in d["engine"])
                                       for d in details])}
        out.update(self.mem_peaks())
        out["check"] = self.check(before)
        return out

    def disk(self, before: list[dict]) -> dict[str, Any]:
        directory = self.work / "checkpoint"

        def refit(version: int) -> dict:
            saved = self.trainer.call("save", str(directory))
            return {"saved": saved, "engine": self.collective("bench_disk_reload",
                                                              str(directory))}

        seconds, details = self.timed(refit)
        out = {"seconds": seconds,
               "bytes_received": [e["bytes_received"] for e in details[-1]["engine"]],
               "save_seconds": median([d["saved"][0]["seconds"] for d in details]),
               "reload_seconds": median([max(e["seconds"] for e in d["engine"])
                                         for d in details])}
        out.update(self.mem_peaks())
        out["check"] = self.check(before, reference="gather_broadcast")
        return out

    # -- the check -----------------------------------------------------------------------
    def check(self, before: list[dict], reference: str = "disk") -> dict[str, Any]:
        """The engine's fingerprint now against vLLM's own load of the same state: a
        reload from disk, or (for the disk method) gather-and-broadcast's load_weights;
        and against ``before`` (the method's start): every entry must have changed."""
        got = self.collective("bench_fingerprint")
        unchanged = [f"rank {r}: {k}" for r, (a, b) in enumerate(zip(got, before))
                     for k in a if a[k] == b.get(k)]
        if reference == "disk":
            directory = self.work / "reference"
            self.trainer.call("save", str(directory))
            self.collective("bench_disk_reload", str(directory))
            shutil.rmtree(directory, ignore_errors=True)
        else:
            port = self.free_port()
            self.trainer.send("gb_init", port, 2)
            self.collective("bench_gb_init", "127.0.0.1", port, self.meta, BUCKET_BYTES)
            self.trainer.wait("gb_init")
            self.trainer.send("gb", BUCKET_BYTES)
            self.collective("bench_gb_refit")
            self.trainer.wait("gb")
            self.trainer.call("gb_close")
            self.collective("bench_gb_close")
        bad = mismatches(got, self.collective("bench_fingerprint"))
        return {"reference": reference, "entries": sum(len(g) for g in got),
                "ok": not bad and not unchanged, "mismatched": bad[:10],
                "unchanged": unchanged[:10]}

    def run(self, methods: list[str]) -> dict[str, Any]:
        for method in methods:
            before = self.collective("bench_fingerprint")
            self.watch.take()
            self.mem_start()
            out = getattr(self, method)(before)
            out.setdefault("cpu_seconds", self.cpu_medians())
            out["load"] = load_avg()
            out["tree_peak_rss"] = self.watch.take()
            if method == "gather_broadcast":
                self.trainer.call("gb_close")
                self.collective("bench_gb_close")
            self.result["methods"][method] = out
            timing = "per fraction above"  # reshard_sparse: no one time
            if "seconds" in out:
                out["median"] = median(out["seconds"])
                timing = f"{out['median']:.3f} s (median of {len(out['seconds'])})"
            print(f"[{self.name}] {method}: {timing}, received {out['bytes_received']} B, "
                  f"check {'OK' if out['check']['ok'] else 'FAIL'}, load {out['load']}",
                  flush=True)
        return self.result

    def close(self) -> None:
        from reshard.tools.rl_task import shutdown

        self.trainer.stop()
        shutdown(self.llm)

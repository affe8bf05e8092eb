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
* vLLM 0.32's own weight-transfer backends: none runs on CPU (:data:`VLLM_BACKENDS`).

vLLM 0.32 CPU redoes MoE experts' pad + prepack only on a first load: its own reload
leaves them unpacked under a kernel that reads them packed. The gather-and-broadcast and
disk methods here get the work-around reshard's commit uses (``reset_moe_kernels``).

Per model x method: refit seconds (driver wall clock, from the command to both jobs done),
bytes each engine rank received, peak extra resident memory of trainer rank 0 and of each
engine rank over the method's set-up and refits, and the floor (a bare exchange of exactly
the bytes each engine rank needs, per rank pair, over reshard's gloo group, as ``reshard
bench`` measures it). After each method the engine's fingerprint (every parameter as held,
every packed CPU GEMM through its output; ``refit_real_engine.BenchExtension``) must equal
that of vLLM's own reload of the trainer's state from disk at the same version (the disk
method's own check reloads through gather-and-broadcast's ``load_weights``).

    PYTHONPATH=src .venv/bin/python benchmarks/refit_real.py --models qwen3-0.6b \\
        --repeats 3 --out /tmp/refit_real
    PYTHONPATH=src .venv/bin/python benchmarks/refit_real.py --plot /tmp/refit_real/results.json \\
        --png docs/refit_real.png
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from reshard.defaults import DEFAULT_COMMIT_HEAP_SLACK_BYTES, DEFAULT_REFIT_BUDGET_BYTES

HERE = Path(__file__).resolve().parent
GiB = 1 << 30

_QWEN25_15B = dict(
    hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
    num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
    max_position_embeddings=32768, rms_norm_eps=1e-6)
# Qwen3-30B-A3B's layer shapes (hidden 2048, 32 heads of 128, 4 kv heads, experts of
# 768, top-8, vocabulary 151936 untied), 8 layers of 16 experts: 1.38B parameters
_QWEN3_MOE = dict(
    hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    num_experts=16, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[],
    norm_topk_prob=True, vocab_size=151936, tie_word_embeddings=False,
    max_position_embeddings=40960, rms_norm_eps=1e-6)
#: (transformers model_type, config) of each model, sizes from the published configs.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-0.6b": ("qwen3", dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
        max_position_embeddings=40960, rms_norm_eps=1e-6)),
    "llama-3.2-1b": ("llama", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
        max_position_embeddings=131072, rms_norm_eps=1e-5)),
    "qwen2.5-1.5b": ("qwen2", _QWEN25_15B),
    "qwen3-moe-1.4b": ("qwen3_moe", _QWEN3_MOE),
    # what fits a 12 GiB share of a 24 GiB host (expected_peak_bytes): Qwen2.5-0.5B, and
    # the shapes above cut to fewer layers and experts
    "qwen2.5-0.5b": ("qwen2", dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
        max_position_embeddings=32768, rms_norm_eps=1e-6)),
    "qwen2.5-1.5b-12l": ("qwen2", {**_QWEN25_15B, "num_hidden_layers": 12}),
    "qwen3-moe-0.8b": ("qwen3_moe", {**_QWEN3_MOE, "num_hidden_layers": 3, "num_experts": 8}),
    # for developing the benchmark
    "tiny": ("qwen3", dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=4096, tie_word_embeddings=True)),
    "tiny-moe": ("qwen3_moe", dict(
        hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True, vocab_size=4096, tie_word_embeddings=False)),
}
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
METHODS = ("reshard", "gather_broadcast", "disk")

#: vLLM 0.32's weight-transfer backends (vllm/distributed/weight_transfer/) and why none
#: can run on a CPU-only host.
VLLM_BACKENDS = {
    "nccl": "PyNcclCommunicator (NCCL, CUDA only) and torch.cuda streams in its packed "
            "broadcast; its protocol (packed buckets + load_weights in layerwise reload) is "
            "what gather_broadcast runs here over gloo",
    "sparse_nccl": "PyNcclCommunicator and torch.cuda.current_stream (sparse patches)",
    "ipc": "CUDA IPC handles (rebuild_cuda_tensor, torch.cuda.get_device_properties)",
    "nccl_m2n": "ncclReshard (nccl-extensions, CUDA) and torch.cuda streams",
    "sharded_rdt": "Ray Direct Transport over NIXL with torch.cuda streams and events "
                   "(and distributed_executor_backend='ray')",
    "modelexpress": "an external package (ModelExpress), not installed with vLLM",
}


#: vLLM's default packed bucket (``DEFAULT_PACKED_BUFFER_SIZE_BYTES``)
BUCKET_BYTES = GiB
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def packed_buckets(meta: list[tuple[str, list[int], str]], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``meta`` (name, shape, dtype) per packed bucket, cut as vLLM's
    ``pack_tensors`` cuts them: a bucket closes after the tensor that takes it past
    ``bucket_bytes``."""
    out: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i, (_, shape, dtype) in enumerate(meta):
        cur.append(i)
        size += nbytes(shape, dtype)
        if size > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
    return out + ([cur] if cur else [])


def nbytes(shape: list[int], dtype: str) -> int:
    n = ITEMSIZE[dtype]
    for s in shape:
        n *= s
    return n


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def count_params(kind: str, cfg: dict[str, Any]) -> int:
    """Parameters of the model (built on the meta device; tied tensors once)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **cfg))
    return sum(p.numel() for p in model.parameters())


def expected_peak_bytes(params: int) -> int:
    """This run's resident memory at its peak, as measured at Qwen3-0.6B (about 11 GB):
    fp32 trainer shards (4 B a parameter), the engine's bf16 weights and reshard's
    buffers of the same size (2 + 2 B), and about 6 GiB of processes (2 trainer ranks,
    the driver, vLLM's engine core and 2 workers)."""
    return 8 * params + 6 * GiB


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def load_avg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _descendants(pid: int) -> dict[int, list[str]]:
    """``pid`` and all its descendants: pid -> the fields of ``/proc/PID/stat`` after the
    command (state first), with the command's name appended."""
    children: dict[int, list[int]] = {}
    stat: dict[int, list[str]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            head, tail = (d / "stat").read_text().rsplit(")", 1)
            fields = tail.split() + [head.split("(", 1)[1]]
            children.setdefault(int(fields[1]), []).append(int(d.name))
            stat[int(d.name)] = fields
        except (OSError, IndexError, ValueError):
            continue
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        if p in stat:
            out[p] = stat[p]
        todo += children.get(p, [])
    return out


def tree_rss(pid: int) -> int:
    """Resident memory of ``pid`` and all its descendants, in bytes."""
    page = os.sysconf("SC_PAGE_SIZE")
    return sum(int(f[21]) * page for f in _descendants(pid).values())


#: Who a process of the run is, from its name (vLLM names its own; the rest are the
#: trainer ranks, which this driver starts).
def _role(pid: int, name: str) -> str:
    if pid == os.getpid():
        return "driver"
    if name.startswith("VLLM::EngineCor"):
        return "engine core"
    if name.startswith("VLLM::Worker"):
        return "engine workers"
    return "trainer ranks"


def tree_cpu(pid: int) -> dict[int, tuple[str, float, int]]:
    """CPU seconds (user + system) and minor page faults so far of ``pid`` and each
    descendant, with its role."""
    tick = os.sysconf("SC_CLK_TCK")
    return {p: (_role(p, f[-1]), (int(f[11]) + int(f[12])) / tick, int(f[7]))
            for p, f in _descendants(pid).items()}


def cpu_spent(before: dict[int, tuple[str, float, int]],
              after: dict[int, tuple[str, float, int]]) -> dict[str, float]:
    """CPU seconds spent between two :func:`tree_cpu` samples, per role, and the page
    faults taken (``faults <role>``: each first touch of a page the process had not
    held, which this host pays dearly for)."""
    out: dict[str, float] = {}
    for p, (role, t, faults) in after.items():
        _, t0, f0 = before.get(p, (role, 0.0, 0))
        out[role] = out.get(role, 0.0) + t - t0
        out[f"faults {role}"] = out.get(f"faults {role}", 0) + faults - f0
    return out


def cpu_medians(spent: list[dict[str, float]]) -> dict[str, float]:
    """Per role (and its page faults), the median over refits of :func:`cpu_spent`."""
    roles = sorted({r for c in spent for r in c})
    return {r: median([c.get(r, 0.0) for c in spent]) for r in roles}


class MemoryWatch:
    """The peak resident memory of this process tree, sampled every 0.5 s."""

    def __init__(self) -> None:
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.peak = max(self.peak, tree_rss(os.getpid()))

    def take(self) -> int:
        peak, self.peak = self.peak, 0
        return peak


# ------------------------------------------------------------------------------ trainer

def build_model(kind: str, cfg: dict[str, Any]) -> Any:
    """A transformers model of ``cfg``, sharded with FSDP2 on the meta device, then given
    random float32 values shard by shard: no rank ever holds a full model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from reshard.integrations import hf

    config = AutoConfig.for_model(kind, **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hf.shard_fsdp2(model)
    model.to_empty(device="cpu")
    rank = torch.distributed.get_rank()
    with torch.no_grad():
        for i, (_, p) in enumerate(model.named_parameters()):
            local = p.to_local() if hasattr(p, "to_local") else p
            g = torch.Generator().manual_seed(1000 * i + rank)
            if p.dim() >= 2:
                local.normal_(0.0, 0.02, generator=g)
            else:
                local.uniform_(0.5, 1.5, generator=g)
    return model


def checkpoint_meta(params: dict[str, Any], model_type: str) -> list[tuple[str, list[int], str]]:
    """(checkpoint name, shape, dtype) of every tensor a full state sends, in order."""
    import torch

    from reshard.integrations.hf import checkpoint_state_dict

    out = []
    for name, p in params.items():
        fake = {name: torch.empty(tuple(p.shape), device="meta")}
        out += [(n, list(t.shape), "bfloat16")
                for n, t in checkpoint_state_dict(fake, model_type).items()]
    return out


def full_tensors(params: dict[str, Any], model_type: str, rank: int):
    """Every parameter gathered (``full_tensor()``, collective over the trainer ranks) and,
    on rank 0, cast to bfloat16 in checkpoint form: (name, tensor) pairs, one at a time."""
    import torch

    from reshard.integrations.hf import checkpoint_state_dict

    for name, p in params.items():
        data = p.detach()
        full = data.full_tensor() if hasattr(data, "full_tensor") else data
        if rank == 0:
            for n, t in checkpoint_state_dict({name: full}, model_type).items():
                yield n, t.to(torch.bfloat16).contiguous()
        del full


def send_gather_broadcast(params, model_type: str, rank: int, comm, bucket_bytes: int) -> int:
    """Rank 0 packs the gathered tensors into buckets cut as vLLM's ``pack_tensors``
    cuts them and broadcasts each; returns the bytes broadcast."""
    import torch
    import torch.distributed as dist

    sent, pending, size = 0, [], 0

    def flush() -> int:
        packed = torch.cat([t.reshape(-1).view(torch.uint8) for t in pending])
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        comm.pg.broadcast([packed], opts).wait()
        pending.clear()
        return packed.numel()

    for _, t in full_tensors(params, model_type, rank):
        pending.append(t)
        size += t.numel() * t.element_size()
        if size > bucket_bytes:
            sent += flush()
            size = 0
    return sent + (flush() if pending else 0)


def save_safetensors(params, model_type: str, rank: int, directory: Path,
                     shard_bytes: int = GiB) -> int:
    """Rank 0 writes the gathered state as safetensors shards of ``shard_bytes``."""
    from safetensors.torch import save_file

    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
    written, pending, size, k = 0, {}, 0, 0
    for n, t in full_tensors(params, model_type, rank):
        pending[n] = t
        size += t.numel() * t.element_size()
        if size > shard_bytes:
            save_file(pending, str(directory / f"model-{k:05d}.safetensors"))
            written, pending, size, k = written + size, {}, 0, k + 1
    if pending:
        save_file(pending, str(directory / f"model-{k:05d}.safetensors"))
        written += size
    return written


def trainer(rank: int, world: int, kind: str, cfg: dict, commands: list, replies: Any) -> None:
    import torch

    from reshard.integrations import hf
    from reshard.integrations.vllm.memory import (
        reset_peak_rss,
        return_freed_memory,
        rss_bytes,
    )
    from reshard.refit import RefitSender
    from reshard.tools.bench import floor_runner

    t0 = time.perf_counter()
    model = build_model(kind, cfg)
    params, layouts = hf.refit_params(model)
    replies.put(("ready", rank, {"seconds": time.perf_counter() - t0,
                                 "params": sum(p.numel() for p in params.values()),
                                 "meta": checkpoint_meta(params, kind) if rank == 0 else None,
                                 "rss": rss_bytes()}))
    sender = gb = floor = None
    rss0 = 0
    while True:
        cmd, *args = commands[rank].get()
        t0 = time.perf_counter()
        out: dict[str, Any] = {}
        if cmd == "stop":
            break
        if cmd == "mem_start":
            reset_peak_rss()
            rss0 = rss_bytes()
        elif cmd == "mem_peak":
            out["peak_extra"] = rss_bytes("VmHWM") - rss0
        elif cmd == "perturb":  # the "optimizer step": every weight changes
            with torch.no_grad():
                for p in params.values():
                    (p.to_local() if hasattr(p, "to_local") else p).mul_(1 + 2 ** -6)
        elif cmd == "reshard_init":
            sender = RefitSender(params, layouts=layouts, host="127.0.0.1", port=args[0],
                                 rank=rank, trainer_size=world, inference_size=args[1],
                                 budget_bytes=args[2])
        elif cmd == "reshard":
            stats = sender.refit(args[0])
            out.update(sent=stats.bytes_sent, transfer_seconds=stats.seconds,
                       staging=stats.peak_staging_bytes)
        elif cmd == "reshard_profile":
            from refit_real_engine import profiled
            out["profile"] = profiled(functools.partial(sender.refit, args[0]), 30)
        elif cmd == "floor":
            floor = floor or floor_runner(sender.meeting.plan, sender.comm)
            floor()
        elif cmd == "reshard_close":
            sender.comm.close()
            sender = floor = None
        elif cmd == "gb_init":
            if rank == 0:
                from reshard.comm import Comm
                gb = Comm.from_store("127.0.0.1", args[0], 0, 1 + args[1])
        elif cmd == "gb":
            out["sent"] = send_gather_broadcast(params, kind, rank, gb, args[0])
        elif cmd == "gb_close":
            if gb is not None:
                gb.close()
            gb = None
        elif cmd == "save":
            out["written"] = save_safetensors(params, kind, rank, Path(args[0]))
        else:
            raise ValueError(f"unknown trainer command {cmd!r}")
        if cmd in ("gb", "save"):  # gathered full tensors: back to the host (a model
            return_freed_memory()   # near the host's memory runs every method after)
        out["seconds"] = time.perf_counter() - t0
        replies.put((cmd, rank, out))


class Trainer:
    """The 2 trainer ranks in their own processes, driven by commands."""

    def __init__(self, kind: str, cfg: dict, world: int = 2) -> None:
        import multiprocessing as mp

        from reshard.tools.launch import run_processes

        ctx = mp.get_context("spawn")
        self.world = world
        self.commands = [ctx.Queue() for _ in range(world)]
        self.replies = ctx.Queue()
        self.error: list[BaseException] = []

        def run() -> None:
            try:
                run_processes(trainer, world, kind, cfg, self.commands, self.replies,
                              timeout=7200, start_method="spawn")
            except BaseException as e:  # noqa: BLE001 - reported by wait()
                self.error.append(e)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        self.ready = self.wait("ready")

    def send(self, cmd: str, *args: Any) -> None:
        for q in self.commands:
            q.put((cmd, *args))

    def wait(self, cmd: str, timeout: float = 1800) -> list[dict]:
        out: dict[int, dict] = {}
        deadline = time.monotonic() + timeout
        while len(out) < self.world:
            if self.error:
                raise RuntimeError(f"trainer failed: {self.error[0]}")
            try:
                got, rank, value = self.replies.get(timeout=1)
            except Exception:  # queue.Empty
                if time.monotonic() > deadline:
                    raise TimeoutError(f"trainer: no {cmd!r} reply") from None
                continue
            assert got == cmd, (got, cmd)
            out[rank] = value
        return [out[r] for r in range(self.world)]

    def call(self, cmd: str, *args: Any) -> list[dict]:
        self.send(cmd, *args)
        return self.wait(cmd)

    def stop(self) -> None:
        self.send("stop")
        self.thread.join(timeout=120)


# ------------------------------------------------------------------------------- engine

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
    def reshard(self, before: list[dict]) -> dict[str, Any]:
        port = self.free_port()
        t0 = time.perf_counter()
        self.trainer.send("reshard_init", port, 2, self.budget)
        infos = self.collective("reshard_init", "127.0.0.1", port, 2, timeout_s=600.0,
                                budget_bytes=self.budget, heap_slack_bytes=self.heap_slack)
        self.trainer.wait("reshard_init")
        init_s = time.perf_counter() - t0

        def refit(version: int) -> dict:
            self.trainer.send("reshard", version)
            engine = self.collective("reshard_refit")
            return {"engine": engine, "trainer": self.trainer.wait("reshard")}

        seconds, details = self.timed(refit)
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
            out["median"] = median(out["seconds"])
            out.setdefault("cpu_seconds", self.cpu_medians())
            out["load"] = load_avg()
            out["tree_peak_rss"] = self.watch.take()
            if method == "gather_broadcast":
                self.trainer.call("gb_close")
                self.collective("bench_gb_close")
            self.result["methods"][method] = out
            print(f"[{self.name}] {method}: {out['median']:.3f} s (median of "
                  f"{len(out['seconds'])}), received {out['bytes_received']} B, check "
                  f"{'OK' if out['check']['ok'] else 'FAIL'}, load {out['load']}", flush=True)
        return self.result

    def close(self) -> None:
        from reshard.tools.rl_task import shutdown

        self.trainer.stop()
        shutdown(self.llm)


# ------------------------------------------------------------------------------ reports

def table(results: list[dict]) -> str:
    rows = ["| model | params | method | refit (median) | vs reshard | received per engine "
            "rank | trainer rank 0 peak extra | engine ranks peak extra | check | load |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        ms = r["methods"]
        base = ms.get("reshard", {}).get("median")
        for name, m in ms.items():
            ratio = f"{m['median'] / base:.2f}x" if base else "-"
            rows.append(
                f"| {r['model']} | {r['params'] / 1e9:.2f}B | {name} | {m['median']:.3f} s "
                f"| {ratio} | {' / '.join(_mb(b) for b in m['bytes_received'])} "
                f"| {_mb(m['trainer0_peak_extra'])} "
                f"| {' / '.join(_mb(b) for b in m['engine_peak_extra'])} "
                f"| {'OK' if m['check']['ok'] else 'FAIL'} | {m['load']} |")
        if "reshard" in ms:
            f = ms["reshard"]["floor"]
            rows.append(f"| {r['model']} | | floor | {median(f['seconds']):.3f} s "
                        f"| {median(f['seconds']) / base:.2f}x "
                        f"| {' / '.join(_mb(b) for b in ms['reshard']['expected_bytes'])} "
                        "| | | | |")
    return "\n".join(rows)


def breakdown(results: list[dict]) -> str:
    rows = ["| model | refit (median) | set-up (meet + plan, once) | transfer (engine receive) "
            "| floor | commit (vLLM reload) | rest (driver, RPC) |",
            "|---|---|---|---|---|---|---|"]
    for r in results:
        m = r["methods"].get("reshard")
        if not m:
            continue
        b = {k: median([d[k] for d in m["breakdown"]]) for k in m["breakdown"][0]}
        rows.append(f"| {r['model']} | {m['median']:.3f} s | {m['init_seconds']:.2f} s "
                    f"| {b['receive']:.3f} s | {median(m['floor']['seconds']):.3f} s "
                    f"| {b['commit']:.3f} s | {m['median'] - b['engine_total']:.3f} s |")
    return "\n".join(rows)


#: The roles of :func:`_role`, in the CPU table's order.
ROLES = ("trainer ranks", "engine workers", "engine core", "driver")


def cpu_table(results: list[dict]) -> str:
    """CPU seconds per refit (medians), by process role, and the cores they kept busy
    (CPU seconds over wall seconds): what a method costs the host beyond its time."""
    rows = ["| model | method | refit (median) | " + " | ".join(ROLES)
            + " | CPU in all | cores busy | page faults: engine workers | trainer ranks |",
            "|---|---|---|" + "---|" * (len(ROLES) + 4)]
    for r in results:
        ms = dict(r["methods"])
        if "reshard" in ms:
            ms["floor"] = dict(ms["reshard"]["floor"], median=median(
                ms["reshard"]["floor"]["seconds"]))
        for name, m in ms.items():
            cpu = m.get("cpu_seconds")
            if not cpu:
                continue
            total = sum(cpu.get(k, 0.0) for k in ROLES)
            rows.append(f"| {r['model']} | {name} | {m['median']:.3f} s | "
                        + " | ".join(f"{cpu.get(k, 0.0):.2f} s" for k in ROLES)
                        + f" | {total:.2f} s | {total / m['median']:.2f} "
                        + f"| {cpu.get('faults engine workers', 0) / 1e3:,.0f}k "
                        + f"| {cpu.get('faults trainer ranks', 0) / 1e3:,.0f}k |")
    return "\n".join(rows)


def _mb(n: int) -> str:
    return f"{n / 1e6:,.0f} MB"


def plot(results: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dense = sorted((r for r in results if "moe" not in r["model"]), key=lambda r: r["params"])
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for method in (*METHODS, "floor"):
        pts = [(r["params"] / 1e9, _seconds(r, method)) for r in dense]
        pts = [(x, y) for x, y in pts if y is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=method)
    ax.set_xlabel("parameters (billions; FSDP2 fp32 x2 -> vLLM TP2 bf16)")
    ax.set_ylabel("refit seconds (median)")
    ax.set_title("Refit into vLLM CPU on a 2-core host")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def _seconds(r: dict, method: str) -> float | None:
    if method == "floor":
        m = r["methods"].get("reshard")
        return median(m["floor"]["seconds"]) if m else None
    m = r["methods"].get(method)
    return m["median"] if m else None


# --------------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen3-0.6b,llama-3.2-1b,qwen2.5-1.5b,qwen3-moe-1.4b",
                    help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--methods", default=",".join(METHODS))
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
        print(table(results), "\n", breakdown(results), "\n", cpu_table(results), sep="\n")
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
        try:
            results.append(run.run(a.methods.split(",")))
        finally:
            run.close()
        shutil.rmtree(a.out / name / "checkpoint", ignore_errors=True)
        (a.out / "results.json").write_text(json.dumps({**header, "results": results},
                                                        indent=1))
    header["uptime_end"] = subprocess.run(["uptime"], capture_output=True, text=True
                                          ).stdout.strip()
    (a.out / "results.json").write_text(json.dumps({**header, "results": results}, indent=1))
    print(table(results), "\n", breakdown(results), "\n", cpu_table(results), sep="\n")
    print(f"load: start {header['uptime_start']}; end {header['uptime_end']}")
    if a.png:
        plot(results, a.png)
    return 0 if all(m["check"]["ok"] for r in results for m in r["methods"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

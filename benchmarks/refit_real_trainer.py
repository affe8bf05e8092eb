"""The trainer side of ``benchmarks/refit_real.py``: an FSDP2 model of random float32
values, its 2 ranks in processes of their own driven by commands (reshard's refit, dense
or sparse, gather-and-broadcast, safetensors for the disk method, the floor, memory, the
"optimizer steps": every weight changed, or a given fraction of them).
"""

from __future__ import annotations

import functools
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from benchtools import profiled
from refit_real_models import GiB


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
    from reshard.refit.sparse import sparse_summary
    from reshard.tools.bench import floor_runner
    from sparse_refit import change

    t0 = time.perf_counter()
    model = build_model(kind, cfg)
    params, layouts = hf.refit_params(model)
    g = torch.Generator().manual_seed(rank)  # which elements "change" picks, per rank
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
        elif cmd == "change":  # a step that changes about args[0] of the bf16 values
            with torch.no_grad():  # (the shards; no replicated plain tensor in these models)
                change({n: p.to_local() for n, p in params.items() if hasattr(p, "to_local")},
                       args[0], g)
        elif cmd == "reshard_init":  # args[3]: RefitSender's sparse mode
            sender = RefitSender(params, layouts=layouts, host="127.0.0.1", port=args[0],
                                 rank=rank, trainer_size=world, inference_size=args[1],
                                 budget_bytes=args[2], sparse=args[3])
        elif cmd == "reshard":  # args[1]: dense whatever the sparse mode
            stats = sender.refit(args[0], dense=args[1])
            kept = stats.sparse  # None with sparse="off"
            out.update(sent=stats.bytes_sent, transfer_seconds=stats.seconds,
                       staging=stats.peak_staging_bytes, sparse=sparse_summary(kept),
                       # the sender's copy: its bytes, and a dense refit's keeping of it
                       # (within transfer_seconds)
                       state_bytes=kept.state_bytes if kept else 0,
                       copy_seconds=kept.copy_seconds if kept else 0.0)
        elif cmd == "reshard_profile":
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

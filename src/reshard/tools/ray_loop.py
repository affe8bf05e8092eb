"""``python -m reshard.tools.demo_rl --launcher ray``: the RL loop of the demo with its
trainer ranks and its vLLM engine as Ray actors, as RL frameworks place them.

* :class:`TrainerRank` (one Ray actor per rank, ``num_cpus=0``): a tiny transformers
  Qwen3 under FSDP2 over gloo among the trainer actors, REINFORCE, and a
  :class:`reshard.refit.RefitSender` that refits the engine every step;
* :class:`EngineActor` (one Ray actor): a vLLM engine (TP2, its workers are processes of
  its own) with reshard's worker extension;
* :class:`Loop` (the driver): trainer rank 0 picks the store addresses on its node
  (:func:`reshard.integrations.ray.pick_store_address`), the driver hands them to every
  actor, and the actors meet through reshard's rendezvous. Ray carries only addresses,
  rollouts and small results; the weights go through reshard's group.

Each step runs the demo's checks: vLLM's greedy generation equals that of the
transformers model holding the trainer's weights, vLLM's logical weights are bit for bit
what vLLM's own loader makes of them, each vLLM rank received exactly its bytes, and the
version is the step. :meth:`Loop.kill_mid_refit` kills one trainer actor in the middle
of a refit (the actor pauses in its progress callback until it is killed): the
survivors get a ``TransferError``, the engine keeps the previous version;
:meth:`Loop.readmit` starts a new actor for the lost rank, the group restarts from the
last checkpoint and meets the engine again (``RefitSender.reconnect`` on the survivors,
``reshard_reconnect`` on the engine), and the lost version is sent again.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from reshard.defaults import DEFAULT_SPARSE
from reshard.gate import TOKEN_ENV, new_token
from reshard.integrations.ray import (
    StoreAddress,
    init_local_cluster,
    node_address,
    pick_store_address,
    use_gloo_interface,
)
from reshard.tools.rl_task import (
    CHECK_TOKENS,
    KV_CACHE_BYTES,
    MAX_MODEL_LEN,
    PROMPTS,
    TP,
    TRAINERS,
    expected_bytes,
    greedy,
    reinforce_step,
    rollouts,
    save_step,
    shutdown,
    sparse_note,
    vllm_cpu_env,
)

EXTENSION = "reshard.integrations.vllm.ReshardWorkerExtension"
#: A refit in several rounds (the tiny model is ~2 MiB), so that it can be cut midway.
REFIT_BUDGET = 256 << 10
MEET_TIMEOUT_S = 120.0
REFIT_TIMEOUT_S = 60.0  # every wait of a refit ends by then: a lost peer is an error
CALL_TIMEOUT_S = 300.0  # the driver's wait on any actor call


class TrainerRank:
    """One trainer rank (use as ``ray.remote(num_cpus=0)(TrainerRank)``).

    The sender reads ``self.params`` at every refit: after a restart the dict is
    updated in place with the rebuilt model's DTensors (same names and layouts)."""

    def __init__(self, rank: int, world_size: int, model_dir: str, out_dir: str, *,
                 lr: float = 0.02, single_node: bool = True, sparse: str = DEFAULT_SPARSE) -> None:
        import torch

        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        torch.set_num_threads(1)
        self.rank, self.world_size, self.lr, self.sparse = rank, world_size, lr, sparse
        self.model_dir, self.out_dir, self.single_node = model_dir, out_dir, single_node
        self.params: dict[str, Any] = {}
        self.sender: Any = None
        self.pause_at: int | None = None  # refit version to pause in, until killed
        self.refitting: int | None = None

    def store_addresses(self, count: int = 2) -> list[StoreAddress]:
        """``count`` distinct free addresses on this actor's node (rank 0 hosts the
        stores: its own group's and the refit's)."""
        picked: list[StoreAddress] = []
        while len(picked) < count:
            addr = pick_store_address(loopback=self.single_node)
            if addr[:2] not in [p[:2] for p in picked]:  # (host, port); tokens differ
                picked.append(addr)
        return picked

    def join(self, world: StoreAddress, refit: StoreAddress, inference_size: int,
             checkpoint: str | None = None) -> dict[str, Any]:
        """Form the trainer group (FSDP2 over gloo) at ``world`` and meet the engine at
        ``refit``: with a fresh sender the first time, through ``reconnect`` after a
        lost rank (the model then restarts from ``checkpoint``, a full state dict)."""
        import torch
        import torch.distributed as dist

        from reshard.integrations import hf
        from reshard.refit.sender import RefitSender

        use_gloo_interface(node_address(loopback=self.single_node))
        if dist.is_initialized():  # the old group lost a rank: leave it
            dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"tcp://{world.host}:{world.port}",
                                rank=self.rank, world_size=self.world_size,
                                timeout=timedelta(seconds=MEET_TIMEOUT_S))
        model = hf.load_model(self.model_dir, torch.float32)
        if checkpoint is not None:
            model.load_state_dict(torch.load(checkpoint, weights_only=True))
        self.model = hf.shard_fsdp2(model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=self.lr, foreach=False)
        params, layouts = hf.refit_params(self.model)
        self.params.clear()
        self.params.update(params)
        if self.sender is None:
            self.sender = RefitSender(
                self.params, layouts=layouts, host=refit.host, port=refit.port, rank=self.rank,
                trainer_size=self.world_size, inference_size=inference_size,
                budget_bytes=REFIT_BUDGET, progress=self._progress, token=refit.token,
                timeout=timedelta(seconds=MEET_TIMEOUT_S),
                refit_timeout=timedelta(seconds=REFIT_TIMEOUT_S), sparse=self.sparse)
        else:
            self.sender.reconnect(refit.host, refit.port,
                                  timeout=timedelta(seconds=MEET_TIMEOUT_S))
        return {"rank": self.rank, "pid": os.getpid(), "version": self.sender.version}

    def step(self, step: int, batch: list) -> dict[str, Any]:
        """Train on this rank's rollouts, save the full state (rank 0: the checks'
        reference), refit the engine with version ``step``."""
        from reshard.integrations import hf

        loss, mean_reward = reinforce_step(self.model, self.opt, batch)
        full = hf.full_state_dict(self.model)  # collective
        if self.rank == 0:
            save_step(full, self.out_dir, step)
        return {**self.refit(step), "loss": loss, "reward": mean_reward}

    def refit(self, version: int) -> dict[str, Any]:
        """Send the current weights as ``version``; a ``TransferError`` (a lost peer)
        comes back as ``ok: False``."""
        from reshard.errors import TransferError
        from reshard.refit.sparse import sparse_summary

        self.refitting = version
        try:
            stats = self.sender.refit(version)
        except TransferError as e:
            return {"rank": self.rank, "ok": False, "version": self.sender.version,
                    "broken": self.sender.broken, "error": f"{type(e).__name__}: {e}"[:400]}
        finally:
            self.refitting = None
        return {"rank": self.rank, "ok": True, "version": stats.version,
                "sent": stats.bytes_sent, "seconds": stats.seconds, "rounds": stats.rounds,
                "sparse": sparse_summary(stats.sparse)}

    def pause_in_refit(self, version: int) -> None:
        """The test hook: in refit ``version``, after its first round, announce this
        actor's pid (``out_dir/paused.json``) and wait there to be killed."""
        self.pause_at = version

    def _progress(self, done: int, total: int) -> None:
        if self.pause_at is not None and self.refitting == self.pause_at:
            self.pause_at = None
            flag = Path(self.out_dir) / "paused.json"
            flag.with_suffix(".tmp").write_text(json.dumps({"rank": self.rank,
                                                            "pid": os.getpid()}))
            os.replace(flag.with_suffix(".tmp"), flag)
            time.sleep(CALL_TIMEOUT_S)  # killed here
            raise SystemExit("the paused trainer actor was not killed")


class EngineActor:
    """A vLLM engine with reshard's worker extension (use as
    ``ray.remote(num_cpus=0)(EngineActor)``); its TP workers are its own processes."""

    def __init__(self, model_dir: str, *, tp: int = TP, single_node: bool = True,
                 **llm_kwargs: Any) -> None:
        vllm_cpu_env()
        use_gloo_interface(node_address(loopback=single_node))  # before vLLM's workers
        from vllm import LLM

        options = dict(skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                       max_model_len=MAX_MODEL_LEN, max_num_seqs=16, seed=0,
                       kv_cache_memory_bytes=KV_CACHE_BYTES)
        self.llm = LLM(model=model_dir, tensor_parallel_size=tp,
                       distributed_executor_backend="mp", worker_extension_cls=EXTENSION,
                       **{**options, **llm_kwargs})

    def _call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        from reshard.integrations.vllm import collective

        return collective(self.llm, method, *args, **kwargs)

    def connect(self, refit: StoreAddress, trainer_size: int) -> list[dict[str, Any]]:
        """Meet the trainer ranks at ``refit`` (a fresh weight-update group)."""
        return self._call("reshard_init", refit.host, refit.port, trainer_size,
                          timeout_s=MEET_TIMEOUT_S, token=refit.token)

    def reconnect(self, refit: StoreAddress) -> list[dict[str, Any]]:
        """Meet them again at a new address after a lost trainer rank."""
        return self._call("reshard_reconnect", refit.host, refit.port,
                          timeout_s=MEET_TIMEOUT_S)

    def refit(self) -> list[dict[str, Any]]:
        """Receive and commit the next version (``ok: False`` per rank if it failed)."""
        return self._call("reshard_refit")

    def rollouts(self, step: int) -> list[tuple[list[int], list[int]]]:
        return rollouts(self.llm, step)

    def greedy(self) -> list[list[int]]:
        return greedy(self.llm)

    def check(self, state_path: str) -> dict[str, Any]:
        """Greedy tokens, versions, status, and each rank's logical weights against
        what vLLM's loader makes of the full state dict at ``state_path``."""
        return {"tokens": self.greedy(), "versions": self._call("reshard_version"),
                "status": self._call("reshard_status"), "info": self._call("reshard_info"),
                "verify": self._call("reshard_verify", state_path)}

    def close(self) -> None:
        self._call("reshard_close")

    def shutdown(self) -> None:
        shutdown(self.llm)  # its processes exit on their own (rl_task.shutdown)


@dataclass
class Record:
    """One step as the driver saw it."""

    step: int
    trainer: list[dict[str, Any]]
    engine: list[dict[str, Any]]
    check: dict[str, Any] = field(default_factory=dict)
    hf_tokens: list[list[int]] | None = None
    mean_reward: float = 0.0

    @property
    def refit_ok(self) -> bool:
        return all(r["ok"] for r in self.engine) and all(t["ok"] for t in self.trainer)

    @property
    def checks(self) -> dict[str, bool]:
        """The demo's checks of a refit that landed."""
        c = self.check
        return {"generation": c["tokens"] == self.hf_tokens,
                "weights": all(not v["mismatched"] and not v["live_mismatched"]
                               and v["checked"] > 0 for v in c["verify"]),
                "bytes": all(r["bytes_received"] == expected_bytes(r) for r in self.engine),
                "version": c["versions"] == [self.step] * len(self.engine)}

    @property
    def ok(self) -> bool:
        return self.refit_ok and all(self.checks.values())

    def line(self) -> str:
        if not self.refit_ok:
            why = [r.get("error") for r in [*self.trainer, *self.engine] if not r["ok"]]
            return f"step {self.step}: refit FAILED: {why}"
        ok = lambda b: "OK" if b else "FAIL"  # noqa: E731
        c = self.checks
        trained = all("reward" in t for t in self.trainer)  # not a re-sent version
        reward = f"reward {self.mean_reward:.3f} | " if trained else ""
        reward += sparse_note(self.trainer)
        return (f"step {self.step}: {reward}refit v{self.step}: "
                f"transfer {max(t['seconds'] for t in self.trainer):.3f} s + vLLM commit "
                f"{max(r['commit_seconds'] for r in self.engine):.3f} s | vLLM ranks received "
                f"{[r['bytes_received'] for r in self.engine]} B | generation vs "
                f"transformers {ok(c['generation'])}, weights vs vLLM loader "
                f"{ok(c['weights'])}, bytes {ok(c['bytes'])}, version {ok(c['version'])} "
                f"=> {ok(self.ok)}")


class Loop:
    """The driver: trainer actors and an engine actor refitted every step.

    ``engine`` is an :class:`EngineActor` handle (one engine may serve several loops
    in turn: :meth:`start` meets it afresh); ``sparse``: the trainer ranks' sparse mode
    (``"off"``, ``"on"``, ``"auto"``; docs/sparse.md)."""

    def __init__(self, engine: Any, model_dir: str | Path, out_dir: str | Path, *,
                 trainers: int = TRAINERS, lr: float = 0.02, sparse: str = DEFAULT_SPARSE) -> None:
        import ray

        self.ray, self.engine = ray, engine
        self.model_dir, self.out_dir = str(model_dir), Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.trainers, self.lr, self.tp, self.sparse = trainers, lr, TP, sparse
        self.actors = [self._new_actor(r) for r in range(trainers)]
        self.ref: Any = None
        self.info: list[dict[str, Any]] = []
        self.token = os.environ.get(TOKEN_ENV) or new_token()  # one meeting token a loop

    def _new_actor(self, rank: int) -> Any:
        actor = self.ray.remote(num_cpus=0)(TrainerRank)
        return actor.remote(rank, self.trainers, self.model_dir, str(self.out_dir), lr=self.lr,
                            sparse=self.sparse)

    def _get(self, refs: Any) -> Any:
        return self.ray.get(refs, timeout=CALL_TIMEOUT_S)

    def _addresses(self) -> tuple[StoreAddress, StoreAddress]:
        """Two free addresses on trainer rank 0's node: its group's, the refit's."""
        world, refit = self._get(self.actors[0].store_addresses.remote(2))
        return world, refit._replace(token=self.token)  # a rank that rejoins holds it too

    def start(self) -> list[dict[str, Any]]:
        """Form the trainer group and meet the engine (all at once: collective)."""
        world, refit = self._addresses()
        joins = [a.join.remote(world, refit, self.tp) for a in self.actors]
        self.info = self._get(self.engine.connect.remote(refit, self.trainers))
        self._get(joins)
        return self.info

    def step(self, step: int) -> Record:
        """Rollouts, one training step on every rank, the refit, the checks."""
        batch = self._get(self.engine.rollouts.remote(step))
        trained = [a.step.remote(step, batch[r::self.trainers])
                   for r, a in enumerate(self.actors)]
        engine = self._get(self.engine.refit.remote())
        record = Record(step, self._get(trained), engine)
        record.mean_reward = sum(t["reward"] for t in record.trainer) / self.trainers
        return self._checked(record, step) if record.refit_ok else record

    def _checked(self, record: Record, state_step: int) -> Record:
        path = self.out_dir / f"step{state_step}.pt"
        record.check = self._get(self.engine.check.remote(str(path)))
        record.hf_tokens = self.reference_tokens(path)
        return record

    def reference_tokens(self, path: Path) -> list[list[int]]:
        """Greedy tokens of the transformers model holding the state dict at ``path``."""
        import torch

        from reshard.integrations import hf

        if self.ref is None:
            self.ref = hf.load_model(self.model_dir, torch.float32).eval()
        self.ref.load_state_dict(torch.load(path, weights_only=True))
        return hf.greedy_tokens(self.ref, PROMPTS, CHECK_TOKENS)

    def kill_mid_refit(self, step: int, victim: int = 1, check: bool = True) -> dict[str, Any]:
        """Step ``step`` with trainer rank ``victim``'s actor killed (``ray.kill``) in
        the middle of the refit; returns what the survivors and the engine saw."""
        flag = self.out_dir / "paused.json"
        flag.unlink(missing_ok=True)
        self._get(self.actors[victim].pause_in_refit.remote(step))
        batch = self._get(self.engine.rollouts.remote(step))
        trained = [a.step.remote(step, batch[r::self.trainers])
                   for r, a in enumerate(self.actors)]
        engine = self.engine.refit.remote()
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while not flag.exists():
            if time.monotonic() > deadline:
                raise TimeoutError("the trainer actor never paused in its refit")
            time.sleep(0.05)
        paused = json.loads(flag.read_text())
        t0 = time.monotonic()
        self.ray.kill(self.actors[victim], no_restart=True)
        engine_res = self._get(engine)
        seconds = time.monotonic() - t0
        survivors = [self._get(ref) for r, ref in enumerate(trained) if r != victim]
        try:
            self._get(trained[victim])
            victim_error = None
        except self.ray.exceptions.RayActorError as e:
            victim_error = type(e).__name__
        return {"paused": paused, "engine": engine_res, "survivors": survivors,
                "victim_error": victim_error, "seconds_to_error": seconds,
                "check": self._get(self.engine.check.remote(
                    str(self.out_dir / f"step{step - 1}.pt"))) if step > 1 and check else None}

    def readmit(self, rank: int, step: int) -> Record:
        """A new actor for the lost ``rank``; the whole trainer group restarts from the
        checkpoint of ``step`` (its refit was lost) and meets the engine again (the
        survivors' senders and the engine reconnect, the new rank joins fresh); then
        version ``step`` is sent again and checked."""
        self.actors[rank] = self._new_actor(rank)
        world, refit = self._addresses()
        checkpoint = str(self.out_dir / f"step{step}.pt")
        joins = [a.join.remote(world, refit, self.tp, checkpoint) for a in self.actors]
        self.info = self._get(self.engine.reconnect.remote(refit))
        joined = self._get(joins)
        trained = [a.refit.remote(step) for a in self.actors]
        engine = self.engine.refit.remote()  # posted with the trainers': it is collective
        record = Record(step, self._get(trained), self._get(engine))
        record.trainer = [{**t, "joined": j} for t, j in zip(record.trainer, joined)]
        return self._checked(record, step) if record.refit_ok else record

    def close(self) -> None:
        self._get(self.engine.close.remote())
        for a in self.actors:
            self.ray.kill(a, no_restart=True)


def start_engine(model_dir: str | Path, **kwargs: Any) -> Any:
    """An :class:`EngineActor` (``num_cpus=0``); it is up when its first call returns."""
    import ray

    return ray.remote(num_cpus=0)(EngineActor).remote(str(model_dir), **kwargs)


def main(args: Any) -> int:
    """The demo with ``--launcher ray`` (``args``: steps, lr, kill_at)."""
    import tempfile

    try:
        import ray
    except ImportError as e:
        print(f"Ray is not installed ({e}); install the ray extra (pip install -e .[ray])")
        return 2
    from reshard.integrations import hf

    with tempfile.TemporaryDirectory(prefix="reshard_demo_ray_") as tmp:
        model_dir = hf.build_tiny_model(Path(tmp) / "tiny-qwen3", "qwen3", vocab_size=500)
        t0 = time.perf_counter()
        init_local_cluster()
        print(f"Ray up in {time.perf_counter() - t0:.1f} s (no dashboard, object store "
              f"{ray.available_resources().get('object_store_memory', 0) / 2**20:.0f} MiB)")
        try:
            return _run(model_dir, Path(tmp) / "steps", args)
        finally:
            ray.shutdown()


def _run(model_dir: Path, out_dir: Path, args: Any) -> int:
    import ray

    ray_get = lambda ref: ray.get(ref, timeout=CALL_TIMEOUT_S)  # noqa: E731
    t0 = time.perf_counter()
    engine = start_engine(model_dir)
    loop = Loop(engine, model_dir, out_dir, lr=args.lr)
    info = loop.start()
    print(f"engine actor (vLLM TP={TP}) and {TRAINERS} trainer actors (FSDP2) met in "
          f"{time.perf_counter() - t0:.1f} s; each vLLM rank expects "
          f"{[i['expected_bytes'] for i in info]} B per refit")
    failures = 0
    for step in range(1, args.steps + 1):
        if step == args.kill_at:
            lost = loop.kill_mid_refit(step)
            kept = lost["check"] is None or lost["check"]["versions"] == [step - 1] * TP
            print(f"step {step}: trainer rank {lost['paused']['rank']}'s actor killed mid-refit; "
                  f"engine: {[r['ok'] for r in lost['engine']]}, survivors: "
                  f"{[s['error'][:60] for s in lost['survivors']]}; engine kept version "
                  f"{step - 1}: {'OK' if kept else 'FAIL'}")
            failures += not kept
            record = loop.readmit(lost["paused"]["rank"], step)
            print("  re-admitted a restarted actor; again: " + record.line(), flush=True)
        else:
            record = loop.step(step)
            print(record.line(), flush=True)
        failures += not record.ok
    loop.close()
    ray_get(engine.shutdown.remote())
    print(f"{args.steps - failures} of {args.steps} RL steps verified"
          f"{'' if failures else ': all OK'}")
    return 1 if failures else 0

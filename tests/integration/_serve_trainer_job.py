"""One rank of the trainer job of the live-server tests (tests/integration/test_vllm_serve.py)::

    python _serve_trainer_job.py --rank R --world 2 --dist-port P MODEL_DIR URL MEET_PORT OUT \\
        --steps 1,2 [--stop-the-world 2] [--die-at 2] [--resume 2] [--sparse on] [--lr LR]

Each rank loads the transformers model (float32 master weights), shards it with FSDP2
and meets the live vLLM server at ``URL`` through vLLM's own HTTP weight-sync client
and the reshard trainer engine (``WeightTransferTrainerFactory.trainer_init``). For each
step: one AdamW step on a fixed batch; rank 0 saves that step's Hugging Face checkpoint
(``OUT/step{k}``, what a fresh server of that step loads) and says ``OUT/ready{k}``;
the ranks wait for ``OUT/go{k}`` (the test's in-flight requests are running), then
``send_weights(k)`` (overlapped, or stop-the-world for the steps listed); rank 0 writes
``OUT/refit{k}.json``.
``--die-at K``: rank 1 is SIGKILLed by itself midway through its sends of step K (a
trainer rank lost during the engine's background receive). ``--resume K``: the ranks
load ``OUT/step{K}`` and send it as version K (a trainer re-admitted), training only for
the steps after it. ``--sparse``: the trainer engine's sparse mode (its init info).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from reshard.errors import TransferError
from reshard.integrations import hf
from reshard.integrations.vllm.trainer import ReshardTrainerInitInfo


class Dying(dict):
    """The trainer's parameters; on the armed step, the process kills itself at the
    ``at``-th tensor it reads for sending (the transfer is under way)."""

    def __init__(self, params, at: int) -> None:
        super().__init__(params)
        self.armed, self.at, self.reads = False, at, 0

    def __getitem__(self, name):
        if self.armed:
            self.reads += 1
            if self.reads >= self.at:
                os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(name)


def batch(step: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(3, vocab, (4, 16), generator=g)


def wait_for(path: Path, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("url")
    ap.add_argument("meet_port", type=int)
    ap.add_argument("out")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--dist-port", type=int, required=True)
    ap.add_argument("--steps", default="1")
    ap.add_argument("--stop-the-world", default="", help="steps refitted stop-the-world")
    ap.add_argument("--die-at", type=int, default=-1)
    ap.add_argument("--resume", type=int, default=-1)
    ap.add_argument("--sparse", default="off")
    ap.add_argument("--lr", type=float, default=0.02)
    a = ap.parse_args()
    out = Path(a.out)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.dist_port))
    torch.set_num_threads(1)  # two ranks on a 2-core host, beside the server
    dist.init_process_group("gloo", rank=a.rank, world_size=a.world)
    torch.manual_seed(0)
    start = out / f"step{a.resume}" if a.resume > 0 else a.model_dir
    model = hf.load_model(start, torch.float32)
    hf.shard_fsdp2(model)
    params = hf.refit_params(model)[0]
    # the pre-send check reads every tensor once; then the transfer: die halfway through
    params = Dying(params, at=len(params) + len(params) // 2)
    info = ReshardTrainerInitInfo("127.0.0.1", a.meet_port, trainer_size=a.world,
                                  inference_size=2, rank=a.rank, timeout_s=60,
                                  token=os.environ.get("SERVE_TEST_TOKEN"), sparse=a.sparse)
    engine = WeightTransferTrainerFactory.trainer_init(
        info, client=HTTPVLLMWeightSyncClient(a.url), source=params)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, foreach=False)
    stop_the_world = {int(s) for s in a.stop_the_world.split(",") if s}
    for step in (int(s) for s in a.steps.split(",")):
        if step > a.resume:
            ids = batch(step, model.config.vocab_size)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            full = hf.full_state_dict(model)
            if a.rank == 0:
                hf.save_checkpoint(a.model_dir, full, out / f".step{step}")
                os.replace(out / f".step{step}", out / f"step{step}")
        if a.rank == 0:  # the test starts its traffic, then lets this refit go
            (out / f"ready{step}").touch()
        wait_for(out / f"go{step}")
        params.armed = step == a.die_at and a.rank == 1
        try:
            figures = engine.send_weights(step, overlap=step not in stop_the_world)
            result = {"ok": True, **figures}
        except TransferError as e:
            result = {"ok": False, "step": step, "error": str(e)[:2000]}
        if a.rank == 0:
            (out / f".refit{step}.json").write_text(json.dumps(result))
            os.replace(out / f".refit{step}.json", out / f"refit{step}.json")
        if not result["ok"]:
            break
    engine.shutdown()
    os._exit(0)  # no teardown of a group that may hold a dead peer


if __name__ == "__main__":
    main()

"""The RL loop as RL frameworks launch it: trainer ranks and a vLLM engine as Ray actors.

One local Ray cluster (no dashboard, a 128 MiB object store) and one engine actor (vLLM
TP2, float32) serve both tests; each test starts its own two trainer actors (FSDP2 over
gloo among them), which meet the engine through reshard's rendezvous at an address
trainer rank 0 picks on its node (``reshard.integrations.ray``). Ray carries addresses,
rollouts and small results; the weights go through reshard's group. The checks are the
demo's (``reshard.tools.ray_loop``): after every refit, vLLM's greedy tokens equal those
of the transformers model holding the trainer's weights, every logical vLLM weight is
bit for bit what vLLM's own loader makes of the trainer's full state dict, each vLLM rank
received exactly its bytes, and the version is the step.

The first test's trainers refit sparse (``sparse="on"``, issue 39): the first refit is
dense (no base yet), every later one through the sparse transport (only the float32
values that changed, with their positions), each landing exactly as above, each vLLM
rank having received the encoded bytes its sparse stats count.

The second test kills a trainer actor (``ray.kill``) while it is inside a refit (it
pauses in its progress callback after the first round): the survivor and both vLLM
ranks get a ``TransferError`` well before the refit's deadline, the engine keeps the
previous version (its tokens and its in-place weights unchanged); a restarted actor is
re-admitted (the survivor's sender and the engine reconnect, the new rank joins fresh,
all from the last checkpoint), the lost version is sent again and checked, and the loop
goes on.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

pytestmark = pytest.mark.integration

if len(os.sched_getaffinity(0)) < 2:
    pytest.skip("the vLLM engine binds one core per TP rank and needs 2 cores",
                allow_module_level=True)
ray = pytest.importorskip("ray", reason="ray is not installed (the ray extra: "
                                        "pip install -e .[ray])")
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed", allow_module_level=True)

from reshard.defaults import NO_VERSION  # noqa: E402
from reshard.integrations import hf  # noqa: E402
from reshard.integrations.ray import init_local_cluster  # noqa: E402
from reshard.tools.ray_loop import REFIT_TIMEOUT_S, Loop, start_engine  # noqa: E402
from reshard.tools.rl_task import TP  # noqa: E402


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(engine actor, model dir): one Ray cluster and one engine for the module."""
    model_dir = hf.build_tiny_model(tmp_path_factory.mktemp("ray_model") / "qwen3", "qwen3",
                                    vocab_size=500)  # 500 -> padded 512 in vLLM
    init_local_cluster()
    engine = start_engine(model_dir)
    try:
        yield engine, model_dir
    finally:
        try:
            ray.get(engine.shutdown.remote(), timeout=180)  # rl_task.SHUTDOWN_TIMEOUT_S
        finally:
            ray.shutdown()


def check_landed(record, step: int) -> None:
    assert record.refit_ok, record.line()
    assert record.checks == {"generation": True, "weights": True, "bytes": True,
                             "version": True}, record.line()
    assert [r["version"] for r in record.engine] == [step] * TP
    assert all(r["committed"] for r in record.engine)
    assert [t["version"] for t in record.trainer] == [step] * len(record.trainer)
    # in rounds: a refit can be cut (a sparse one takes as many as its encoded bytes need)
    assert all(t["rounds"] > 1 or t.get("sparse") for t in record.trainer), record.trainer
    assert not any(s["stale"] for s in record.check["status"])


def test_ray_actors_refit_the_engine_every_step(cluster, tmp_path):
    engine, model_dir = cluster
    loop = Loop(engine, model_dir, tmp_path / "steps", sparse="on")
    info = loop.start()
    assert [i["version"] for i in info] == [NO_VERSION] * TP  # its checkpoint's weights
    # uneven vocabulary: vLLM rank 1 holds 12 padding rows of embed_tokens and lm_head
    assert info[0]["expected_bytes"] - info[1]["expected_bytes"] == 2 * 12 * 64 * 4
    records = [loop.step(step) for step in range(1, 4)]
    for step, record in enumerate(records, 1):
        check_landed(record, step)
        sides = [*record.trainer, *record.engine]
        if step == 1:  # no base yet: dense
            assert all(s["sparse"] is None for s in sides), record.line()
            continue
        # sparse, every rank, bit for bit (check_landed); each engine rank received the
        # encoded bytes its sparse stats count (a dense refit's: its expected_bytes)
        assert all(s["sparse"] is not None for s in sides), record.line()
        print(record.line())
        # float32 values under AdamW: (nearly) all change, so the messages go dense
        assert all(0 < s["sparse"]["changed_fraction"] <= 1 for s in record.trainer)
    loop.close()


def test_killed_trainer_actor_mid_refit_then_readmitted(cluster, tmp_path):
    engine, model_dir = cluster
    loop = Loop(engine, model_dir, tmp_path / "steps")
    loop.start()  # meets the engine afresh: it holds no version again
    first = loop.step(1)
    check_landed(first, 1)

    lost = loop.kill_mid_refit(2, victim=1)
    assert lost["paused"]["rank"] == 1
    assert lost["victim_error"] is not None  # the actor is dead, not finished
    for survivor in lost["survivors"]:
        assert not survivor["ok"] and survivor["broken"] and survivor["version"] == 1
        assert survivor["error"].startswith("TransferError")
    for res in lost["engine"]:
        assert not res["ok"] and res["version"] == 1 and "committed" not in res
        assert res["error"].startswith("TransferError")
    after = lost["check"]  # the engine, checked against step 1's weights
    assert after["versions"] == [1] * TP
    assert not any(s["stale"] for s in after["status"])
    assert after["tokens"] == first.check["tokens"]  # exactly the previous version
    for verify, info in zip(after["verify"], after["info"]):  # the live in-place weights
        assert not set(info["in_place"]) & set(verify["mismatched"]), verify

    assert lost["seconds_to_error"] < REFIT_TIMEOUT_S  # the survivors' wait ended early

    again = loop.readmit(1, 2)
    assert [t["joined"]["version"] for t in again.trainer] == [1, NO_VERSION]  # survivor, new
    assert again.trainer[1]["joined"]["pid"] != lost["paused"]["pid"]
    check_landed(again, 2)
    check_landed(loop.step(3), 3)
    loop.close()

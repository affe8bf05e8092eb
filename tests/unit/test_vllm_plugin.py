"""The vLLM plugin's decisions, isolated from an engine: which worker calls committed new
weights, what the engine core does then, and the refusal where the plugin is not loaded.
(The real engine core is exercised by tests/integration/test_vllm_refit.py.)"""

from __future__ import annotations

import pytest

from reshard.errors import ReshardError
from reshard.integrations.vllm import plugin
from reshard.integrations.vllm.state import require_plugin


def test_committing_calls():
    ok = [{"ok": True, "committed": True, "version": 3}] * 2
    assert plugin.committed("reshard_refit", ok) == 3
    assert plugin.committed("reshard_bootstrap", ok) == 3  # a new engine filled by peers
    assert plugin.committed("finish_weight_update", [None, None]) is True  # any backend
    failed = [{"ok": False, "version": 2}] * 2
    assert plugin.committed("reshard_refit", failed) is False
    received = [{"ok": True, "committed": False, "version": 3}] * 2
    assert plugin.committed("reshard_refit", received) is False
    assert plugin.committed("reshard_info", ok) is False
    assert plugin.committed(len, ok) is False  # a function sent to the workers
    assert plugin.committed("reshard_refit", []) is False


class _Core:
    """Just the engine-core calls the plugin makes, recorded."""

    class vllm_config:  # noqa: N801
        class model_config:  # noqa: N801
            is_multimodal_model = False

    def __init__(self, results, resets_ok=True):
        self.results, self.resets_ok, self.calls = results, resets_ok, []

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("rpc", method))
        return self.results

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.calls.append(("reset", reset_running_requests))
        return self.resets_ok

    def set_weight_version(self, version):
        self.calls.append(("version", version))


def test_a_committed_refit_resets_the_cache_and_labels_the_version():
    core = _Core([{"ok": True, "committed": True, "version": 7} for _ in range(2)])
    results = plugin._wrap(_Core.collective_rpc)(core, "reshard_refit")
    # running requests preempted: none keeps KV of the old weights
    assert core.calls == [("rpc", "reshard_refit"), ("reset", True), ("version", "7")]
    assert all(r["prefix_cache_reset"] for r in results)


def test_finish_weight_update_resets_and_keeps_the_callers_version():
    core = _Core([None, None])
    rpc = plugin._wrap(_Core.collective_rpc)
    rpc(core, "start_weight_update")
    rpc(core, "finish_weight_update")
    assert core.calls == [("rpc", "start_weight_update"), ("rpc", "finish_weight_update"),
                          ("reset", True)]


@pytest.mark.parametrize("backend", ["nccl", "reshard"])
def test_protocol_calls_out_of_order_reach_no_worker(backend):
    guard = plugin.ProtocolGuard(backend)
    with pytest.raises(ReshardError, match="finish_weight_update before start_weight_update"):
        guard.check("finish_weight_update", {})
    with pytest.raises(ReshardError, match="update_weights before start_weight_update"):
        guard.check("update_weights", {"update_info": {}})
    if backend == "reshard":  # its start needs a meeting first
        with pytest.raises(ReshardError, match="call init_weight_transfer_engine first"):
            guard.check("start_weight_update", {})
        guard.check("init_weight_transfer_engine", {"init_info": {
            "master_address": "h", "master_port": 1, "trainer_size": 2}})
        guard.done("init_weight_transfer_engine")
    guard.check("start_weight_update", {})
    guard.done("start_weight_update")
    with pytest.raises(ReshardError, match="two starts"):
        guard.check("start_weight_update", {})
    for method in ("init_weight_transfer_engine", "shutdown_weight_transfer_engine"):
        with pytest.raises(ReshardError, match="a weight update is in progress"):
            guard.check(method, {"init_info": {}})
    guard.check("update_weights", {"update_info": {}})
    guard.check("finish_weight_update", {})
    guard.done("finish_weight_update")
    assert not guard.active


def test_reshard_fields_are_checked_in_the_engine_core():
    guard = plugin.ProtocolGuard("reshard")
    with pytest.raises(ReshardError, match=r"unknown field\(s\) \['tokn'\].*it knows"):
        guard.check("init_weight_transfer_engine", {"init_info": {
            "master_address": "h", "master_port": 1, "trainer_size": 2, "tokn": "x"}})
    with pytest.raises(ReshardError, match="trainer_size"):  # a required field missing
        guard.check("init_weight_transfer_engine", {"init_info": {
            "master_address": "h", "master_port": 1}})
    with pytest.raises(ReshardError, match="unknown fanout 'ring'"):  # a fleet replica's
        guard.check("init_weight_transfer_engine", {"init_info": {
            "master_address": "h", "master_port": 1, "replica": "A", "fanout": "ring"}})
    guard.check("init_weight_transfer_engine", {"init_info": {  # no trainer_size needed
        "master_address": "h", "master_port": 1, "replica": "A", "fanout": "relay"}})
    guard.done("init_weight_transfer_engine")
    guard.check("init_weight_transfer_engine", {"init_info": {
        "master_address": "h", "master_port": 1, "trainer_size": 2, "staging": "none"}})
    guard.done("init_weight_transfer_engine")
    guard.done("start_weight_update")
    with pytest.raises(ReshardError, match="unknown field"):
        guard.check("update_weights", {"update_info": [{"background": False}, {"x": 1}]})
    # the live weights cannot serve while a transfer writes them
    with pytest.raises(ReshardError, match="background=True cannot overlap.*staging='none'"):
        guard.check("update_weights", {"update_info": {"background": True}})
    guard.check("update_weights", {"update_info": {"background": False}})
    with pytest.raises(ReshardError, match="expected a JSON object"):
        guard.check("update_weights", {"update_info": "background"})


def _reshard_core(reports):
    """An engine core with the reshard backend whose workers report ``reports``."""

    class Core(_Core):
        class vllm_config(_Core.vllm_config):  # noqa: N801
            class weight_transfer_config:  # noqa: N801
                backend = "reshard"

        def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            self.calls.append(("rpc", getattr(method, "__name__", method)))
            return reports if callable(method) else [None] * len(reports)

        def get_weight_version(self):
            return "4"

    core = Core(None)
    guard = plugin._guard(core)
    guard.initialized = True
    return core, plugin._wrap(Core.collective_rpc)


def test_a_reshard_finish_labels_the_committed_step_or_says_what_failed():
    core, rpc = _reshard_core([{"ok": True, "committed": True, "version": 5}] * 2)
    rpc(core, "start_weight_update")
    rpc(core, "finish_weight_update")
    assert core.calls[-3:] == [("rpc", "outcome"), ("reset", True), ("version", "5")]
    failed = {"ok": False, "rank": 1, "error": "TransferError: peer lost"}
    core, rpc = _reshard_core([{"ok": True, "rank": 0}, failed])
    rpc(core, "start_weight_update")
    with pytest.raises(ReshardError, match=r"failed on vLLM rank\(s\) \[1\]: TransferError: "
                       "peer lost; the engine serves weight version '4' as before"):
        rpc(core, "finish_weight_update")
    assert ("reset", True) not in core.calls  # nothing committed: the cache stays
    assert not plugin._guard(core).active  # the round is over either way


def test_other_calls_leave_the_cache():
    core = _Core([{"ok": False, "version": 1}])
    plugin._wrap(_Core.collective_rpc)(core, "reshard_refit")
    assert core.calls == [("rpc", "reshard_refit")]


def test_a_reset_that_fails_is_an_error():
    core = _Core([None], resets_ok=False)
    rpc = plugin._wrap(_Core.collective_rpc)
    rpc(core, "start_weight_update")
    with pytest.raises(RuntimeError, match="could not reset its prefix cache"):
        rpc(core, "finish_weight_update")


def test_refused_where_the_plugin_is_not_loaded(monkeypatch):
    monkeypatch.setattr(plugin, "_LOADED", False)
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    with pytest.raises(ReshardError, match=r"plugin is not loaded in this engine \(VLLM_PLUGINS="
                       r"'lora_filesystem_resolver'\).*add 'reshard' to VLLM_PLUGINS"):
        require_plugin()
    monkeypatch.setattr(plugin, "_LOADED", True)
    require_plugin()


def test_the_package_declares_the_entry_point():
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get(plugin.PLUGIN_NAME) == "reshard.integrations.vllm.plugin:load"


class _Client:
    """A weight-sync client that records its calls and refuses ``fail``."""

    def __init__(self, fail: str = "") -> None:
        self.calls, self.fail = [], fail

    def _call(self, name, *args):
        self.calls.append(name)
        if name == self.fail:
            raise RuntimeError(f"HTTP 500: {name} refused")

    def start_weight_update(self):
        self._call("start")

    def update_weights(self, info):
        self._call("update")

    def finish_weight_update(self, weight_version=None):
        self._call("finish")

    def pause_generation(self, mode):
        self._call(f"pause:{mode}")

    def resume_generation(self):
        self._call("resume")


@pytest.mark.parametrize("overlap, fail, calls", [
    (True, "update", ["start", "update", "finish"]),  # the round closed, nothing committed
    (False, "start", ["pause:keep", "start", "resume"]),  # never left paused
    (True, "start", ["start"]),
])
def test_a_round_the_engine_refuses_to_begin_is_closed(overlap, fail, calls):
    from concurrent.futures import ThreadPoolExecutor

    from reshard.integrations.vllm.trainer import ReshardTrainerEngine, ReshardTrainerInitInfo

    info = ReshardTrainerInitInfo("h", 1, trainer_size=2, inference_size=2, rank=0,
                                  overlap=overlap)
    client = _Client(fail)
    engine = ReshardTrainerEngine(client=client, is_sender=True, init_info=info)
    with ThreadPoolExecutor(1) as pool, pytest.raises(RuntimeError, match="refused"):
        engine._begin(info, pool)
    assert client.calls == calls


class _Refusing:
    """A sender whose every rank refuses the version before a byte moves."""

    def refit(self, version):
        raise ReshardError(f"refit version {version} is not newer than the current version "
                           "3; nothing was moved")


@pytest.mark.parametrize("overlap, calls", [
    (True, ["start", "update", "finish"]),
    (False, ["pause:keep", "start", "update", "finish", "resume"]),  # never left paused
])
def test_a_version_not_newer_is_refused_and_the_round_closed(overlap, calls):
    """A repeated trainer step: the refusal itself comes back (not a TransferError), the
    engine's round is closed (it commits nothing) and resumed, the version kept."""
    from reshard.integrations.vllm.trainer import ReshardTrainerEngine, ReshardTrainerInitInfo

    info = ReshardTrainerInitInfo("h", 1, trainer_size=2, inference_size=2, rank=0,
                                  overlap=overlap)
    client = _Client()
    engine = ReshardTrainerEngine(client=client, is_sender=True, init_info=info)
    engine.sender, engine.version = _Refusing(), 3
    with pytest.raises(ReshardError, match="refit version 3 is not newer") as refused:
        engine.send_weights(3)
    assert refused.type is ReshardError and client.calls == calls and engine.version == 3


def test_trainer_init_info_refuses_what_cannot_work():
    from reshard.integrations.vllm.trainer import ReshardTrainerEngine, ReshardTrainerInitInfo

    with pytest.raises(ReshardError, match="overlap=True cannot run with staging='none'"):
        ReshardTrainerInitInfo("h", 1, 2, 2, rank=0, staging="none").check()
    with pytest.raises(ReshardError, match="in_flight must be one of"):
        ReshardTrainerInitInfo("h", 1, 2, 2, rank=0, in_flight="later").check()
    info = ReshardTrainerInitInfo("h", 1, 2, 2, rank=0, in_flight="wait")
    no_pause = type("C", (), {m: lambda *a, **k: None for m in (
        "start_weight_update", "update_weights", "finish_weight_update")})()
    with pytest.raises(ReshardError, match="in_flight='wait' pauses the engine"):
        ReshardTrainerEngine(client=no_pause, is_sender=True, init_info=info)._can_pause(info)
    assert "token" not in repr(ReshardTrainerInitInfo("h", 1, 2, 2, rank=0, token="s" * 20))
    with pytest.raises(ReshardError, match="heap_slack_bytes=-1"):
        ReshardTrainerInitInfo("h", 1, 2, 2, rank=0, heap_slack_bytes=-1).check()
    # the engine's default travels as nothing (a server of the same version assumes it)
    assert "heap_slack_bytes" not in ReshardTrainerInitInfo("h", 1, 2, 2,
                                                            rank=0).worker_init_info()
    assert ReshardTrainerInitInfo("h", 1, 2, 2, rank=0, heap_slack_bytes=None
                                  ).worker_init_info()["heap_slack_bytes"] is None

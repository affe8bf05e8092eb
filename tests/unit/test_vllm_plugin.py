"""The vLLM plugin's decisions, isolated from an engine: which worker calls committed new
weights, what the engine core does then, and the refusal where the plugin is not loaded.
(The real engine core is exercised by tests/integration/test_vllm_refit.py.)"""

from __future__ import annotations

import pytest

from reshard.errors import ReshardError
from reshard.integrations import vllm_plugin as plugin


def test_committing_calls():
    ok = [{"ok": True, "committed": True, "version": 3}] * 2
    assert plugin.committed("reshard_refit", ok) == 3
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
    plugin._wrap(_Core.collective_rpc)(core, "finish_weight_update")
    assert core.calls == [("rpc", "finish_weight_update"), ("reset", True)]


def test_other_calls_leave_the_cache():
    core = _Core([{"ok": False, "version": 1}])
    plugin._wrap(_Core.collective_rpc)(core, "reshard_refit")
    assert core.calls == [("rpc", "reshard_refit")]


def test_a_reset_that_fails_is_an_error():
    core = _Core([None], resets_ok=False)
    with pytest.raises(RuntimeError, match="could not reset its prefix cache"):
        plugin._wrap(_Core.collective_rpc)(core, "finish_weight_update")


def test_refused_where_the_plugin_is_not_loaded(monkeypatch):
    monkeypatch.setattr(plugin, "_LOADED", False)
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    with pytest.raises(ReshardError, match=r"plugin is not loaded in this engine \(VLLM_PLUGINS="
                       r"'lora_filesystem_resolver'\).*add 'reshard' to VLLM_PLUGINS"):
        plugin.require_loaded()
    monkeypatch.setattr(plugin, "_LOADED", True)
    plugin.require_loaded()


def test_the_package_declares_the_entry_point():
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get(plugin.PLUGIN_NAME) == "reshard.integrations.vllm_plugin:load"

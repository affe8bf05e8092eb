"""HeapBound, the commit's bound on freed heap memory kept resident, isolated from the
process's real memory: it hands the freed heap back only once the growth since the
commit began exceeds its slack, measured from where the commit began, and at once
between a large module's old copy and its new one (``make_room``)."""

from __future__ import annotations

import pytest

from reshard.integrations.vllm import memory as vllm_memory


@pytest.fixture
def memory(monkeypatch):
    """The resident memory HeapBound reads, and the trims it asks for, under the test's
    control: a trim gives back what was freed (``state["freed"]``)."""
    state = {"rss": 1000 << 20, "freed": 0, "trims": 0}

    def trim() -> None:
        state["trims"] += 1
        state["rss"] -= state["freed"]
        state["freed"] = 0

    monkeypatch.setattr(vllm_memory, "rss_bytes", lambda field="VmRSS": state["rss"])
    monkeypatch.setattr(vllm_memory, "return_freed_memory", trim)
    return state


def test_no_trim_while_the_growth_is_within_the_slack(memory):
    heap = vllm_memory.HeapBound(slack=32 << 20)
    for _ in range(4):  # four modules of 8 MB whose old copies stay resident
        memory["rss"] += 8 << 20
        memory["freed"] += 8 << 20
        heap.check()
    assert heap.trims == memory["trims"] == 0  # 32 MB: at the slack, not beyond


def test_trims_once_the_slack_is_spent_and_the_growth_stays_bounded(memory):
    start = memory["rss"]
    heap = vllm_memory.HeapBound(slack=32 << 20)
    peak = start
    for _ in range(30):  # each module's new copy faults in; its old one stays resident
        heap.check()
        memory["rss"] += 14 << 20
        memory["freed"] += 14 << 20
        peak = max(peak, memory["rss"])
    heap.check()
    assert heap.trims == memory["trims"] > 0
    # never more than the slack plus one module's copy above where the commit began
    assert peak - start <= (32 << 20) + (14 << 20)
    assert memory["rss"] - start <= 32 << 20


def test_growth_is_measured_from_where_the_commit_began(memory):
    memory["rss"] += 500 << 20  # the received buffers, before the commit
    heap = vllm_memory.HeapBound(slack=32 << 20)
    heap.check()
    assert heap.trims == 0
    memory["rss"] += 33 << 20
    heap.check()
    assert heap.trims == 1


def test_a_large_copy_freed_is_handed_back_before_its_successor_is_made(memory):
    """The module's own copy: freed, handed back, then the new one faults in: the commit
    never holds both, where without make_room it held both until the next check."""
    start = memory["rss"]
    peaks = {}
    for room in (False, True):
        memory.update(rss=start, freed=0)
        heap = vllm_memory.HeapBound(slack=8 << 20)
        peak = start
        for _ in range(6):  # a 27 MB packed copy: freed (pages kept), then made again
            memory["freed"] += 27 << 20
            if room:
                heap.make_room(27 << 20)
            memory["rss"] += 27 << 20
            peak = max(peak, memory["rss"])
            heap.check()
        peaks[room] = peak - start
    assert peaks[False] >= 27 << 20
    assert peaks[True] == 0
    heap = vllm_memory.HeapBound(slack=8 << 20)
    heap.make_room(4 << 20)  # a small copy: left to check()
    assert heap.trims == 0


def test_no_slack_keeps_every_freed_page(memory):
    """``slack=None`` (``heap_slack_bytes=None``): never a trim, whatever the growth or
    the size of a copy, so the next copies reuse the freed pages instead of faulting."""
    heap = vllm_memory.HeapBound(slack=None)
    for _ in range(10):
        memory["freed"] += 64 << 20
        heap.make_room(64 << 20)
        memory["rss"] += 64 << 20
        heap.check()
    assert heap.trims == memory["trims"] == 0


@pytest.mark.parametrize("bad", [-1, 1.5, "8MiB", True])
def test_a_bad_heap_slack_is_refused_by_name(bad):
    from reshard.errors import ConfigError
    from reshard.integrations.vllm.state import check_heap_slack

    with pytest.raises(ConfigError, match="heap_slack_bytes"):
        check_heap_slack(bad)
    assert check_heap_slack(None) is None and check_heap_slack(0) == 0


def test_the_weight_transfer_protocol_refuses_a_bad_heap_slack_at_the_engine_core():
    """Through vLLM's weight-transfer protocol the init info is parsed where the engine
    core checks each call (the plugin), before any worker sees it."""
    pytest.importorskip("vllm")
    from reshard.errors import ConfigError
    from reshard.integrations.vllm.worker import ReshardInitInfo, parse_fields

    fields = {"master_address": "127.0.0.1", "master_port": 1, "trainer_size": 2}
    with pytest.raises(ConfigError, match=r"^init_weight_transfer_engine: heap_slack_bytes"
                                          r"=-1: .*\(nothing was changed\)$"):
        parse_fields(ReshardInitInfo, {**fields, "heap_slack_bytes": -1},
                     "init_weight_transfer_engine")
    assert parse_fields(ReshardInitInfo, {**fields, "heap_slack_bytes": None},
                        "init_weight_transfer_engine").heap_slack_bytes is None

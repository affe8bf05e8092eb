"""``sparse="auto"``'s rule, on plain numbers: after a sparse refit that moved more than
half the dense bytes, or took the rank longer than its last dense refit, it sends dense
for ``AUTO_BACKOFF`` refits, then tries sparse again, each try in a row that does not pay
doubling the wait (up to ``AUTO_BACKOFF_MAX``); while it waits it asks for plain dense
refits but the last, which rebuilds its copy; ``"on"`` never backs off."""

from __future__ import annotations

from reshard.refit.sparse import AUTO_BACKOFF, AUTO_BACKOFF_MAX, SparseRefits, SparseStats


def _sparse(wire: int, dense: int = 1000) -> SparseStats:
    return SparseStats(used=True, dense_bytes=dense, wire_sent=wire)


def _backs_off(mode: str, dense_s: float, wire: int, sparse_s: float) -> int:
    rule = SparseRefits(mode)
    rule._auto(None, dense_s)  # a dense refit: its time kept
    rule._auto(_sparse(wire), sparse_s)
    return rule._skip


def test_auto_backs_off_when_sparse_does_not_pay_in_bytes_or_time():
    assert _backs_off("auto", 1.0, 100, 0.3) == 0  # 10% of the bytes, faster: stays
    assert _backs_off("auto", 1.0, 600, 0.3) == AUTO_BACKOFF  # over half the bytes
    assert _backs_off("auto", 1.0, 100, 1.2) == AUTO_BACKOFF  # slower than dense
    assert _backs_off("on", 1.0, 600, 1.2) == 0


def test_auto_tries_sparse_again_after_the_backoff():
    rule = SparseRefits("auto")
    rule._auto(None, 1.0)
    rule._auto(_sparse(900), 0.5)
    left = []
    for _ in range(AUTO_BACKOFF + 1):
        left.append(rule._skip)
        rule._auto(None, 1.0)  # each backed-off refit is dense
    assert left == list(range(AUTO_BACKOFF, -1, -1))


def _wait_out(rule: SparseRefits) -> list[bool]:
    """Dense refits until it asks for sparse again; what it asked at each."""
    asked = []
    while rule._skip:
        asked.append(rule.view()[1])
        rule._auto(None, 1.0)
    return asked


def test_auto_asks_plain_dense_refits_while_it_waits_but_the_last():
    rule = SparseRefits("auto")
    rule._auto(None, 1.0)
    assert rule.view()[1]
    rule._auto(_sparse(900), 0.5)  # did not pay
    # plain dense (no copy kept), then the last through the sparse transport (its copy
    # rebuilt as it casts), then a try
    assert _wait_out(rule) == [False] * (AUTO_BACKOFF - 1) + [True]
    assert rule.view()[1]


def test_each_try_that_does_not_pay_doubles_the_wait_and_one_that_pays_resets_it():
    rule = SparseRefits("auto")
    rule._auto(None, 1.0)
    waits = []
    for _ in range(6):
        rule._auto(_sparse(900), 0.5)  # the try did not pay
        waits.append(len(_wait_out(rule)))
    assert waits == [4, 8, 16, 32, 32, 32] and AUTO_BACKOFF_MAX == 32
    rule._auto(_sparse(100), 0.5)  # this one pays: no wait, and the next is short again
    assert rule._skip == 0 and rule.view()[1]
    rule._auto(_sparse(900), 0.5)
    assert rule._skip == AUTO_BACKOFF


def test_regions_sent_dense_to_a_peer_without_the_base_do_not_count_against_sparse():
    rule = SparseRefits("auto")
    rule._auto(None, 1.0)
    # 1000 of the 2000 dense bytes went whole to a joiner; the other 1000 took 50
    rule._auto(SparseStats(used=True, dense_bytes=2000, wire_sent=1050,
                           unbased_bytes=1000), 0.5)
    assert rule._skip == 0 and rule.last_ratio == 0.05


def test_auto_declines_a_copy_that_would_not_fit_and_the_group_goes_dense(monkeypatch):
    """``sparse="auto"`` keeps its copy only where it takes at most
    ``AUTO_MEMORY_FRACTION`` of the memory free where it would live: short of it the rank
    declines (says why, asks no sparse refit) and, once its view is heard, no refit of
    the meeting goes sparse and every other auto rank lets its copy go; ``"on"`` keeps
    it anyway."""
    import torch

    from reshard.refit import sparse

    class Runner:  # what _room asks of an executor's sparse transport
        copy_bytes = 3 << 20

        def copy_device(self, src):
            return torch.device("cpu")

    class Ex:
        method = "reshard"

        def sparse_runner(self, copies):
            return Runner()

    free = sparse.free_bytes(torch.device("cpu"))
    assert free is not None and free > 0  # /proc/meminfo's MemAvailable
    monkeypatch.setattr(sparse, "free_bytes", lambda device: 4 << 20)  # 4 MiB free
    short, roomy, forced = SparseRefits("auto"), SparseRefits("auto"), SparseRefits("on")
    stats = SparseStats()
    short.committed(0, {}, [Ex()], stats)
    assert short.declined and "3.0 MiB" in short.declined and stats.declined == short.declined
    assert short.base is None and short.view() == (None, False, True)
    monkeypatch.setattr(sparse, "AUTO_MEMORY_FRACTION", 1.0)  # 3 of 4 MiB now fits
    roomy.copies.regions[("w",)] = object()  # as if its copy were made
    roomy.base = 0
    assert roomy._room({}, [Ex()]) and roomy.view() == (0, True, False)
    assert forced._room({}, [Ex()]) and forced.keeps_copy
    views = [short.view(), roomy.view(), (0, False, False)]  # two trainer ranks, an engine
    assert SparseRefits.decide(views) is None  # dense: one trainer rank declined
    roomy.heard(views)
    assert roomy.declined and "rank 0" in roomy.declined and not roomy.copies.regions
    assert not roomy.view()[1] and not roomy.keeps_copy

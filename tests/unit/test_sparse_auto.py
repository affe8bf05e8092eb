"""``sparse="auto"``'s rule, on plain numbers: after a sparse refit that moved more than
half the dense bytes, or took the rank longer than its last dense refit, it sends dense
for ``AUTO_BACKOFF`` refits, then tries sparse again; ``"on"`` never backs off."""

from __future__ import annotations

from reshard.refit.sparse import AUTO_BACKOFF, SparseRefits, SparseStats


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

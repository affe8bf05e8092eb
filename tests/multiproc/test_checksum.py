"""The integrity option: a byte flipped in transit (a hook on one receiving rank) fails
the refit cleanly on every rank with ``checksum``, the previous version stays live, and
the next refit on the same group succeeds; without it the corruption goes unnoticed.
Dense refits (``sparse="off"``) and sparse ones (``"on"``: the flip lands in the second
refit's encoded messages) alike."""

from __future__ import annotations

import pytest
import torch
from _refit_world import T, holds, make_side, set_version  # tests/multiproc is on sys.path

import reshard as R
from reshard.tools.launch import free_port, run_processes

pytestmark = pytest.mark.multiproc


def _flip(k: int, peer: int, buf: torch.Tensor) -> None:
    buf.view(torch.uint8)[buf.numel() // 2] ^= 0x10  # one bit, mid-message


def _job(rank, _world, port, checksum, scale=1, sparse="off"):
    keyed = {"token": "checksum-test-token-0123"} if checksum == "hmac" else {}
    if rank < T:
        keyed["sparse"] = sparse
    side, tensors, layouts, r = make_side(rank, port, scale, checksum=checksum, **keyed)
    direct = 0
    log = []
    for version in (1, 2, 3):
        if rank < T:
            set_version(tensors, layouts, r, version)
        runner = side.executors[0]._runner
        hooked = side.executors[0].sparse_runner() if sparse == "on" else runner
        hooked.on_receive = _flip if (rank == T + 1 and version == 2) else None
        direct = max(direct, runner.stats.direct_messages)  # the previous refit's
        try:
            side.refit(version) if rank < T else side.refit()
            log.append({"version": version, "ok": True, "live": side.version,
                        "exact": rank < T or holds(tensors, layouts, r, version)})
        except R.TransferError as e:
            log.append({"version": version, "ok": False, "live": side.version,
                        "kept": rank < T or holds(tensors, layouts, r, side.version),
                        "broken": side.broken, "error": str(e)[:200]})
    log.append({"direct_messages": direct})
    return log


@pytest.mark.parametrize(("kind", "scale", "sparse"),
                         [("sum", 1, "off"), ("crc32", 1, "off"), ("sum", 8, "off"),
                          ("hmac", 1, "off"), ("crc32", 1, "on"), ("hmac", 8, "on")],
                         ids=["sum-packed", "crc32-packed", "sum-direct", "hmac-packed",
                              "crc32-sparse", "hmac-sparse-direct"])
def test_corrupted_message_fails_refit_on_every_rank(kind, scale, sparse):
    logs = run_processes(_job, 2 * T, free_port(), kind, scale, sparse, init=False,
                         timeout=120)
    if sparse == "off":  # scale 8: messages of 1 MiB and more travel unpacked, in place
        assert (logs[T + 1][-1]["direct_messages"] > 0) == (scale > 1), logs[T + 1][-1]
    for *log, _ in logs:
        first, bad, last = log
        assert first["ok"] and first["exact"], log
        assert not bad["ok"] and bad["kept"] and bad["live"] == 1 and not bad["broken"], log
        assert "checksum mismatch" in bad["error"], bad["error"]
        assert last["ok"] and last["exact"] and last["live"] == 3, log


def test_without_checksum_corruption_goes_unnoticed():
    logs = run_processes(_job, 2 * T, free_port(), False, init=False, timeout=120)
    bad = [log[1] for log in logs]  # (the last entry of each log is a count)
    assert all(e["ok"] for e in bad)  # nobody noticed...
    assert not bad[T + 1]["exact"]  # ...but the corrupted rank holds wrong weights

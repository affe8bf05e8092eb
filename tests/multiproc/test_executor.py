"""The executor over real gloo processes: every method, bit-identical results."""

from __future__ import annotations

import pytest
import torch

import reshard as R
from reshard.executor import Executor
from reshard.tools.launch import run_processes
from reshard.topology import Topology

pytestmark = pytest.mark.multiproc

METHODS = ["reshard", "p2p", "gather_broadcast"]
RELAY = "reshard, relayed"  # the domain schedule on 2-rank domains, fanout="relay"


def _globals(layouts: dict[str, R.Layout], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, lay in layouts.items():
        dtype = getattr(torch, lay.dtype)
        if dtype.is_floating_point:
            out[name] = torch.randn(lay.shape, generator=g).to(dtype)
        else:
            out[name] = torch.randint(-1000, 1000, lay.shape, generator=g).to(dtype)
    return out


def _worker(rank, world, cases, method, budget, ordered=False):
    results = []
    for src, dst, seed in cases:
        plan = R.plan(src, dst, allow_cast=True)
        full = _globals(src, seed)
        mine_src = {n: lay.shard(full[n], rank) for n, lay in src.items() if rank in lay.rank_set}
        mine_dst = {n: torch.full(lay.local_shape(rank), -7, dtype=getattr(torch, lay.dtype))
                    for n, lay in dst.items() if rank in lay.rank_set}
        if method == RELAY:  # every 2 ranks a domain: replicas fed through relays
            ex = Executor(plan, method="reshard", budget_bytes=budget,
                          topology=Topology.uniform(2), fanout="relay")
            assert ex.schedule.fanout == "relay"
        else:
            ex = Executor(plan, method=method, budget_bytes=budget)
        if ordered:  # the posting order of an order-matched backend (NCCL), over gloo
            ex._runner.ordered = True
        stats = ex.run(mine_src, mine_dst)
        ok = all(torch.equal(mine_dst[n], lay.shard(full[n].to(mine_dst[n].dtype), rank))
                 for n, lay in dst.items() if rank in lay.rank_set)
        results.append((ok, stats.bytes_sent, stats.bytes_received))
    return results


def _layout(shape, ranks, placements, dtype="float32"):
    return R.Layout(shape, R.Mesh(ranks), placements, dtype=dtype)


def _cases():
    S, Rp, SS = R.Shard, R.Replicate, R.StridedShard
    cases = []
    # disjoint: tp4 (ranks 0-3) -> tp2 x dp2 (ranks 4-7), several tensors and dtypes
    src = {"w": _layout((37, 16), [0, 1, 2, 3], [S(0)]),
           "o": _layout((16, 37), [0, 1, 2, 3], [S(1)], "bfloat16"),
           "n": _layout((16,), [0, 1, 2, 3], [Rp()], "int64")}
    dst = {"w": _layout((37, 16), [[4, 5], [6, 7]], [Rp(), S(1)]),
           "o": _layout((16, 37), [[4, 5], [6, 7]], [Rp(), S(0)], "bfloat16"),
           "n": _layout((16,), [[4, 5], [6, 7]], [Rp(), Rp()], "int64")}
    cases.append((src, dst, 1))
    # overlapping meshes, strided FSDP2+TP source to uneven dst, with a cast
    src = {"a": _layout((13, 6, 5), [[0, 1], [2, 3]], [SS(0, 2), S(0)]),
           "b": _layout((9,), [[0, 1], [2, 3]], [S(0), Rp()])}
    dst = {"a": _layout((13, 6, 5), [2, 3, 4, 5, 6], [S(2)], "bfloat16"),
           "b": _layout((9,), [5, 6, 7], [S(0)], "bfloat16")}
    cases.append((src, dst, 2))
    # identical meshes: reshard in place between placements
    src = {"x": _layout((8, 12), [[0, 1, 2, 3], [4, 5, 6, 7]], [S(0), S(1)])}
    dst = {"x": _layout((8, 12), [[0, 1, 2, 3], [4, 5, 6, 7]], [S(1), Rp()])}
    cases.append((src, dst, 3))
    # large regions (>= 1 MiB): contiguous ones travel alone, straight from/into tensors
    src = {"big": _layout((2048, 512), [0, 1], [S(0)]),
           "big_t": _layout((512, 2048), [0, 1], [S(1)]),
           "cast": _layout((1024, 512), [0, 1], [S(0)])}
    dst = {"big": _layout((2048, 512), [[4, 5], [6, 7]], [Rp(), S(0)]),
           "big_t": _layout((512, 2048), [4, 5], [S(0)]),
           "cast": _layout((1024, 512), [4, 5], [S(0)], "bfloat16")}
    cases.append((src, dst, 4))
    return cases


@pytest.mark.parametrize("method", [*METHODS, RELAY])
def test_methods_bit_identical(method):
    results = run_processes(_worker, 8, _cases(), method, 1 << 20, timeout=180)
    for rank, per_case in enumerate(results):
        for i, (ok, _, _) in enumerate(per_case):
            assert ok, f"rank {rank} case {i} method {method}"


@pytest.mark.parametrize("method", ["p2p", "reshard", RELAY])
def test_round_by_round_posting_bit_identical(method):
    """The whole-round posting used where messages match only by order (NCCL)."""
    results = run_processes(_worker, 8, _cases(), method, 1 << 20, True, timeout=180)
    for rank, per_case in enumerate(results):
        for i, (ok, _, _) in enumerate(per_case):
            assert ok, f"rank {rank} case {i} method {method}"


def _arena_worker(rank, world, ordered):
    """Two ranks: rank 0 sends two large tensors to rank 1, one of them cast, and two
    small ones, packed together into one message."""
    S = R.Shard
    src = {"same": _layout((1024, 512), [0], [S(0)]),
           "cast": _layout((1024, 512), [0], [S(0)]),
           "small": _layout((4, 8), [0], [S(0)]),
           "small2": _layout((8, 8), [0], [S(0)])}
    dst = {"same": _layout((1024, 512), [1], [S(0)]),
           "cast": _layout((1024, 512), [1], [S(0)], "bfloat16"),
           "small": _layout((4, 8), [1], [S(0)]),
           "small2": _layout((8, 8), [1], [S(0)])}
    plan = R.plan(src, dst, allow_cast=True)
    full = _globals(src, 3)
    mine_src = {n: full[n] for n in src} if rank == 0 else {}
    mine_dst = {n: torch.zeros(lay.shape, dtype=getattr(torch, lay.dtype))
                for n, lay in dst.items()} if rank == 1 else {}
    ex = Executor(plan, method="p2p", budget_bytes=64 << 20)
    ex._runner.ordered = ordered
    out = []
    for _ in range(2):
        ex.run(mine_src, mine_dst)
        ok = all(torch.equal(mine_dst[n], full[n].to(mine_dst[n].dtype)) for n in dst) \
            if rank == 1 else True
        out.append((ok, ex._runner._send_arena.numel(), ex._runner._recv_arena.numel(),
                    ex._runner.staging_bytes))
    return out


@pytest.mark.parametrize("ordered", [False, True])
def test_arenas_hold_only_staged_messages(ordered):
    """A message that lands in place takes no arena room: the receiver's arena holds
    only the small tensors' packed message, the sender's the cast region and that
    message."""
    results = run_processes(_arena_worker, 2, ordered, timeout=120)
    assert all(ok for ok, *_ in results[0] + results[1])
    (_, send0, recv0, whole0), (_, send1, recv1, _) = results[0][-1], results[1][-1]
    assert recv0 == 0 and send1 == 0
    assert 1024 * 512 * 2 <= send0 < 1024 * 512 * 2 + 4096  # the cast rows + the small ones
    assert 0 < recv1 <= 4096  # the small tensors' message; not the 3 MiB of the rest
    assert whole0[0] >= 1024 * 512 * 4  # staging every message: the 2 MiB one's round


def test_small_budget_moves_in_rounds():
    results = run_processes(_worker, 8, _cases()[:1], "reshard", 1024, timeout=180)
    assert all(ok for per_case in results for ok, _, _ in per_case)


def test_bytes_match_plan():
    cases = _cases()[:1]
    results = run_processes(_worker, 8, cases, "p2p", 1 << 20, timeout=180)
    src, dst, _ = cases[0]
    stats = R.plan(src, dst).stats()
    assert sum(r[0][1] for r in results) == stats.bytes_sent
    assert sum(r[0][2] for r in results) == stats.bytes_sent


def _bad_worker(rank, world, mistake):
    src_l = {"w": _layout((8, 4), [0, 1], [R.Shard(0)])}
    dst_l = {"w": _layout((8, 4), [2, 3], [R.Shard(1)])}
    plan = R.plan(src_l, dst_l)
    full = _globals(src_l, 0)["w"]
    src = {"w": src_l["w"].shard(full, rank)} if rank < 2 else {}
    dst = {"w": torch.full((8, 2), -1.0)} if rank >= 2 else {}
    if rank == 3:
        if mistake == "shape":
            dst["w"] = torch.zeros(8, 3)
        elif mistake == "dtype":
            dst["w"] = torch.zeros(8, 2, dtype=torch.float64)
        elif mistake == "missing":
            del dst["w"]
    before = {k: v.clone() for k, v in dst.items()}
    try:
        Executor(plan).run(src, dst)
    except R.ReshardError as e:
        untouched = all(torch.equal(before[k], dst[k]) for k in before)
        return type(e).__name__, str(e), untouched
    return None, "", True


@pytest.mark.parametrize("mistake, message", [
    ("shape", r"rank 3: destination tensor 'w' has local shape \[8, 3\], its layout says "
              r"\[8, 2\]; nothing was moved"),
    ("dtype", r"rank 3: destination tensor 'w' has dtype torch.float64, its layout says float32"),
    ("missing", r"rank 3: destination tensor 'w' is missing"),
])
def test_bad_tensors_refused_on_every_rank(mistake, message):
    import re

    results = run_processes(_bad_worker, 4, mistake, timeout=60)
    for name, text, untouched in results:
        assert name == "TensorMismatchError"
        assert re.search(message, text), text
        assert untouched

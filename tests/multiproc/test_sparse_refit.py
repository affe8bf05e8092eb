"""Sparse refits between two jobs (2 fp32 trainer ranks, rows; 2 bf16 engine ranks,
columns, a replicated norm), one process each, in a few seconds: after the first
(dense) refit only the changed bf16 values travel, every version lands bit for bit;
an engine rank without the base gets dense while the other gets sparse, in the same
refit (a sparse refit calls the progress callback as a dense one does); a trainer
failing midway leaves the previous version live and no rank with a
base; the next refit is dense and exact again; ``sparse="auto"`` goes dense after a
refit where sparse did not pay."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback

import pytest
import torch

import reshard as R
from reshard.comm import free_port
from reshard.refit import RefitReceiver, RefitSender

pytestmark = pytest.mark.multiproc

SHAPE = (64, 48)
TRAINER = {"w": R.Layout(SHAPE, R.Mesh([0, 1]), [R.Shard(0)]),
           "norm": R.Layout((48,), R.Mesh([0, 1]), [R.Replicate()])}
ENGINE = {"w": R.Layout(SHAPE, R.Mesh([0, 1]), [R.Shard(1)], "bfloat16"),
          "norm": R.Layout((48,), R.Mesh([0, 1]), [R.Replicate()], "bfloat16")}
JOBS = dict(host="127.0.0.1", trainer_size=2, inference_size=2, checksum="crc32")
#: per step: the fraction of elements changed; ``None``: the trainer fails midway; the
#: last step changes nothing (a sparse refit of no payload at all)
STEPS = [1.0, 0.02, 0.05, None, 0.01, 0.9, 0.01, 0.0]
FORGET_AT = 3  # engine rank 1 drops its base before this refit


def full(step: int) -> dict[str, torch.Tensor]:
    """Every step's weights, from the steps before: a fraction of elements redrawn."""
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(SHAPE, generator=g), "norm": torch.randn(48, generator=g)}
    for s in range(1, step + 1):
        frac = STEPS[s - 1]
        if frac is None:
            continue
        for t in state.values():
            hit = torch.rand(t.shape, generator=g) < frac
            t[hit] = torch.randn(int(hit.sum()), generator=g)
    return state


class Failing(dict):
    """Parameters one of which cannot be read while refit ``at`` sends (the pre-send
    check still reads it)."""

    def __init__(self, params, at):
        super().__init__(params)
        self.at, self.step, self.reads = at, 0, 0

    def __getitem__(self, name):
        if name == "w" and self.step == self.at:
            self.reads += 1
            if self.reads > 1:
                raise RuntimeError("injected failure")
        return super().__getitem__(name)


def trainer(rank, port, mode, out):
    params = {n: TRAINER[n].shard(t, rank).clone() for n, t in full(0).items()}
    wrapped = Failing(params, STEPS.index(None) + 1)
    calls = []  # the progress callback's (done, total), this refit
    sender = RefitSender(wrapped, layouts=TRAINER, rank=rank, port=port, sparse=mode,
                         progress=lambda done, total: calls.append((done, total)), **JOBS)
    log = []
    for step in range(1, len(STEPS) + 1):
        for n, t in full(step).items():
            params[n].copy_(TRAINER[n].shard(t, rank))
        wrapped.step, wrapped.reads = step, 0
        calls.clear()
        try:
            s = sender.refit(step)
            if s.sparse is not None and s.sparse.used:  # a sparse refit reports progress too
                assert calls and calls[-1][0] == s.sparse.wire_sent, (calls, s.sparse)
            log.append(("ok", s.bytes_sent, s.sparse))
        except R.TransferError as e:
            log.append(("failed", str(e), None))
    out.put(("trainer", rank, log, sender.sparse_refits.state_bytes()))


def engine(rank, port, mode, out):
    served = {n: torch.zeros(ENGINE[n].local_shape(rank), dtype=torch.bfloat16)
              for n in ENGINE}
    receiver = RefitReceiver(served, ENGINE, rank=rank, port=port, **JOBS)
    log = []
    for step in range(1, len(STEPS) + 1):
        if step == FORGET_AT and rank == 1:
            receiver.invalidate()
        try:
            s = receiver.refit()
            ok = s.version
        except R.TransferError:
            s, ok = None, "failed"
        want = full(receiver.version)
        exact = all(torch.equal(served[n].view(torch.int16), ENGINE[n].shard(
            want[n].bfloat16(), rank).view(torch.int16)) for n in ENGINE)
        log.append((ok, receiver.version, exact, s and s.bytes_received, s and s.sparse))
    out.put(("engine", rank, log, None))


def _guard(f):
    def run(*args):
        # forked from pytest, whose earlier tests may have run OpenMP teams: a parallel
        # region here would wait for threads that were not forked (the first large
        # torch op hung, after the unit tests in one session); one thread keeps ATen
        # out of OpenMP
        torch.set_num_threads(1)
        try:
            f(*args)
        except BaseException:
            args[-1].put(("error", traceback.format_exc()))
            raise
    return run


def _processes(ctx, out, jobs: list[tuple]) -> list:
    """Run ``(function, args)`` each in a forked process; what each put in ``out``."""
    procs = [ctx.Process(target=_guard(f), args=args) for f, args in jobs]
    for p in procs:
        p.start()
    got = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
    errors = [g[1] for g in got if g[0] == "error"]
    assert not errors, errors[0]
    return got


def _run(mode):
    ctx, port = mp.get_context("fork"), free_port()
    out = ctx.Queue()
    got = _processes(ctx, out, [(f, (r, port, mode, out)) for f in (trainer, engine)
                                for r in (0, 1)])
    return ({r: log for side, r, log, _ in got if side == "trainer"},
            {r: log for side, r, log, _ in got if side == "engine"},
            {r: b for side, r, _, b in got if side == "trainer"})


def test_sparse_refits_land_exactly_dense_where_the_base_differs():
    trainers, engines, state = _run("on")
    dense = SHAPE[0] * SHAPE[1] // 2 * 2 + 48 * 2  # one engine rank's bf16 bytes
    fail = STEPS.index(None) + 1
    for log in engines.values():
        assert [v for _, v, _, _, _ in log] == [1, 2, 3, 3, 5, 6, 7, 8]
        assert all(exact for _, _, exact, _, _ in log), log  # every step, bit for bit
        assert log[fail - 1][0] == "failed"
        first, second = log[0], log[1]
        assert first[3] == dense and first[4] is None  # no base yet: dense, as ever
        assert second[4].used and second[3] < 0.2 * dense  # 2% changed
        assert second[4].regions_by_encoding.keys() <= {"offsets16", "offsets32", "bitmap"}
        # the refit after the failure: no engine rank holds a base, a plain dense refit
        after = log[fail]
        assert after[4] is None and after[3] == dense
        assert log[-2][4].used and log[-2][3] < 0.1 * dense  # 1% changed, sparse again
        assert log[-1][4].used and log[-1][4].changed == 0 and log[-1][3] < 100  # headers
    # engine rank 1 forgot its base: dense to it, sparse to rank 0, in the same refit
    assert engines[1][FORGET_AT - 1][4].regions_by_encoding.keys() == {"dense"}
    assert engines[1][FORGET_AT - 1][3] >= dense
    assert engines[0][FORGET_AT - 1][3] < 0.3 * dense
    for log in trainers.values():
        assert [s for s, _, _ in log].count("failed") == 1
        assert log[FORGET_AT - 1][2].dense_peers == (3,)  # group rank 3 = engine rank 1
        assert 0 < log[1][2].changed_fraction < 0.05
        assert log[1][2].detect_seconds > 0
    # the trainer's copy: what it sends, in bf16 (its rows; the norm once to each engine
    # rank, from the sender the plan chose)
    assert sum(state.values()) == SHAPE[0] * SHAPE[1] * 2 + 2 * 48 * 2


#: the auto case's steps: those above, then three more 1% steps: the wait after step 6
#: ends at step 10, and step 11 tries sparse again
AUTO_STEPS = [*STEPS, 0.01, 0.01, 0.01]


def test_auto_goes_dense_after_a_refit_where_sparse_did_not_pay(monkeypatch):
    import sys

    from reshard.refit import sparse

    me = sys.modules[__name__]  # the forks see what is set here
    monkeypatch.setattr(me, "STEPS", AUTO_STEPS)
    # the bytes decide, not the time: a refit of these few kilobytes takes a
    # millisecond, which the host's noise decides (tests/unit/test_sparse_auto.py has
    # the time rule)
    monkeypatch.setattr(sparse, "AUTO_SLOWER", float("inf"))
    trainers, engines, _ = _run("auto")
    dense = SHAPE[0] * SHAPE[1] // 2 * 2 + 48 * 2  # one engine rank's bf16 bytes
    for log in engines.values():
        assert [v for _, v, _, _, _ in log] == [1, 2, 3, 3, *range(5, 12)]
        assert all(exact for _, _, exact, _, _ in log), log  # every step, bit for bit
        # the wait: plain dense refits (steps 7 to 9), then step 10 dense through the
        # sparse transport, then step 11 sparse again, onto the rebuilt copy
        assert all(log[k][4] is None and log[k][3] == dense for k in (6, 7, 8)), log
        assert log[9][4].used and log[9][4].regions_by_encoding.keys() == {"dense"}
        assert log[10][4].used and log[10][3] < 0.1 * dense, log[10]
    # step 3: engine rank 1 forgot its base and got dense, rank 0 sparse; what went dense
    # to rank 1 does not count against sparse: no wait begins there (step 5, after the
    # failure, is dense as ever, step 6 tries sparse)
    assert engines[1][FORGET_AT - 1][4].regions_by_encoding.keys() == {"dense"}
    assert engines[0][FORGET_AT - 1][3] < 0.3 * dense
    for log in trainers.values():
        assert log[FORGET_AT - 1][2].unbased_bytes > 0
        kinds = [set(s.regions_by_encoding) if s is not None else None for _, _, s in log]
        # step 2: sparse; step 6 (90% changed) did not pay, so it backs off for 4 refits:
        # steps 7-9 plain dense (the copy left as it was), step 10 every region dense
        # through the sparse transport (the copy rebuilt as it casts), step 11 sparse
        assert kinds[1] - {"dense"} and log[5][2].used, kinds
        assert not any(log[k][2].used for k in (6, 7, 8)), kinds
        assert kinds[9] == {"dense"} and log[9][2].used, kinds
        assert kinds[10] - {"dense"} and log[10][2].used, kinds


def test_auto_short_of_memory_keeps_no_copy_and_refits_dense(monkeypatch):
    """``sparse="auto"`` (the default) where its copy would take more than
    ``AUTO_MEMORY_FRACTION`` of the free memory (here: any copy at all): no trainer rank
    keeps one, each says why, and every refit is dense and exact."""
    from reshard.refit import sparse

    monkeypatch.setattr(sparse, "AUTO_MEMORY_FRACTION", 0.0)  # the forks see it
    trainers, engines, state = _run("auto")
    dense = SHAPE[0] * SHAPE[1] // 2 * 2 + 48 * 2  # one engine rank's bf16 bytes
    assert state == {0: 0, 1: 0}  # no copy on either trainer rank
    for log in trainers.values():
        done = [s for ok, _, s in log if ok == "ok"]
        assert len(done) == len(STEPS) - 1 and not any(s.used for s in done), log
        assert all("keeps no copy" in s.declined for s in done), done
    for log in engines.values():
        assert all(exact for _, _, exact, _, _ in log), log
        assert all(got is None or (sp is None and got == dense)
                   for ok, _, _, got, sp in log), log


# -- elastic replicas: a joiner gets dense while the others get sparse -------------------
ELASTIC_STEPS = [1.0, 0.02, 0.03, 0.01, 1.0]  # changed per step; B and C join before step 3
JOIN_AT = 3
REPLICAS = {"A": 2, "B": 2, "C": 1}  # A and B share a layout (TP2), C is TP1


def elastic_full(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    state = {"w": torch.randn(SHAPE, generator=g), "norm": torch.randn(48, generator=g)}
    for frac in ELASTIC_STEPS[1:step]:
        for t in state.values():
            hit = torch.rand(t.shape, generator=g) < frac
            t[hit] = torch.randn(int(hit.sum()), generator=g)
    return state


def replica_layouts(tp: int) -> dict[str, R.Layout]:
    mesh = R.Mesh(list(range(tp)))
    return {"w": R.Layout(SHAPE, mesh, [R.Shard(1)], "bfloat16"),
            "norm": R.Layout((48,), mesh, [R.Replicate()], "bfloat16")}


def _fanout(fanout: str) -> None:
    if fanout == "relay":  # every rank its own fast domain: replicas relay to each other
        os.environ["RESHARD_DOMAIN_SIZE"] = "1"


def elastic_trainer(rank, port, joined, fanout, out):
    from reshard.refit.elastic import ElasticSender

    _fanout(fanout)
    params = {n: TRAINER[n].shard(t, rank).clone() for n, t in elastic_full(1).items()}
    sender = ElasticSender(params, TRAINER, host="127.0.0.1", port=port, rank=rank,
                           trainer_size=2, sparse="on", checksum="crc32", fanout=fanout)
    log = []
    for step in range(1, len(ELASTIC_STEPS) + 1):
        for n, t in elastic_full(step).items():
            params[n].copy_(TRAINER[n].shard(t, rank))
        if step == JOIN_AT:
            joined.set()  # B and C ask to join now
        if rank == 0 and step in (1, JOIN_AT):
            sender.wait_for_requests(1 if step == 1 else 3)
        s = sender.refit(step)
        log.append((s.sparse, sender.offsets, sender.side.sparse_refits.state_bytes(),
                    sender.side.executors[0].schedule.fanout))
    out.put(("trainer", rank, log))


def elastic_replica(rid, rank, port, joined, fanout, out):
    from reshard.refit.elastic import ElasticReceiver

    _fanout(fanout)
    if rid != "A":
        joined.wait(60)
    tp = REPLICAS[rid]
    lays = replica_layouts(tp)
    served = {n: torch.zeros(lays[n].local_shape(rank), dtype=torch.bfloat16) for n in lays}
    receiver = ElasticReceiver(served, lays, host="127.0.0.1", port=port, replica_id=rid,
                               rank=rank, tp_size=tp, checksum="crc32", fanout=fanout)
    log = []
    while receiver.version < len(ELASTIC_STEPS):
        s = receiver.refit()
        want = elastic_full(s.version)
        exact = all(torch.equal(served[n].view(torch.int16), lays[n].shard(
            want[n].bfloat16(), rank).view(torch.int16)) for n in lays)
        log.append((s.version, exact, s.bytes_received, s.sparse))
    receiver.close()
    out.put((rid, rank, log))


@pytest.mark.parametrize("fanout", ["auto", "relay"])
def test_elastic_joiners_get_dense_while_the_others_get_sparse_in_the_same_refit(fanout):
    """Replica A (TP2) refits from step 1; B (TP2, A's layout) and C (TP1) join before
    step 3: step 3 reaches A sparse and B, C dense (they missed versions 1 and 2), every
    replica bit for bit; steps 4 (1% changed) and 5 (all) reach all three sparse. The
    trainer keeps one copy per region it sends, whichever replicas read it: A and B
    share theirs. ``relay`` (every rank its own fast domain): from step 4, when B holds
    A's base, each trainer rank sends A's ranks only and A's ranks pass the encoded
    messages on to B's, as they came (checksummed end to end); at step 3 B, without the
    base, gets dense straight from the trainer."""
    ctx, port = mp.get_context("fork"), free_port()
    out, joined = ctx.Queue(), ctx.Event()
    got = _processes(ctx, out, [(elastic_trainer, (r, port, joined, fanout, out))
                                for r in (0, 1)]
                     + [(elastic_replica, (rid, r, port, joined, fanout, out))
                        for rid, tp in REPLICAS.items() for r in range(tp)])
    logs = {(who, r): log for who, r, log in got}
    dense = {tp: SHAPE[0] * SHAPE[1] * 2 // tp + 48 * 2 for tp in (1, 2)}  # bf16 a rank
    last = len(ELASTIC_STEPS)
    for rid, tp in REPLICAS.items():
        for r in range(tp):
            log = logs[rid, r]
            versions = [v for v, *_ in log]
            assert versions == list(range(1 if rid == "A" else JOIN_AT, last + 1)), log
            assert all(exact for _, exact, _, _ in log), log
            at = {v: (received, sparse) for v, _, received, sparse in log}
            # step 3: dense to the joiners, sparse to A; step 4: sparse to all
            assert at[3][1].used
            if rid == "A":
                assert at[3][0] < 0.3 * dense[tp] and set(at[3][1].regions_by_encoding) - {
                    "dense"}, at[3]
            else:
                assert at[3][0] >= dense[tp]
                assert set(at[3][1].regions_by_encoding) == {"dense"}, at[3]
            assert at[4][0] < 0.3 * dense[tp], at[4]
            assert set(at[last][1].regions_by_encoding) == {"dense"}, at[last]
    for r in (0, 1):
        log = logs["trainer", r]
        assert log[0][0].used is False  # the first refit: dense, no copy to diff against
        stats3, offsets3, _, _ = log[JOIN_AT - 1]
        joiners = {offsets3[rid] + i for rid in ("B", "C") for i in range(REPLICAS[rid])}
        assert set(stats3.dense_peers) == joiners, (stats3.dense_peers, offsets3)
        assert log[-1][0].dense_peers == ()
        assert log[-1][3] == ("relay" if fanout == "relay" else "direct")
        # one bf16 copy of what this rank sends per replica layout: A and B share theirs
        # (the norm goes from one chosen trainer rank to each replica rank)
        copies = log[-1][2]
        assert SHAPE[0] * SHAPE[1] // 2 * 2 * 2 <= copies <= (SHAPE[0] * SHAPE[1] + 3 * 48) * 2 * 2
    for step in range(JOIN_AT, last + 1):  # who sent what each replica received
        def wire(rid, what, step=step):
            return sum(getattr(logs[rid, r][step - (1 if rid == "A" else JOIN_AT)][3], what)
                       for r in range(REPLICAS[rid]))
        trainer = sum(logs["trainer", r][step - 1][0].wire_sent for r in (0, 1))
        chained = fanout == "relay" and step > JOIN_AT  # B on A's base: fed by A
        assert wire("A", "wire_sent") == (wire("B", "wire_received") if chained else 0)
        assert not chained or wire("A", "wire_sent") > 0
        assert trainer == (wire("A", "wire_received") + wire("C", "wire_received")
                           + (0 if chained else wire("B", "wire_received"))), step


# -- the colocated policy: its tensors go as in a dense refit, in the same refit ---------
COLOCATED_STEPS = [1.0, 0.02, 0.02]


def colocated_side(side, rank, port, out):
    jobs = dict(host="127.0.0.1", port=port, trainer_size=2, inference_size=2)
    log = []
    if side == "trainer":
        params = {n: TRAINER[n].shard(t, rank).clone() for n, t in full(0).items()}
        sender = RefitSender(params, layouts=TRAINER, rank=rank, sparse="on",
                             policy={"norm": "colocated"}, **jobs)
        for step in range(1, len(COLOCATED_STEPS) + 1):
            for n, t in colocated_full(step).items():
                params[n].copy_(TRAINER[n].shard(t, rank))
            log.append(sender.refit(step).sparse)
    else:
        served = {n: torch.zeros(ENGINE[n].local_shape(rank), dtype=torch.bfloat16)
                  for n in ENGINE}
        receiver = RefitReceiver(served, ENGINE, rank=rank, **jobs)
        for _ in COLOCATED_STEPS:
            s = receiver.refit()
            want = colocated_full(s.version)
            log.append((s.sparse, all(torch.equal(served[n].view(torch.int16), ENGINE[n].shard(
                want[n].bfloat16(), rank).view(torch.int16)) for n in ENGINE)))
    out.put((side, rank, log))


def colocated_full(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    state = {"w": torch.randn(SHAPE, generator=g), "norm": torch.randn(48, generator=g)}
    for frac in COLOCATED_STEPS[1:step]:
        for t in state.values():
            t[torch.rand(t.shape, generator=g) < frac] += 1.0
        state["norm"] += 1.0  # the norm changes whole
    return state


def test_colocated_policy_tensors_go_dense_in_a_sparse_refit():
    """``policy={"norm": "colocated"}`` with ``sparse="on"``: from the second refit ``w``
    goes sparse while ``norm`` is read in place by the engine ranks as in a dense refit
    (``dense_methods``), every weight bit for bit each step; the trainer keeps a copy
    of ``w`` only."""
    ctx, port = mp.get_context("fork"), free_port()
    out = ctx.Queue()
    got = _processes(ctx, out, [(colocated_side, (side, r, port, out))
                                for side in ("trainer", "engine") for r in (0, 1)])
    for side, _, log in got:
        if side == "engine":
            assert all(exact for _, exact in log), log
            continue
        assert not log[0].used and log[0].dense_methods == ()
        for stats in log[1:]:
            assert stats.used and stats.dense_methods == ("colocated",), stats
            assert 0 < stats.changed_fraction < 0.1
        assert log[-1].state_bytes == SHAPE[0] * SHAPE[1] // 2 * 2  # w's rows in bf16

"""Sparse against dense refits, in the same run: wire bytes and refit time at a given
fraction of changed engine-dtype values (issue 39).

    PYTHONPATH=src python benchmarks/sparse_refit.py [--model qwen3-0.6b] [--layers N]
        [--fractions 0.001,0.01,0.05,0.2,0.5,1] [--repeats 3] [--link-mbit R]
        [--after-dense] [--out FILE.json] [--profile DIR]

Two jobs of local processes meet as a refit does: a trainer of 2 gloo ranks holding
fp32 master weights FSDP-style (every tensor's rows split over the ranks) and an
engine of 2 ranks holding bf16 weights as vLLM TP2 holds them (q/k/v, gate/up and the
vocabulary split by rows, o and down by columns, norms whole), into plain tensors
through a shadow (no vLLM: the transfer and the receivers' commit, not vLLM's). The
shapes are the model's (``--layers`` keeps fewer of its decoder layers). By default
all four share loopback, a wire as fast as memory; ``--link-mbit R`` (root) puts the
trainer on one emulated node and the engine on another (network namespaces), every
byte between them crossing a link shaped to ``R`` Mbit/s each way, as between nodes.

Before each timed refit every trainer rank changes each of its elements with the given
probability (drawn anew each time, each changed enough to change its bf16 value), so the
fraction is of bf16 values changed since the last committed version. One sender with
``sparse="on"`` alternates sparse refits and dense ones (``refit(..., dense=True)``, the
same transfer as ``sparse="off"``); each timed sparse refit follows an untimed sparse
one of the same fraction, as in an RL loop (``--after-dense``: it follows the dense
one). A dense refit's time here excludes the copy that keeps the sender's base (reported
apart, ``copy s``). The four processes start each refit together (a barrier), so no
refit's time holds another rank's preparation. Reported per fraction: the trainer ranks'
wire bytes against the dense bytes, the median refit time (the trainer's ``refit()``:
its check, detection and encoding, the messages, the receivers' decoding and applying,
the commit), the detection time (the slower trainer rank), the receivers' decoding and
applying (the slower engine rank), and which encodings the regions took. At the end the
engine's weights after the last sparse refit are compared, bit for bit, with those a
dense refit of the same values leaves. ``--profile DIR``: where each process's time in
its sparse refits goes (cProfile).

``--auto F``: instead, ``sparse="auto"`` over ``--steps`` refits at F changed each,
against ``sparse="off"`` (two senders on the same parameters, two meetings; each step
changes the values, then both refit them, one after the other): each one's refit times, the
auto sender's bytes and which of its refits went sparse; then the engine's weights from
both compared bit for bit. At F = 1 this is the issue's "at 100%, auto falls back".
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time

import torch

import reshard as R
from reshard.comm import free_port
from reshard.refit import RefitReceiver, RefitSender

MODELS = {  # hidden, intermediate, layers, heads, kv heads, head_dim, vocab, tied
    "qwen3-0.6b": (1024, 3072, 28, 16, 8, 128, 151936, True),
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, 128, 151936, True),
    "tiny": (256, 512, 4, 4, 2, 64, 4096, False),
    # about Qwen3-30B-A3B's tensor count (48 layers of 128 experts: 18,770 tensors; it
    # has 18,867) at tiny sizes (40 M elements): a refit's cost per tensor and region
    "moe-tensors": (64, 32, 48, 2, 1, 64, 4096, True),
}
EXPERTS = {"moe-tensors": 128}
JOBS = dict(host="127.0.0.1", trainer_size=2, inference_size=2)


def tensors(model: str, layers: int | None) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, how the engine splits it: "rows", "cols" or "whole")."""
    h, inter, n, heads, kv, hd, vocab, tied = MODELS[model]
    vocab = -(-vocab // 128) * 128  # both sides split it evenly
    out = {"model.embed_tokens.weight": ((vocab, h), "rows"), "model.norm.weight": ((h,), "whole")}
    if not tied:
        out["lm_head.weight"] = ((vocab, h), "rows")
    for i in range(layers if layers is not None else n):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": ((heads * hd, h), "rows"),
                    p + "self_attn.k_proj.weight": ((kv * hd, h), "rows"),
                    p + "self_attn.v_proj.weight": ((kv * hd, h), "rows"),
                    p + "self_attn.o_proj.weight": ((h, heads * hd), "cols")})
        experts = EXPERTS.get(model)
        mlps = [p + "mlp."] if experts is None else [p + f"mlp.experts.{e}."
                                                      for e in range(experts)]
        if experts is not None:
            out[p + "mlp.gate.weight"] = ((experts, h), "whole")  # the router
        for q in mlps:
            out.update({q + "gate_proj.weight": ((inter, h), "rows"),
                        q + "up_proj.weight": ((inter, h), "rows"),
                        q + "down_proj.weight": ((h, inter), "cols")})
        out.update({p + "input_layernorm.weight": ((h,), "whole"),
                    p + "post_attention_layernorm.weight": ((h,), "whole")})
    return out


def layouts(specs, side: str) -> dict[str, R.Layout]:
    mesh = R.Mesh([0, 1])
    if side == "trainer":  # FSDP: dim 0 split over the ranks, fp32
        return {n: R.Layout(shape, mesh, [R.Shard(0)]) for n, (shape, _) in specs.items()}
    place = {"rows": [R.Shard(0)], "cols": [R.Shard(1)], "whole": [R.Replicate()]}
    return {n: R.Layout(shape, mesh, place[how], "bfloat16") for n, (shape, how) in specs.items()}


def change(params: dict[str, torch.Tensor], fraction: float, g: torch.Generator) -> None:
    """Change each element with probability ``fraction`` (all of them at 1) by enough
    to change its bf16 value: two bf16 ulps up."""
    for t in params.values():
        flat = t.view(-1)
        if fraction >= 1:
            flat.mul_(1 + 2 ** -6).add_(2 ** -20)
            continue
        idx = (torch.rand(flat.numel(), generator=g) < fraction).nonzero().view(-1)
        flat[idx] = flat[idx] * (1 + 2 ** -6) + 2 ** -20


def kinds(args) -> tuple[str, ...]:
    """The refits of one repeat, in order: by default an untimed sparse refit ("lead"),
    so that the timed sparse refit follows a sparse one as in an RL loop (every refit after
    the first sparse), then the timed sparse and dense ones; ``--after-dense``: the timed
    sparse refit right after the last repeat's dense one (its regions then changed wholly
    at their last refit, so each is first compared on a sample)."""
    return ("sparse", "dense") if args.after_dense else ("lead", "sparse", "dense")


def _node(args, side: str) -> dict:
    """Enter this side's emulated node (``--link-mbit``); the jobs' meeting arguments."""
    if args.nodes is None:
        return JOBS
    from reshard.tools.netns import enter_namespace

    enter_namespace(args.nodes[side == "engine"])
    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
    return {**JOBS, "host": args.host}


def trainer(rank, port, args, out):
    jobs = _node(args, "trainer")
    torch.set_num_threads(args.threads)
    specs = tensors(args.model, args.layers)
    lays = layouts(specs, "trainer")
    g = torch.Generator().manual_seed(rank)
    params = {n: torch.randn(lay.local_shape(rank), generator=g) * 0.02 for n, lay in lays.items()}
    sender = RefitSender(params, layouts=lays, rank=rank, port=port, sparse="on", **jobs)
    version = 1
    sender.refit(version)  # the first refit: dense, the sender's copy made
    rows, prof = [], Profiles(args, f"trainer-{rank}")
    for fraction in args.fractions:
        got = {"sparse": [], "dense": []}
        for _ in range(args.repeats):
            for kind in kinds(args):
                change(params, fraction, g)
                version += 1
                args.barrier.wait()  # all four start each refit together
                if kind == "lead":  # untimed: the sparse refit before the timed one
                    sender.refit(version)
                    continue
                stats = prof.refit(lambda v=version, k=kind: sender.refit(v, dense=k == "dense"))
                got[kind].append(stats)
        rows.append((fraction, got))
    prof.save()
    change(params, 0.01, g)  # a sparse refit, then the same values dense: no change
    sender.refit(version + 1)
    sender.refit(version + 2, dense=True)
    out.put(("trainer", rank, [(f, {k: [_plain(s) for s in v] for k, v in got.items()})
                               for f, got in rows], sender.sparse_refits.state_bytes()))


class Profiles:
    """With ``--profile DIR``: each process's sparse refits under cProfile (dense ones
    and the benchmark's own work left out), their stats added up and written to
    ``DIR/<trainer|engine>-<rank>.prof`` (read them with ``python -m pstats``)."""

    def __init__(self, args, name: str) -> None:
        self.path = args.profile and os.path.join(args.profile, f"{name}.prof")
        self.stats = None

    def refit(self, call):
        """``call()`` (a refit), profiled; kept if it was sparse."""
        if not self.path:
            return call()
        import cProfile
        import pstats

        prof = cProfile.Profile()
        stats = prof.runcall(call)
        if stats.sparse is not None and stats.sparse.used:
            if self.stats is None:
                self.stats = pstats.Stats(prof)
            else:
                self.stats.add(prof)
        return stats

    def save(self) -> None:
        if self.path and self.stats is not None:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self.stats.dump_stats(self.path)


def _plain(s) -> dict:
    sp = s.sparse
    return {"seconds": s.seconds, "sent": s.bytes_sent, "used": sp.used,
            "dense_bytes": sp.dense_bytes, "changed": sp.changed, "elements": sp.elements,
            "detect": sp.detect_seconds, "copy": sp.copy_seconds,
            "encodings": dict(sp.regions_by_encoding)}


def engine(rank, port, args, out):
    jobs = _node(args, "engine")
    torch.set_num_threads(args.threads)
    specs = tensors(args.model, args.layers)
    lays = layouts(specs, "engine")
    served = {n: torch.zeros(lay.local_shape(rank), dtype=torch.bfloat16)
              for n, lay in lays.items()}
    receiver = RefitReceiver(served, lays, rank=rank, port=port, **jobs)
    receiver.refit()
    steps = kinds(args)
    prof, timed = Profiles(args, f"engine-{rank}"), len(args.fractions) * args.repeats * len(steps)
    applied = []  # each refit's decoding and applying on this rank (sparse ones)
    for i in range(timed + 1):
        if i < timed:
            args.barrier.wait()
        lead = i < timed and steps[i % len(steps)] == "lead"
        s = receiver.refit() if lead else prof.refit(receiver.refit)
        applied.append(s.sparse.detect_seconds if s.sparse is not None else 0.0)
    prof.save()
    after_sparse = {n: t.clone() for n, t in served.items()}  # the last was sparse, then
    receiver.refit()  # the same values, dense
    same = all(torch.equal(after_sparse[n].view(torch.int16), t.view(torch.int16))
               for n, t in served.items())
    out.put(("engine", rank, same, applied))


def auto_trainer(rank, ports, args, out):
    """``--auto``: the two senders (a meeting each, at ``ports``), their refits
    alternating (auto's first)."""
    jobs = _node(args, "trainer")
    torch.set_num_threads(args.threads)
    lays = layouts(tensors(args.model, args.layers), "trainer")
    g = torch.Generator().manual_seed(rank)
    params = {n: torch.randn(lay.local_shape(rank), generator=g) * 0.02 for n, lay in lays.items()}
    auto, off = (RefitSender(params, layouts=lays, rank=rank, port=port, sparse=mode, **jobs)
                 for port, mode in zip(ports, ("auto", "off")))
    for sender in (auto, off):
        sender.refit(1)  # the first refit: dense, auto's copy made
    got = []
    for step in range(args.steps):
        row = {}
        change(params, args.auto, g)  # both send the same values: F changed since the last
        for name, sender in (("auto", auto), ("off", off)):
            args.barrier.wait()
            s = sender.refit(step + 2)
            # sparse: compared and encoded for its peers (backing off, auto sends every
            # region dense to every peer, through the same transport)
            row[name] = {"seconds": s.seconds, "sent": s.bytes_sent,
                         "sparse": s.sparse is not None and s.sparse.used
                         and not s.sparse.dense_peers}
        got.append(row)
    for sender in (auto, off):  # the same values through both: the engines must agree
        args.barrier.wait()
        sender.refit(args.steps + 2)
    out.put(("trainer", rank, got, auto.sparse_refits.state_bytes()))


def auto_engine(rank, ports, args, out):
    jobs = _node(args, "engine")
    torch.set_num_threads(args.threads)
    lays = layouts(tensors(args.model, args.layers), "engine")
    served = [{n: torch.zeros(lay.local_shape(rank), dtype=torch.bfloat16)
               for n, lay in lays.items()} for _ in range(2)]
    receivers = [RefitReceiver(t, lays, rank=rank, port=port, **jobs)
                 for port, t in zip(ports, served)]
    for r in receivers:
        r.refit()
    for _ in range(args.steps + 1):
        for r in receivers:
            args.barrier.wait()
            r.refit()
    same = all(torch.equal(served[0][n].view(torch.int16), served[1][n].view(torch.int16))
               for n in served[0])
    out.put(("engine", rank, same, None))


def run_auto(args) -> dict:
    got = _launch(args, auto_trainer, auto_engine, (free_port(), free_port()))
    return {"trainers": {r: rows for side, r, rows, _ in got if side == "trainer"},
            "state_bytes": {r: b for side, r, _, b in got if side == "trainer"},
            "engine_same": all(same for side, _, same, _ in got if side == "engine")}


def auto_table(result: dict, args) -> str:
    rows = list(result["trainers"].values())
    lines = ["| step | auto s | off s | ratio | auto bytes / off bytes | auto went |",
             "|---|---|---|---|---|---|"]
    tot_a = tot_o = 0.0
    for k in range(args.steps):
        a = max(r[k]["auto"]["seconds"] for r in rows)
        o = max(r[k]["off"]["seconds"] for r in rows)
        sa, so = (sum(r[k][n]["sent"] for r in rows) for n in ("auto", "off"))
        went = "sparse" if any(r[k]["auto"]["sparse"] for r in rows) else "dense (backing off)"
        tot_a, tot_o = tot_a + a, tot_o + o
        lines.append(f"| {k + 2} | {a:.3f} | {o:.3f} | {a / o:.2f}x | {sa / so:.4f}x | {went} |")
    lines.append(f"| all | {tot_a:.3f} | {tot_o:.3f} | {tot_a / tot_o:.2f}x | | |")
    return "\n".join(lines)


def run(args) -> dict:
    args.nodes = None
    if not args.link_mbit:
        return _run(args)
    from reshard.tools.netns import EmulatedCluster

    with EmulatedCluster(2, rate_mbit=args.link_mbit) as cluster:
        args.nodes, args.host = [cluster.ns_name(0), cluster.ns_name(1)], cluster.node_addr(0)
        return _run(args)


def _launch(args, trainer_fn, engine_fn, port) -> list:
    """The two trainer and two engine ranks, forked; what each put in the queue."""
    ctx = mp.get_context("fork")
    out, args.barrier = ctx.Queue(), ctx.Barrier(4)
    jobs = [ctx.Process(target=f, args=(r, port, args, out)) for f in (trainer_fn, engine_fn)
            for r in (0, 1)]
    for p in jobs:
        p.start()
    got = [out.get(timeout=3600) for _ in jobs]
    for p in jobs:
        p.join(60)
    return got


def _run(args) -> dict:
    got = _launch(args, trainer, engine, free_port())
    trainers = {r: rows for side, r, rows, _ in got if side == "trainer"}
    return {"trainers": trainers, "state_bytes": {r: b for side, r, _, b in got
                                                  if side == "trainer"},
            "engine_same": all(same for side, _, same, _ in got if side == "engine"),
            "applied": [a for side, _, _, a in got if side == "engine"]}


def table(result: dict, args) -> str:
    lines = ["| changed | sparse bytes | dense bytes | bytes ratio | sparse s | dense s | "
             "time ratio | detect s | apply s | copy s | encodings (regions) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    per_rank = list(result["trainers"].values())
    at, sparse_at = len(kinds(args)), kinds(args).index("sparse")
    for i, fraction in enumerate(args.fractions):
        def col(kind, key, agg=sum, rows=per_rank, i=i):
            return [agg(r[i][1][kind][j][key] for r in rows) for j in range(args.repeats)]
        sp_bytes, de_bytes = col("sparse", "sent")[-1], col("dense", "sent")[-1]
        sp_s = statistics.median(col("sparse", "seconds", max))
        de_s = statistics.median([a - b for a, b in zip(col("dense", "seconds", max),
                                                         col("dense", "copy", max))])
        detect = statistics.median(col("sparse", "detect", max))
        apply = statistics.median(  # the slower engine rank's, each sparse refit
            max(a[at * (i * args.repeats + j) + sparse_at] for a in result["applied"])
            for j in range(args.repeats))
        copy = statistics.median(col("dense", "copy", max))
        enc: dict[str, int] = {}
        for r in per_rank:
            for k, v in r[i][1]["sparse"][-1]["encodings"].items():
                enc[k] = enc.get(k, 0) + v
        lines.append(f"| {fraction:.1%} | {sp_bytes / 1e6:,.2f} MB | {de_bytes / 1e6:,.1f} MB | "
                     f"{sp_bytes / de_bytes:.3f}x | {sp_s:.3f} | {de_s:.3f} | "
                     f"{sp_s / de_s:.2f}x | {detect:.3f} | {apply:.3f} | {copy:.3f} | "
                     f"{', '.join(f'{k} {v}' for k, v in sorted(enc.items()))} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b", choices=sorted(MODELS))
    ap.add_argument("--layers", type=int, default=None, help="decoder layers kept")
    ap.add_argument("--fractions", default="0.001,0.01,0.05,0.2,0.5,1")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--link-mbit", type=float, default=None, help="trainer and engine on "
                    "two emulated nodes joined by a link of this rate (needs root)")
    ap.add_argument("--after-dense", action="store_true", help="no untimed sparse refit "
                    "before each timed one: it follows a dense refit")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", default=None, help="a folder: each process's cProfile "
                    "stats written there")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (4 "
                    "processes share the host: more than its cores oversubscribe it)")
    ap.add_argument("--auto", type=float, default=None, help="sparse='auto' against "
                    "sparse='off' over --steps refits at this fraction changed (loopback)")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    args.fractions = [float(x) for x in args.fractions.split(",")]
    t0 = time.perf_counter()
    if args.auto is not None:
        args.nodes = None
        result = run_auto(args)
        print(f"{args.model}: sparse='auto' against 'off', {args.steps} refits at "
              f"{args.auto:.1%} changed each, loopback; {time.perf_counter() - t0:.0f} s")
        print(auto_table(result, args))
        print(f"auto's copy (state) bytes per rank: {result['state_bytes']}; the engine's "
              f"weights from auto equal to those from off: {result['engine_same']}")
        return
    result = run(args)
    specs = tensors(args.model, args.layers)
    numel = sum(torch.Size(s).numel() for s, _ in specs.values())
    wire = f"{args.link_mbit:g} Mbit/s between two emulated nodes" if args.link_mbit else "loopback"
    print(f"{args.model}, {len(specs)} tensors, {numel / 1e6:.1f} M elements "
          f"({numel * 2 / 1e6:.0f} MB in bf16); trainer 2 ranks fp32 -> engine TP2 bf16; "
          f"{args.repeats} repeats, medians; {time.perf_counter() - t0:.0f} s in all; wire: "
          f"{wire}")
    print(table(result, args))
    print(f"trainer copy (state) bytes per rank: {result['state_bytes']}; engine after the "
          f"last sparse refit equal to a dense refit's: {result['engine_same']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "barrier"},
                       **result}, f)


if __name__ == "__main__":
    main()

"""Sparse refits on the device (issue 39): are they exact there, and does the change
detection cost less than the bytes it spares?

* ``check_sparse_threads``: the real sparse transport (``Executor.sparse_runner``: the
  copies, the encodings, the messages, the receivers' apply) on 8 thread ranks whose
  tensors are on the device, a tiny Qwen3-shaped plan from float32 trainer shards (tp4)
  to bfloat16 engine ranks (tp2, dp2): a first refit dense (it makes the copies), then
  about 1 % of every source changed and a sparse refit; every engine tensor must equal,
  bit for bit, what a dense refit of the same sources writes, and the sparse one must
  have sent fewer bytes than dense, in sparse encodings.
* ``measure_sparse_detection``: one trainer rank's detection, as the sparse runner runs
  it on a device (the region cast into a scratch buffer, then ``codec.encode`` against
  the copy, which it updates; on the host the fused native pass instead), on a float32
  region of 512 MiB of bfloat16 (8 with ``--quick``)
  at 0.1 %, 1 % and 5 % changed; timed against the dense sender's own work on the same
  region (the cast into the copy it sends from), and as the speed of the wire that
  carries the region dense in the same time: on any slower link the detection costs
  less than the bytes it spares (issue 39's "detection alone <= the dense transfer's
  floor"). Exact: the copy afterwards equals the cast of the new values, and the
  payload decoded into the old values gives them too (a mismatch fails the check).
"""

from __future__ import annotations

import argparse
import time
import zlib

import torch

import reshard as R
from reshard._transport import sparse as codec
from reshard._transport.sparse_copies import Copies
from reshard.executor import Executor
from reshard.sim.models import PRESETS, model_from_config
from reshard.sim.specs import ParallelSpec, model_layouts
from reshard.tools.synthetic import fill_local
from reshard.topology import Topology

from .results import ERROR, FAIL, PASS, Check, one_line
from .timing import sync, time_median

NAME = "sparse change detection, float32 -> bfloat16"
FRACTIONS = (0.001, 0.01, 0.05)


def _flip(t: torch.Tensor, fraction: float, seed: int) -> int:
    """Negate about ``fraction`` of ``t``'s elements in place (each one's bits change:
    the sign bit flips, also of a zero); how many."""
    g = torch.Generator(device=t.device).manual_seed(seed)
    pick = torch.rand(t.shape, generator=g, device=t.device) < fraction
    t[pick] = -t[pick]
    return int(pick.sum())


def check_sparse_threads(device: str, load_inproc) -> tuple[str, str]:
    """See the module's doc; ``load_inproc``: the thread-rank helper's loader."""
    model = model_from_config(PRESETS["tiny-qwen3"], name="tiny-qwen3")
    s, d = ParallelSpec.parse("tp4"), ParallelSpec.parse("tp2,dp2")
    plan = R.plan(model_layouts(model.tensors, s, dtype="float32"),
                  model_layouts(model.tensors, d, first_rank=s.world_size, dtype="bfloat16"),
                  allow_cast=True)
    receivers = set(range(s.world_size, s.world_size + d.world_size))

    def rank_fn(comm):
        r = comm.rank
        src = {t.name: fill_local(t.src, r).to(device) for t in plan.tensors
               if r in t.src.rank_set}

        def zeros():
            return {t.name: torch.zeros(t.dst.local_shape(r), dtype=torch.bfloat16,
                                        device=device)
                    for t in plan.tensors if r in t.dst.rank_set}

        ex = Executor(plan, comm, method="reshard", topology=Topology.uniform(4))
        runner = ex.sparse_runner(Copies())
        got = zeros()
        runner.run(src, got, sparse_to=set(), base=None)  # dense: the copies made
        comm.barrier()
        runner.copies.commit(1)
        # the same elements of a tensor's replicas (the norms), as a trainer's stay equal
        whole = {t.name for t in plan.tensors
                 if r in t.src.rank_set and tuple(t.src.shape) == t.src.local_shape(r)}
        changed = sum(_flip(t, 0.01, zlib.crc32(name.encode()) + (0 if name in whole else r))
                      for name, t in src.items())
        stats = runner.run(src, got, sparse_to=receivers, base=1)
        comm.barrier()
        dense = zeros()
        ex.run(src, dense, check=False)
        same = all(torch.equal(got[n].view(torch.int16), dense[n].view(torch.int16))
                   for n in got)
        return same, changed, stats

    results = load_inproc().run_ranks(s.world_size + d.world_size, rank_fn)
    failed = [(r, got) for r, (ok, got) in enumerate(results) if not ok]
    if failed:
        return ERROR, f"rank {failed[0][0]}: {one_line(failed[0][1])}"
    outs = [got for _, got in results]
    wrong = [r for r, (same, _, _) in enumerate(outs) if not same]
    senders = [st for r, (_, _, st) in enumerate(outs) if r < s.world_size]
    wire, dense = sum(st.wire_sent for st in senders), sum(st.dense_bytes for st in senders)
    kinds: dict[str, int] = {}
    for st in senders:
        for kind, n in st.regions_by_encoding.items():
            kinds[kind] = kinds.get(kind, 0) + n
    changed = sum(c for r, (_, c, _) in enumerate(outs) if r < s.world_size)
    detail = (f"tp4 float32 -> tp2,dp2 bfloat16, {changed} source elements changed: sparse "
              f"sent {wire:,} bytes for {dense:,} dense ({wire / max(dense, 1):.3f}x), "
              f"encodings {kinds}")
    if wrong:
        return FAIL, f"engine ranks {wrong} differ from a dense refit's; {detail}"
    if not wire < dense or set(kinds) <= {"dense"}:
        return FAIL, f"the sparse refit did not go sparse; {detail}"
    return PASS, f"every engine tensor equal to a dense refit's, bit for bit; {detail}"


def _detect(src: torch.Tensor, copy: torch.Tensor, scratch: torch.Tensor,
            mask: torch.Tensor, work: dict) -> codec.Encoded:
    """One region's detection as the sparse runner runs it (``_encode_copy``; ``work``:
    its scratch buffers, kept from one call to the next as the runner keeps them)."""
    def lend(dtype: torch.dtype, n: int) -> torch.Tensor:
        buf = work.get(dtype)
        if buf is None or buf.numel() < n:
            buf = work[dtype] = torch.empty(n, dtype=dtype, device=src.device)
        return buf[:n]

    enc = codec.encode_fused(src, copy, lend)
    if enc is None:  # a device: cast into scratch, then the scans
        scratch.view(src.shape).copy_(src)
        enc = codec.encode(scratch, copy, mask=mask, update=True)
    return enc


def _exact(src: torch.Tensor, copy: torch.Tensor, old: torch.Tensor, enc: codec.Encoded,
           flipped: int) -> bool:
    """The copy holds the cast of the new values, the payload decoded into the old ones
    gives them too, and it counted every flipped element."""
    want = src.to(torch.bfloat16).view(-1).view(torch.int16)
    region = old.clone()
    if enc.kind == codec.DENSE:
        region.copy_(enc.values.view(-1))
    elif enc.count:
        payload = torch.empty(enc.nbytes, dtype=torch.uint8, device=old.device)
        codec.write_payload(enc, payload)  # as the message body carries it
        codec.decode_into(region, enc.kind, region.numel(), enc.count, payload)
    return (enc.count == flipped and torch.equal(copy.view(torch.int16), want)
            and torch.equal(region.view(torch.int16), want))


def measure_sparse_detection(args: argparse.Namespace) -> Check:
    """See the module's doc."""
    n = (8 if args.quick else 512) << 19  # bfloat16 MiB
    g = torch.Generator(device=args.device).manual_seed(0)
    base = torch.randn(n // 1024, 1024, generator=g, device=args.device) * 0.02
    src = base.clone()
    copy = torch.empty(n, dtype=torch.bfloat16, device=args.device)
    scratch = torch.empty_like(copy)
    mask = torch.empty(n, dtype=torch.bool, device=args.device)
    dense_s = time_median(lambda: copy.view(src.shape).copy_(src), args.device, args.repeats)
    parts, wrong, work = [], [], {}
    for fraction in FRACTIONS:
        times = []
        for rep in range(args.repeats + 1):  # the first one checked, not timed
            src.copy_(base)
            copy.view(src.shape).copy_(src)
            old = copy.clone() if rep == 0 else None
            flipped = _flip(src, fraction, rep)
            sync(args.device)
            t0 = time.perf_counter()
            enc = _detect(src, copy, scratch, mask, work)
            sync(args.device)
            if old is None:
                times.append(time.perf_counter() - t0)
            elif not _exact(src, copy, old, enc, flipped):
                wrong.append(f"{fraction:.1%}")
        seconds = sorted(times)[len(times) // 2]
        parts.append(f"{fraction:.1%}: {seconds * 1e3:.2f} ms "
                     f"({seconds / dense_s:.2f}x the dense cast, "
                     f"as fast as a wire of {n * 2 / seconds / 1e9:.0f} GB/s carries the "
                     "region dense)")
    detail = (f"{n / 1e6:.0f} M float32 values against their bfloat16 copy; the dense "
              f"sender's cast into its copy {dense_s * 1e3:.2f} ms; " + "; ".join(parts))
    if wrong:
        return Check(NAME, FAIL, f"not exact at {', '.join(wrong)}; {detail}", dense_s)
    return Check(NAME, PASS, detail, dense_s)

"""The refit into FP8 engine tensors, across real processes: 3 trainer ranks (a
``RefitSender`` each, bf16/fp32 shards shaped like FSDP2 rows, TP columns and the q, k,
v of Megatron's fused QKV interleaved by query group) and 2 inference ranks (a
``RefitReceiver`` with ``quant=BlockFormat((128, 128))`` and FP8 targets plus their
``_scale_inv`` scale targets) meet at a TCP store like two jobs. Every trainer rank
quantizes only its own rows after the amax exchange among the trainer ranks; each
receiver gets FP8 codes and scale rows. The parent checks every receiver's bytes and
scales bit for bit against the reference quantizer of the full tensor (which no rank
builds), for two refits, plain and UE8M0 scales; and that an engine split vLLM would
refuse is refused at the meeting, by name, on every rank of both jobs."""

from __future__ import annotations

from datetime import timedelta
from functools import cache
from math import prod

import pytest
import torch
from tests.multiproc.test_fp8_amax import _local, values

import reshard as R
from reshard.quant import BlockFormat, quantize_reference
from reshard.quant.blocks import plan_fp8, scale_layout
from reshard.quant.targets import scale_name
from reshard.refit import RefitReceiver, RefitSender
from reshard.tools.launch import free_port, run_processes

pytestmark = pytest.mark.multiproc

T, I = 3, 2  # noqa: E741
BLOCK = (128, 128)
STEPS = (1, 2)
SPARSE_STEPS = (1, 2, 3)  # step 3: step 2 with a.weight's first rows scaled (their amax)
SCALED_ROWS = 8


def _rows(cuts, ncols, dtype):
    return R.Layout.explicit((cuts[-1], ncols), {
        i: ((b - a, ncols), [((a, 0), (b - a, ncols), (0, 0))])
        for i, (a, b) in enumerate(zip(cuts, cuts[1:]))}, dtype)


def _megatron(part, groups=3, q_rows=96, kv_rows=32, hidden=200):
    """q, k or v of Megatron's fused QKV over TP = 3 (one query group a rank): each
    rank's local tensor is its group's [q, k, v] rows, the part at its offset."""
    rows_of = {"q": q_rows, "k": kv_rows, "v": kv_rows}[part]
    before = {"q": 0, "k": q_rows, "v": q_rows + kv_rows}[part]
    fused = q_rows + 2 * kv_rows
    views = {g: ((fused, hidden), [((g * rows_of, 0), (rows_of, hidden), (before, 0))])
             for g in range(groups)}
    return R.Layout.explicit((groups * rows_of, hidden), views, "bfloat16")


def trainer_layouts() -> dict[str, R.Layout]:
    mesh = R.Mesh(list(range(T)))
    return {
        # FSDP2-like rows cut mid-block: block row 0 on all three ranks; ragged both ways
        "a.weight": _rows([0, 60, 120, 300], 256, "bfloat16"),
        # FSDP2 Shard(0) (86, 86, 84 rows): each block row on two ranks; ragged columns
        "b.weight": R.Layout((256, 300), mesh, [R.Shard(0)], "float32"),
        # TP columns (130 each): block columns 0, 1 and 2 on two ranks each
        "o.weight": R.Layout((256, 390), mesh, [R.Shard(1)], "bfloat16"),
        **{f"{p}.weight": _megatron(p) for p in "qkv"},
        "norm.weight": R.Layout((200,), mesh, [R.Replicate()], "float32"),
    }


def engine_layouts(bad: bool = False) -> dict[str, R.Layout]:
    """TP2 splits on block boundaries (what vLLM loads), q/k/v replicated, norm in fp32;
    ``bad``: ``b.weight``'s 300 columns split 150 + 150, which vLLM refuses (150 is not
    a multiple of 128)."""
    mesh = R.Mesh(list(range(I)))
    fp8 = "float8_e4m3fn"
    out = {"a.weight": R.Layout((300, 256), mesh, [R.Shard(1)], fp8),
           "b.weight": R.Layout((256, 300), mesh, [R.Shard(1 if bad else 0)], fp8),
           "o.weight": R.Layout((256, 390), mesh, [R.Shard(0)], fp8),
           **{f"{p}.weight": R.Layout(shape, mesh, [R.Replicate()], fp8)
              for p, shape in (("q", (288, 200)), ("k", (96, 200)), ("v", (96, 200)))},
           "norm.weight": R.Layout((200,), mesh, [R.Replicate()], "float32")}
    for name in [n for n, lay in out.items() if lay.dtype == fp8]:
        out[scale_name(name)] = scale_layout(out[name], BLOCK)
    return out


def _full(name: str, layout: R.Layout, step: int) -> torch.Tensor:
    """The whole tensor (only the parent and the replicated norm's holders build it)."""
    shape = layout.shape if len(layout.shape) == 2 else (1, *layout.shape)
    full = values((0, 0), shape, _seed(name, min(step, 2)), getattr(torch, layout.dtype))
    if step == 3 and name == "a.weight":
        full[:SCALED_ROWS] *= 1.25
    return full.view(layout.shape)


def _own(name: str, layout: R.Layout, rank: int, step: int) -> torch.Tensor:
    if len(layout.shape) == 1:
        return _full(name, layout, step)
    local = _local(layout, rank, _seed(name, min(step, 2)))
    if step == 3 and name == "a.weight" and rank == 0:  # rank 0 holds rows 0-59
        local[:SCALED_ROWS] *= 1.25
    return local


def _seed(name: str, step: int) -> int:
    return sorted(trainer_layouts()).index(name) * 10 + step


def _meet(rank, port, fmt, bad=False, sparse="off"):
    opts = dict(host="127.0.0.1", port=port, trainer_size=T, inference_size=I,
                timeout=timedelta(seconds=60))
    if rank < T:
        layouts = trainer_layouts()
        params = {n: _own(n, lay, rank, 0) for n, lay in layouts.items()}
        return RefitSender(params, layouts=layouts, rank=rank, sparse=sparse, **opts), params
    layouts = engine_layouts(bad)
    targets = {n: torch.zeros(lay.local_shape(rank - T), dtype=getattr(torch, lay.dtype))
               for n, lay in layouts.items()}
    return RefitReceiver(targets, layouts, rank=rank - T, quant=fmt, **opts), targets


def _refits(rank, port, fmt, sparse="off", steps=STEPS):
    side, tensors = _meet(rank, port, fmt, sparse=sparse)
    out = []
    for step in steps:
        if rank < T:
            for n, lay in trainer_layouts().items():
                tensors[n].copy_(_own(n, lay, rank, step))
            stats = side.refit(step)
            out.append({"sent": stats.bytes_sent, "amax": stats.amax_bytes,
                        "sparse": stats.sparse})
        else:
            stats = side.refit()
            out.append({"received": stats.bytes_received, "version": stats.version,
                        "bytes": {n: t.view(torch.uint8).numpy().copy()
                                  for n, t in tensors.items()}})
    side.comm.close()
    return out


def _refused(rank, port):
    try:
        _meet(rank, port, BlockFormat(BLOCK), bad=True)
    except R.ReshardError as e:
        return (type(e).__name__, isinstance(e, R.MappingError), str(e))
    return None


def _bad_source(rank, port):
    """Trainer rank 1 hands in a quantized tensor of the wrong shape: refused by the
    pre-send check on every rank of both jobs; a good refit still follows."""
    side, tensors = _meet(rank, port, BlockFormat(BLOCK))
    good = tensors.get("o.weight")
    if rank == 1:
        tensors["o.weight"] = good[:, :-1]
    try:
        side.refit(1) if rank < T else side.refit()
        out = None
    except R.ReshardError as e:
        out = (type(e).__name__, str(e))
    if rank == 1:
        tensors["o.weight"] = good
    again = side.refit(1) if rank < T else side.refit()
    side.comm.close()
    return out, again.version


def _job(rank, _world, ports):
    return {"plain": _refits(rank, ports[0], BlockFormat(BLOCK)),
            "ue8m0": _refits(rank, ports[1], BlockFormat(BLOCK, ue8m0=True)),
            "refused": _refused(rank, ports[2]), "bad_source": _bad_source(rank, ports[3]),
            "sparse": _refits(rank, ports[4], BlockFormat(BLOCK), "on", SPARSE_STEPS)}


@pytest.fixture(scope="module")
def results():
    return run_processes(_job, T + I, [free_port() for _ in range(5)], init=False,
                         timeout=240)


@cache
def _reference(name: str, step: int, fmt: BlockFormat):
    """The full tensor of refit ``step``, and its reference quantization."""
    full = _full(name, trainer_layouts()[name], step)
    return full, (quantize_reference(full, fmt) if full.dim() == 2 else None)


def _expected(rank: int, step: int, fmt: BlockFormat) -> dict[str, torch.Tensor]:
    """What engine rank ``rank`` must hold after refit ``step``, from the full tensors."""
    engine, out = engine_layouts(), {}
    for name in trainer_layouts():
        full, quantized = _reference(name, step, fmt)
        if engine[name].dtype != "float8_e4m3fn":
            out[name] = engine[name].shard(full, rank)
            continue
        q, scale = quantized
        out[name] = engine[name].shard(q.view(torch.uint8), rank)
        out[scale_name(name)] = engine[scale_name(name)].shard(scale, rank)
    return {n: t.contiguous().view(torch.uint8) for n, t in out.items()}


@pytest.mark.parametrize("kind", ["plain", "ue8m0", "sparse"])
def test_engine_ranks_get_the_reference_fp8_codes_and_scales(results, kind):
    fmt = BlockFormat(BLOCK, ue8m0=kind == "ue8m0")
    for engine_rank, res in enumerate(results[T:]):
        for step, got in zip(SPARSE_STEPS if kind == "sparse" else STEPS, res[kind]):
            assert got["version"] == step
            want = _expected(engine_rank, step, fmt)
            assert sorted(got["bytes"]) == sorted(want)
            for name, w in want.items():
                assert torch.equal(torch.from_numpy(got["bytes"][name]), w), (kind, step, name)


def test_fp8_bytes_and_the_amax_exchange_are_counted(results):
    plan = plan_fp8({n: lay for n, lay in trainer_layouts().items() if n != "norm.weight"},
                    BlockFormat(BLOCK))
    # blocks on three sources (a's first block row), on two (b, o, q)
    assert max(len(s.ranks) for t in plan.tensors for s in t.shared) == 3
    assert all(s["amax"] == plan.exchange_bytes > 0 for r in results[:T] for s in r["plain"])
    engine = engine_layouts()
    for engine_rank, res in enumerate(results[T:]):
        # FP8 codes 1 B an element, scales and the fp32 norm 4 B: nothing else arrives
        want = sum(prod(lay.local_shape(engine_rank)) * lay.itemsize for lay in engine.values())
        assert [s["received"] for s in res["plain"]] == [want, want]
    sent = sum(s["plain"][0]["sent"] for s in results[:T])
    assert sent == sum(s["plain"][0]["received"] for s in results[T:])


def test_a_split_vllm_refuses_is_refused_at_the_meeting_on_every_rank(results):
    refusals = [r["refused"] for r in results]
    assert all(r is not None and r[:2] == ("Fp8BlockError", True) for r in refusals), refusals
    assert all("'b.weight'" in r[2] and "engine rank 0" in r[2] and "150" in r[2]
               for r in refusals), refusals


def test_a_bad_source_tensor_is_refused_on_every_rank_before_quantizing(results):
    for (kind, message), version in (r["bad_source"] for r in results):
        assert kind == "TensorMismatchError" and version == 1
        assert message.startswith("rank 1: source tensor 'o.weight' has local shape "
                                  "[256, 129], its layout says [256, 130]"), message
        assert message.endswith("nothing was moved")


def test_sparse_fp8_refits_send_only_the_changed_codes_and_scales(results):
    """``sparse="on"`` into FP8 engine tensors: after the first (dense) refit each trainer
    rank compares the FP8 codes and scales it quantized with those it sent; step 3
    scales a.weight's first rows on trainer rank 0 (their blocks' amax, so their scales
    and every code of those blocks change): only they travel, exactly (checked above)."""
    first, second, third = zip(*(r["sparse"] for r in results[:T]))
    assert all(s["sparse"].used is False for s in first)  # no copy to diff against yet
    assert all(s["sparse"].used for s in second + third)
    dense = sum(s["sent"] for s in first)
    assert sum(s["sent"] for s in third) < 0.1 * dense
    assert third[0]["sparse"].changed > 0  # rank 0's rows changed
    assert third[1]["sparse"].changed == third[2]["sparse"].changed == 0
    # the copy: the FP8 codes and scales (and the fp32 norm) this rank sends, as sent
    assert all(s["sparse"].state_bytes > 0 for s in third)

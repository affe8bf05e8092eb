"""The encodings of a sparse refit: one region's changed elements, exactly, in the
fewest bytes (private; :mod:`reshard.refit.sparse` sends them).

A region is compared bit for bit (as integers of its element width: ``-0.0`` differs
from ``0.0``, a NaN equals itself) with what was sent for it at the last committed
version; what travels is the changed elements' absolute values, never arithmetic
deltas, so nothing can drift. Four exact encodings, the cheapest by bytes chosen per
region (``n`` elements of ``itemsize`` bytes, ``m`` of them changed):

* ``dense``: every element, ``n * itemsize``;
* ``bitmap``: one bit per element, then the changed values, ``ceil(n / 8) + m * itemsize``;
* ``offsets32``: sorted int32 flat offsets, then the values, ``m * (4 + itemsize)``;
* ``offsets16``: the same with 16-bit offsets, for a region of at most 65,536 elements,
  ``m * (2 + itemsize)``.

Each part starts 8-byte aligned within a region's payload (so values can be viewed in
place); ``payload_nbytes`` counts that.

On the host a region whose source is rows of contiguous elements (float32 into
bfloat16, or of the engine's own dtype) is cast, compared, and its changes found and
written into the copy in one native pass (:func:`encode_fused`,
:mod:`reshard._transport.native`); otherwise (or with no C compiler) the scans over a
whole region (compare, count, positions, bits) run in numpy,
whose kernels for them are 3-10x torch's on one CPU thread; on an accelerator they stay
in torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from reshard._transport import native

__all__ = ["DENSE", "ENCODINGS", "Encoded", "apply", "cheapest", "decode", "decode_into",
           "diff", "encode", "encode_fused", "payload_nbytes", "positions"]

DENSE, BITMAP, OFFSETS32, OFFSETS16 = 0, 1, 2, 3
ENCODINGS = ("dense", "bitmap", "offsets32", "offsets16")
_ALIGN = 8
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


_SPARSE_SMALL = (OFFSETS16, OFFSETS32, BITMAP)  # in the order a tie goes to (dense first)
_SPARSE_LARGE = (OFFSETS32, BITMAP)  # over 65,536 elements: no 16-bit offsets


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _index_nbytes(kind: int, n: int, m: int) -> int:
    if kind == OFFSETS16:
        return 2 * m
    if kind == OFFSETS32:
        return 4 * m
    return -(-n // 8) if kind == BITMAP else 0


def payload_nbytes(kind: int, n: int, m: int, itemsize: int) -> int:
    """Bytes of one region's payload in ``kind`` (its index part padded to 8)."""
    if kind == DENSE:
        return n * itemsize
    if m == 0:
        return 0
    return _aligned(_index_nbytes(kind, n, m)) + m * itemsize


def cheapest(n: int, m: int, itemsize: int, *, sparse: bool = True) -> int:
    """The encoding of fewest payload bytes (dense on a tie; dense only if not
    ``sparse``)."""
    if not sparse:
        return DENSE
    best, fewest = DENSE, n * itemsize  # the first of the fewest, dense first
    for kind in _SPARSE_SMALL if n <= 1 << 16 else _SPARSE_LARGE:
        nbytes = payload_nbytes(kind, n, m, itemsize)
        if nbytes < fewest:
            best, fewest = kind, nbytes
    return best


@dataclass
class Encoded:
    """One region, encoded: ``parts`` laid end to end (each 8-aligned) are its payload;
    ``index``: the flat positions of the changed elements, int64 (None for dense, and
    from :func:`encode_fused`, whose positions are only in the payload), ``values``
    their values."""

    kind: int
    count: int  # changed elements (dense: the region's whole size)
    nbytes: int
    parts: list[torch.Tensor]  # uint8
    index: torch.Tensor | None
    values: torch.Tensor


def changed(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Which elements of two flat tensors of one dtype differ, bit for bit."""
    mask = torch.empty(new.shape, dtype=torch.bool, device=new.device)
    diff(new, old, mask)
    return mask


def diff(new: torch.Tensor, old: torch.Tensor, mask: torch.Tensor) -> int:
    """Mark in ``mask`` (bool, ``new``'s shape) which elements of ``new`` and ``old`` (one
    dtype and shape, any strides) differ bit for bit; return how many do."""
    width = _INT[new.element_size()]
    a, b = new.view(width), old.view(width)
    if new.device.type == "cpu":
        out = mask.numpy()
        np.not_equal(a.numpy(), b.numpy(), out=out)
        return int(np.count_nonzero(out))
    torch.ne(a, b, out=mask)
    return int(torch.count_nonzero(mask))


def positions(mask: torch.Tensor) -> torch.Tensor:
    """The flat (row-major) positions of a contiguous bool tensor's set elements, int64."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    return mask.view(-1).nonzero().view(-1)


def encode(new: torch.Tensor, old: torch.Tensor, *, sparse: bool = True,
           mask: torch.Tensor | None = None, update: bool = False) -> Encoded:
    """``new`` against ``old`` (flat, contiguous, one dtype): the cheapest encoding.
    ``mask``: a bool buffer of at least ``new``'s size to work in; ``update``: make
    ``old`` equal ``new`` (then a dense region's values are ``old`` itself)."""
    n, itemsize = new.numel(), new.element_size()
    mask = torch.empty(n, dtype=torch.bool, device=new.device) if mask is None else mask[:n]
    m = diff(new, old, mask)
    kind = cheapest(n, m, itemsize, sparse=sparse)
    if kind == DENSE:
        if update:
            old.copy_(new)
            new = old
        return Encoded(DENSE, m, n * itemsize, [_bytes(new)], None, new)
    if m == 0:
        return Encoded(kind, 0, 0, [], torch.empty(0, dtype=torch.int64, device=new.device),
                       new[:0])
    if new.device.type == "cpu":
        index, values, head = _found_on_host(new, old, mask, kind, update, m)
    else:
        index = positions(mask)
        values = new[index]
        head = pack_bits(mask) if kind == BITMAP else _bytes(
            index.to(torch.int32 if kind == OFFSETS32 else torch.int16))
        if update:
            old.copy_(new) if kind == BITMAP else old.index_put_((index,), values)
    return Encoded(kind, m, payload_nbytes(kind, n, m, itemsize), [head, _bytes(values)],
                   index, values)


def encode_fused(src: torch.Tensor, old: torch.Tensor,
                 scratch: Callable[[torch.dtype, int], torch.Tensor]) -> Encoded | None:
    """:func:`encode` with ``update``, from the region's source itself: ``src`` (any
    shape, rows of contiguous elements: a slice of a row-major tensor's rows or columns,
    or of a 3-D tensor's middle dimension; float32 into a bfloat16 ``old``, or ``old``'s
    own dtype) cast, compared with ``old`` (flat) and its changes written into it in one native pass
    (:func:`reshard._transport.native.diff`). ``scratch(dtype, n)`` lends work buffers (read
    here only). None, with nothing done, where that pass does not run (no compiler, a
    source of other strides, another cast): the caller casts and calls :func:`encode`."""
    if not native.supports(src, old):
        return None
    n = old.numel()
    values, pos = scratch(old.dtype, n), scratch(torch.int32, _cap(n))
    bits = scratch(torch.uint8, (n + 7) // 8)
    m = native.diff(src, old, values, pos, bits)
    return _fused(src, old, m, values, pos, bits, owned=False)


def encode_fused_many(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[Encoded]:
    """:func:`encode_fused` of many ``(src, old)`` pairs, each one :func:`reshard.
    _transport.native.supports`, in one native call: the buffers are one batch's, fresh
    (only the pages the changes are written to are touched), and the encodings keep
    views of them rather than copies."""
    sizes = [old.numel() for _, old in pairs]
    dtype = pairs[0][1].dtype
    values = torch.empty(sum(-(-n // 32) * 32 for n in sizes), dtype=dtype)
    pos = torch.empty(sum(_cap(n) for n in sizes), dtype=torch.int32)
    bits = torch.empty(sum((n + 7) // 8 + 8 for n in sizes), dtype=torch.uint8)
    width = values.element_size()
    at_v, at_p, at_b = values.data_ptr(), pos.data_ptr(), bits.data_ptr()
    rows, starts, v, p, b = [], [], 0, 0, 0  # a region's share of each buffer, by address
    for (src, old), n in zip(pairs, sizes):
        assert old.dtype == dtype, (old.dtype, dtype)  # the caller groups them
        rows.append(native.diff_row_at(src, old, at_v + v * width, at_p + 4 * p, _cap(n),
                                       at_b + b))
        starts.append((v, p, b))
        v, p, b = v + -(-n // 32) * 32, p + _cap(n), b + (n + 7) // 8 + 8
    counts = native.diff_rows(rows)
    return [_fused(src, old, m, values, pos, bits, owned=True, at=start)
            for (src, old), m, start in zip(pairs, counts, starts)]


def _cap(n: int) -> int:
    """Positions a fused pass keeps: with more changed than this, a bitmap or dense is
    cheaper than offsets."""
    return n // 16 + 8


def _fused(src: torch.Tensor, old: torch.Tensor, m: int, values: torch.Tensor,
           pos: torch.Tensor, bits: torch.Tensor, *, owned: bool,
           at: tuple[int, int, int] = (0, 0, 0)) -> Encoded:
    """A fused pass's outcome (its count ``m``, ``values``, ``pos``, ``bits``, the region's
    from ``at`` in each: a batch's buffers are cut only where an encoding keeps them) as
    an encoding; ``owned``: the buffers are the encoding's to keep (else scratch, copied)."""
    n, itemsize = old.numel(), old.element_size()
    if m < 0:  # a NaN: torch's own cast (its NaN differs between its loops), sent whole
        old.view(src.shape).copy_(src)
        return Encoded(DENSE, n, n * itemsize, [_bytes(old)], None, old)
    kind = cheapest(n, m, itemsize)
    if kind == DENSE:
        return Encoded(DENSE, m, n * itemsize, [_bytes(old)], None, old)
    if m == 0:
        return Encoded(kind, 0, 0, [], torch.empty(0, dtype=torch.int64), old[:0])
    v, p, b = at
    values = values[v:v + m] if owned else values[:m].clone()
    if kind == BITMAP and m > _cap(n):  # the pass set every change's bit
        head = bits[b:b + (n + 7) // 8] if owned else bits[:(n + 7) // 8].clone()
    elif kind == BITMAP:  # a few too many for offsets: the bits from the positions
        mask = np.zeros(n, dtype=np.bool_)
        mask[pos[p:p + m].numpy()] = True
        head = torch.from_numpy(np.packbits(mask, bitorder="little"))
    elif owned and kind == OFFSETS32:  # the positions as they are
        head = _bytes(pos[p:p + m])
    else:
        assert m <= _cap(n), (m, _cap(n), n)
        head = _offsets(pos[p:p + m].numpy(), kind)  # a copy, in the offsets' width
    return Encoded(kind, m, payload_nbytes(kind, n, m, itemsize), [head, _bytes(values)],
                   None, values)


def _found_on_host(new: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, kind: int,
                   update: bool, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``m`` changed elements' positions, values and index part, in numpy (its gather
    and scatter by position are about twice torch's advanced indexing on one CPU thread);
    ``update``: written into ``old``. With few changes the positions are read off the
    packed mask (:func:`_set_bits`), else found by ``flatnonzero``."""
    width = _INT[new.element_size()]
    now, bools = new.view(width).numpy(), mask.numpy()
    few = m <= FEW_CHANGED * bools.size
    packed = np.packbits(bools, bitorder="little") if few or kind == BITMAP else None
    where = _set_bits(packed) if few else np.flatnonzero(bools)
    values = now[where]
    head = torch.from_numpy(packed) if kind == BITMAP else _offsets(where, kind)
    if update:
        if kind == BITMAP:
            old.copy_(new)
        else:
            old.view(width).numpy()[where] = values
    return torch.from_numpy(where), torch.from_numpy(values).view(new.dtype), head


def _offsets(where: np.ndarray, kind: int) -> torch.Tensor:
    """The index part of an offsets encoding: positions as int32 or 16-bit, as bytes."""
    return torch.from_numpy(where.astype(np.int32 if kind == OFFSETS32 else np.int16)
                            ).view(torch.uint8)


FEW_CHANGED = 1 / 32
"""At most this fraction of a region changed, its changes' positions are read off its
packed mask: one bit an element, packed at about 0.06 ns an element, then only the
bytes with a bit set are visited (:func:`_set_bits`); numpy's ``flatnonzero`` scans
every element of the mask (about 0.35 ns an element on one core). Measured on one
thread: at 0.1% changed 0.13 against 0.33 ns an element, at 1% 0.27 against 0.39, at
2.1% 0.33 against 0.46, even at 5%."""
_BIT_COUNT = np.array([bin(v).count("1") for v in range(256)], dtype=np.int64)
_BIT_START = np.concatenate([[0], np.cumsum(_BIT_COUNT)[:-1]])
_BIT_AT = np.array([b for v in range(256) for b in range(8) if v >> b & 1], dtype=np.int64)


def _set_bits(packed: np.ndarray) -> np.ndarray:
    """The positions, ascending (int64), of the set bits of :func:`pack_bits`'s bytes
    (element ``i`` at bit ``i % 8`` of byte ``i // 8``): each nonzero byte's bits from a
    table of the 256 bytes' set bits."""
    at = np.flatnonzero(packed != 0)
    byte = packed[at]
    count = _BIT_COUNT[byte]
    ends = np.cumsum(count)
    total = int(ends[-1]) if len(ends) else 0
    k = np.repeat(_BIT_START[byte] - (ends - count), count)  # this byte's bits in _BIT_AT
    k += np.arange(total)
    out = np.repeat(at << 3, count)
    out += _BIT_AT[k]
    return out


def write_payloads(encs: list[Encoded], offsets: list[int], body: torch.Tensor) -> None:
    """:func:`write_payload` of each ``encs[i]`` at ``body[offsets[i]:]``: on the host, every
    part in one native call."""
    if body.device.type != "cpu" or native.library() is None:
        for enc, off in zip(encs, offsets):
            write_payload(enc, body[off:off + enc.nbytes])
        return
    assert body.is_contiguous() and body.dtype == torch.uint8
    base, rows = body.data_ptr(), []
    for enc, off in zip(encs, offsets):
        pos = 0
        for part in enc.parts:
            pos = _aligned(pos)
            if part.dtype == torch.uint8 and part.is_contiguous() and part.device == body.device:
                rows.append((base + off + pos, part.data_ptr(), part.numel()))
            else:  # not bytes laid flat: torch's copy
                body[off + pos:off + pos + part.numel()].copy_(part)
            pos += part.numel()
        assert pos <= enc.nbytes, (pos, enc.nbytes)
    native.copy_many(rows)


def write_payload(enc: Encoded, out: torch.Tensor) -> None:
    """Lay ``enc``'s parts into ``out`` (uint8, ``enc.nbytes`` long)."""
    if enc.nbytes == 0:  # nothing changed: no payload
        return
    pos = 0
    for part in enc.parts:
        pos = _aligned(pos)
        out[pos:pos + part.numel()].copy_(part)
        pos += part.numel()


def decode(kind: int, n: int, m: int, payload: torch.Tensor, dtype: torch.dtype
           ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(flat positions or None for dense, values)`` of one region's payload."""
    itemsize = dtype.itemsize
    if kind == DENSE:
        return None, payload[:n * itemsize].view(dtype)
    if m == 0:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=dtype)
    head = _index_nbytes(kind, n, m)
    start = _aligned(head)
    values = payload[start:start + m * itemsize].view(dtype)
    if kind == BITMAP:
        index = positions(unpack_bits(payload[:head], n))
    elif kind == OFFSETS32:
        index = payload[:head].view(torch.int32).to(torch.int64)
    else:
        index = payload[:head].view(torch.int16).to(torch.int64) & 0xFFFF
    return index, values


def decode_into(region: torch.Tensor, kind: int, n: int, m: int, payload: torch.Tensor
                ) -> bool:
    """:func:`decode` then :func:`apply` into ``region`` (a view, any strides; its dtype
    the payload's). On the host a sparse payload is written in one native pass
    (:func:`reshard._transport.native.apply_row_at`) where the region is rows of contiguous
    elements; False if the payload does not fit its header (positions outside the
    region, more bits set than ``m``, or fewer): the region is then not to be trusted."""
    return decode_into_many([(region, kind, n, m, payload)])[0]


def decode_into_many(items: list[tuple[torch.Tensor, int, int, int, torch.Tensor]]
                     ) -> list[bool]:
    """:func:`decode_into` of many ``(region, kind, n, m, payload)``, the sparse payloads
    the native pass writes in one call (:func:`reshard._transport.native.apply_rows`)."""
    rows, at, ok = [], [], [True] * len(items)
    for j, (region, kind, n, m, payload) in enumerate(items):
        if kind == DENSE or not m or payload.device.type != "cpu" or not (
                payload.is_contiguous() and payload.dtype == torch.uint8):
            continue
        start = _aligned(_index_nbytes(kind, n, m))
        if payload.numel() < start + m * region.element_size():  # cut short: never read
            ok[j] = False
            continue
        base = payload.data_ptr()  # the parts by address: no tensor cut a region
        row = native.apply_row_at(region, kind, base, m, base + start)
        if row is not None:
            rows.append(row)
            at.append(j)
    native_done = dict(zip(at, native.apply_rows(rows))) if rows else {}
    rest = {}  # the others, decoded (torch / numpy), applied once checked
    for j, (region, kind, n, m, payload) in enumerate(items):
        done = native_done.get(j)
        if done is not None:
            ok[j] = done == m
        elif ok[j]:
            rest[j] = decode(kind, n, m, payload, region.dtype)
    fits = _fit(rest, items)
    for j, (index, values) in rest.items():
        ok[j] = fits[j]
        if ok[j]:
            apply(items[j][0], index, values)
    return ok


def _fit(decoded: dict[int, tuple[torch.Tensor | None, torch.Tensor]],
         items: list[tuple[torch.Tensor, int, int, int, torch.Tensor]]) -> dict[int, bool]:
    """Whether each decoded payload fits its header (``m`` positions and values, every
    position inside the region's ``n``; a dense one, ``n`` values), read in one go (on a
    device, one wait for all of them): a payload that does not is never applied (on a
    device its scatter would stop the process, on the host raise midway)."""
    out, bounds = {}, {}
    for j, (index, values) in decoded.items():
        _, _, n, m, _ = items[j]
        if index is None:
            out[j] = values.numel() == n
        elif index.numel() != m or values.numel() != m:
            out[j] = False
        elif m:
            bounds[j] = torch.stack(torch.aminmax(index))
        else:
            out[j] = True
    if bounds:
        for j, (lo, hi) in zip(bounds, torch.stack(list(bounds.values())).tolist()):
            out[j] = lo >= 0 and hi < items[j][2]
    return out


def apply(region: torch.Tensor, index: torch.Tensor | None, values: torch.Tensor) -> None:
    """Write decoded values into ``region`` (a view, any strides): all of it for dense,
    else the elements at the flat (row-major) positions ``index``."""
    if index is None:
        region.copy_(values.view(region.shape))
        return
    if index.numel() == 0:
        return
    if region.device.type == "cpu":
        _apply_on_host(region, index, values)
    elif region.is_contiguous():
        region.view(-1)[index] = values
    else:
        region.index_put_(_unravel(index, region.shape), values)


def _apply_on_host(region: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """:func:`apply` in numpy: each flat position turned into its place in the region's
    storage (row-major position -> strides), then one scatter."""
    width = _INT[values.element_size()]
    where = index.numpy()
    if region.is_contiguous():
        flat = region.reshape(-1)
    else:
        rest, where = where, np.zeros(len(where), dtype=np.int64)
        for size, stride in zip(reversed(region.shape), reversed(region.stride())):
            rest, here = np.divmod(rest, size)
            where += here * stride
        span = sum((size - 1) * stride for size, stride in zip(region.shape, region.stride()))
        flat = region.as_strided((span + 1,), (1,))
    flat.view(width).numpy()[where] = values.reshape(-1).view(width).numpy()


def _unravel(index: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, ...]:
    out = []
    for size in reversed(shape):
        out.append(index % size)
        index = index // size
    return tuple(reversed(out))


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool vector as bytes, element ``i`` at bit ``i % 8`` of byte ``i // 8``."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.packbits(mask.reshape(-1).numpy(), bitorder="little"))
    n = mask.numel()
    padded = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask
    return (padded.view(-1, 8) * _BITS.to(mask.device)).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` bits of :func:`pack_bits`'s bytes, as a bool vector."""
    if packed.device.type == "cpu":
        bits = np.unpackbits(packed.numpy(), count=n, bitorder="little")
        return torch.from_numpy(bits.view(np.bool_))
    bits = packed.unsqueeze(1) & _BITS.to(packed.device)
    return bits.view(-1)[:n] != 0


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)

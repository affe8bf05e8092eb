"""Native kernels, built for this host at first use.

One C file (``diff.c``): the fused pass of a sparse refit's change detection, the cast
to the engine's dtype, the compare with the sender's copy, the changed elements'
positions, values and bits and the copy's update in one read of the region; and the
receiver's, a region's payload (bitmap or offsets, and values) written in place
(:mod:`reshard._transport.sparse` uses both). No library offers that pass: torch and numpy
run it as five passes over memory, which on a CPU cost more than the wire they save.

The file is compiled with the host's C compiler (``$CC``, else ``cc``, ``gcc`` or
``clang``) for the host's own instructions (``-march=native``) into a cache folder
(``$RESHARD_CACHE_DIR``, else ``$XDG_CACHE_HOME/reshard``, else ``~/.cache/reshard``),
keyed by the source, the compiler and the CPU's flags: about a second, once per host.
Without a compiler, or with ``RESHARD_NATIVE=0``, :func:`library` is None and the
callers take their torch / numpy path (the same results, slower).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

__all__ = ["apply_row_at", "apply_rows", "compiler", "copy_many", "diff", "diff_row_at",
           "diff_rows", "library", "supports"]

log = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("diff.c")
_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c11")
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_INT = ctypes.c_int64
_PTR = ctypes.c_void_p
_SAME = {1: "reshard_diff_u8", 2: "reshard_diff_u16", 4: "reshard_diff_u32"}
_APPLY_WIDTHS = (1, 2, 4)  # element bytes reshard_apply_many writes


def _cache_dir() -> Path:
    if os.environ.get("RESHARD_CACHE_DIR"):
        return Path(os.environ["RESHARD_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "reshard"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return shutil.which(cc)
    return None


def _build() -> ctypes.CDLL | None:
    cc = compiler()
    if cc is None:
        log.info("reshard: no C compiler; sparse refits detect changes in torch/numpy")
        return None
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, cc.encode(), " ".join(_FLAGS).encode(),
                                     _cpu_flags().encode()])).hexdigest()[:16]
    folder = _cache_dir()
    path = folder / f"diff-{key}.so"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)  # then renamed: atomic
        os.close(fd)
        try:
            done = subprocess.run([cc, *_FLAGS, "-o", tmp, str(_SOURCE)], capture_output=True,
                                  text=True, timeout=120)
            if done.returncode != 0:
                log.warning("reshard: compiling %s failed (%s); sparse refits detect "
                            "changes in torch/numpy", _SOURCE.name, done.stderr.strip()[-500:])
                return None
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(path))
    for name in ("reshard_diff_f32_bf16", "reshard_diff_f32_bf16_portable", *_SAME.values()):
        fn = getattr(lib, name)
        fn.restype = _INT
        fn.argtypes = [_PTR, _INT, _INT, _INT, _INT, _INT, _PTR, _PTR, _PTR, _INT, _PTR]
    for name in ("reshard_diff_many", "reshard_apply_many"):
        getattr(lib, name).restype = None
        getattr(lib, name).argtypes = [_PTR, _INT, _PTR]
    lib.reshard_copy_many.restype = None
    lib.reshard_copy_many.argtypes = [_PTR, _INT]
    return lib


def library() -> ctypes.CDLL | None:
    """The kernels, built on first call (None: disabled, or no compiler here)."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            if os.environ.get("RESHARD_NATIVE", "1") != "0" and sys.byteorder == "little":
                try:
                    _lib = _build()
                except (OSError, subprocess.SubprocessError) as e:
                    log.warning("reshard: native kernels unavailable (%s)", e)
            _tried = True
    return _lib


_GEOMETRY: dict[tuple, tuple[int, int, int, int, int] | None] = {}
_GEOMETRIES_KEPT = 1 << 14  # distinct (shape, strides) remembered; a model has a few hundred


def _rows(src: torch.Tensor) -> tuple[int, int, int, int, int] | None:
    """``src`` as rows of contiguous elements: (rows, cols, row stride, inner, outer
    stride), row ``r`` starting at ``(r // inner) * outer stride + (r % inner) * row
    stride`` (rows at one stride, in groups at another: any slice of a row-major
    tensor's rows or columns, or of a 3-D tensor's middle dimension); None when it is not
    (a column of a transposed tensor, a slice gappy at more levels). Worked out once per
    shape and strides (a refit asks it of every region, every time)."""
    key = (src.shape, src.stride())
    got = _GEOMETRY.get(key, key)
    if got is key:
        if len(_GEOMETRY) >= _GEOMETRIES_KEPT:
            _GEOMETRY.clear()
        got = _GEOMETRY[key] = _rows_of(*key)
    return got


def _rows_of(shape: torch.Size, strides: tuple[int, ...]
             ) -> tuple[int, int, int, int, int] | None:
    numel = shape.numel()
    if len(shape) == 0 or numel == 0:
        return 1, numel, 0, 1, 0
    cols = shape[-1]
    if strides[-1] != 1 and cols != 1:
        return None
    levels: list[list[int]] = []  # [size, stride], innermost first, merged where they can
    for size, st in zip(reversed(shape[:-1]), reversed(strides[:-1])):
        if size == 1:
            continue
        if levels and st == levels[-1][1] * levels[-1][0]:
            levels[-1][0] *= size
        else:
            levels.append([size, st])
    if not levels:
        return 1, cols, cols, 1, 0
    if len(levels) == 1:
        (rows, stride), = levels
        return rows, cols, stride, rows, 0
    if len(levels) == 2:
        (inner, stride), (outer, ostride) = levels
        return inner * outer, cols, stride, inner, ostride
    return None


def supports(src: torch.Tensor, old: torch.Tensor) -> bool:
    """Whether :func:`diff` runs on this pair: both on the CPU, ``old`` flat and
    contiguous, of ``src``'s size, fewer than 2**31 elements; ``src`` rows of contiguous
    elements as :func:`_rows` reads them (any slice of rows or of columns of a row-major
    tensor, or of a 3-D tensor's middle dimension), of ``old``'s dtype (1, 2 or 4 bytes
    an element) or float32 into bfloat16."""
    n = old.numel()
    return (src.device.type == "cpu" and old.device.type == "cpu" and old.is_contiguous()
            and src.numel() == n and n < 2**31
            and (src.dtype == old.dtype and old.element_size() in _SAME
                 or (src.dtype, old.dtype) == (torch.float32, torch.bfloat16))
            and _rows(src) is not None and library() is not None)


def diff(src: torch.Tensor, old: torch.Tensor, values: torch.Tensor, pos: torch.Tensor,
         bits: torch.Tensor | None, *, portable: bool = False) -> int:
    """One pass: every element of ``src`` (cast to ``old``'s dtype) that differs bit for
    bit from ``old`` (both in row-major order) has its value written to ``values`` (in
    order), its flat position to ``pos`` (int32, while there is room) and is written
    into ``old``. Once more differ than ``pos`` holds, ``bits`` (uint8; element ``i`` at
    bit ``i % 8`` of byte ``i // 8``) is zeroed and takes every change's bit; with no
    more than ``pos`` holds it is not touched (not zeroed: nothing to pay for where the
    positions are the cheaper encoding). Returns how many differ, or -1 when a float32
    element of ``src`` is a NaN (``old`` is then partly written: the caller rewrites it
    whole).
    Only for pairs :func:`supports`. ``portable``: float32 into bfloat16 by the portable
    C pass even where the host's vector pass (AVX-512) was built (tests compare them)."""
    row = _diff_row(src, old, values, pos, bits)
    name = ("reshard_diff_f32_bf16" + ("_portable" if portable else "") if row[0] == 0
            else _SAME[row[0]])
    return getattr(library(), name)(*row[1:])


def diff_rows(rows: list[tuple[int, ...]]) -> list[int]:
    """:func:`diff` of many regions in one native call, each given as
    :func:`diff_row_at` makes it; each one's count, as :func:`diff` returns it. The
    caller's Python then runs once a batch, not between passes over memory."""
    desc = np.array(rows, dtype=np.int64).reshape(-1, 12)
    out = np.empty(len(rows), dtype=np.int64)
    library().reshard_diff_many(desc.ctypes.data, len(rows), out.ctypes.data)
    return out.tolist()


def _diff_row(src: torch.Tensor, old: torch.Tensor, values: torch.Tensor, pos: torch.Tensor,
              bits: torch.Tensor | None) -> tuple[int, ...]:
    """:func:`diff`'s arguments as ``reshard_diff_many`` reads a region: its kind first
    (0: float32 into bfloat16, else the element width), a missing ``bits`` as 0 (NULL)."""
    n = old.numel()
    assert values.numel() >= n and values.dtype == old.dtype and pos.dtype == torch.int32
    assert bits is None or (bits.numel() >= (n + 7) // 8 and bits.dtype == torch.uint8)
    return diff_row_at(src, old, values.data_ptr(), pos.data_ptr(), pos.numel(),
                       0 if bits is None else bits.data_ptr())


def diff_row_at(src: torch.Tensor, old: torch.Tensor, values: int, pos: int, cap: int,
                bits: int) -> tuple[int, ...]:
    """One region as ``reshard_diff_many`` reads it, its buffers given by address (the
    caller's: room for ``old.numel()`` values of its dtype at ``values``, ``cap`` int32
    at ``pos``, a bit an element at ``bits`` or 0), as a batch's buffers are cut up
    without a tensor a region."""
    return (0 if src.dtype != old.dtype else old.element_size(), src.data_ptr(), *_rows(src),
            old.data_ptr(), values, pos, cap, bits)


def copy_many(rows: list[tuple[int, int, int]]) -> None:
    """``(to, from, bytes)`` copies, by address, in one native call (host memory only;
    the caller keeps both ends alive)."""
    if rows:
        desc = np.array(rows, dtype=np.int64).reshape(-1, 3)
        library().reshard_copy_many(desc.ctypes.data, len(rows))


def apply_row_at(region: torch.Tensor, kind: int, index: int, m: int, values: int
                 ) -> tuple[int, ...] | None:
    """A sparse region's payload as ``reshard_apply_many`` writes it into ``region`` in
    place (any rows of contiguous elements that :func:`_rows` reads): ``kind`` the
    codec's encoding (:mod:`reshard._transport.sparse`): 1 (bitmap), the index part its
    bits; 2 (offsets32), int32 flat positions; 3 (offsets16), 16-bit ones; the index part
    and the ``m`` values (of the region's dtype) given by address (the caller's, in host
    memory, long enough). None where the native pass does not write this region (no
    kernels, another element width, a region of other strides, not on the CPU): the
    caller applies it in torch / numpy."""
    if region.device.type != "cpu" or region.element_size() not in _APPLY_WIDTHS:
        return None
    shape = _rows(region)
    if shape is None or library() is None:
        return None
    return (region.element_size(), region.data_ptr(), *shape, kind, index, m, values)


def apply_rows(rows: list[tuple[int, ...]]) -> list[int]:
    """Regions given as :func:`apply_row_at` makes them, written in one native call: each
    one's count written (a bitmap's set bits), or -1 where a position lies outside its
    region or its bitmap has more than ``m`` bits set."""
    done = np.empty(len(rows), dtype=np.int64)
    if rows:
        desc = np.array(rows, dtype=np.int64)
        library().reshard_apply_many(desc.ctypes.data, len(rows), done.ctypes.data)
    return done.tolist()

"""Sparse refits in the cost model (``reshard simulate --changed F``): a refit after the
first that sends only the engine-dtype values that changed (``docs/sparse.md``).

Assumptions, stated once:

* The changed values are spread at random over every region, each region large (more
  than 65,536 elements: int32 offsets), so a region of ``b``-byte values travels in the
  cheapest of dense (``b`` bytes an element), a bitmap and the values (``1/8 + F b``) or
  offsets and the values (``F (4 + b)``), as :mod:`reshard._transport.sparse` chooses.
  Each tensor at its own engine dtype: an FP8 block engine's codes (one byte: F of the
  codes changed), its float32 scales (F of them changed) and its tensors left in bf16,
  as the sparse refit into FP8 engines compares them (codes and scales bit for bit).
* The sparse transport runs the flat schedule: every region straight from its chosen
  sender (``p2p``'s model, on the encoded bytes).
* Detection streams each region once through memory on its sender:
  :func:`detect_bytes` bytes per engine element (from a float32 source) at
  :data:`DETECT_GBPS`, before the transfer (not overlapped with it). The positions and
  values of the changed elements are not counted (a fraction ``F`` more).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from reshard.errors import ConfigError
from reshard.sim.links import Prediction

__all__ = ["DETECT_BYTES_PER_ELEMENT", "DETECT_GBPS", "detect_bytes", "sparse_prediction",
           "wire_fraction"]


def detect_bytes(itemsize: int) -> int:
    """Bytes a detection pass streams per engine element of ``itemsize`` bytes: read the
    float32 source (4), cast or quantize it into a scratch buffer (``itemsize``), read
    that and the kept copy (twice ``itemsize``), write a bool mask (1)."""
    return 5 + 3 * itemsize


DETECT_BYTES_PER_ELEMENT = detect_bytes(2)
"""A bf16 engine's: 11."""
DETECT_GBPS = 1500.0
"""One GPU streaming short elementwise passes: about half an H100's 3.35 TB/s of HBM."""


def wire_fraction(changed: float, itemsize: int | np.ndarray) -> float | np.ndarray:
    """Expected wire bytes of a large region against dense, ``changed`` of its
    ``itemsize``-byte values changed at random (elementwise for an array of sizes)."""
    if not 0.0 <= changed <= 1.0:
        raise ConfigError(f"changed must be a fraction in [0, 1], got {changed}")
    b = np.asarray(itemsize, dtype=np.float64)
    out = np.minimum(np.minimum(1.0, 1 / (8 * b) + changed), changed * (4 + b) / b)
    return float(out) if out.ndim == 0 else out


def sparse_prediction(pairs: tuple[np.ndarray, np.ndarray, np.ndarray], changed: float,
                      itemsizes: np.ndarray, p2p: Callable[[tuple], Prediction]) -> Prediction:
    """The ``sparse`` row: ``p2p`` (the flat schedule's model) of the plan's rank pairs
    with their bytes scaled to the encoded ones (``itemsizes``: each pair's engine
    element size), after the slowest sender's detection."""
    src, dst, nbytes = pairs
    fraction = wire_fraction(changed, itemsizes)
    encoded = nbytes * fraction
    moved = p2p((src, dst, encoded))
    streamed = nbytes / itemsizes * detect_bytes(itemsizes) if len(src) else np.zeros(1)
    per_sender = np.bincount(src, streamed) if len(src) else np.zeros(1)
    detect = float(per_sender.max()) / (DETECT_GBPS * 1e9)
    total = float(nbytes.sum()) if len(src) else 0.0
    stages = {**moved.stages, "detect": detect, "changed": changed,
              "wire_fraction": float(encoded.sum()) / total if total else 0.0}
    return Prediction("sparse", moved.seconds + detect, moved.bottleneck, moved.link,
                      moved.rank, moved.lower_bound_s, stages, moved.loads)

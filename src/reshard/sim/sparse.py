"""Sparse refits in the cost model (``reshard simulate --changed F``): a refit after the
first that sends only the engine-dtype values that changed (``docs/sparse.md``).

Assumptions, stated once:

* The changed values are spread at random over every region, each region large (more
  than 65,536 elements: int32 offsets), so a region travels in the cheapest of dense
  (``b`` bytes an element), a bitmap and the values (``1/8 + F b``) or offsets and the
  values (``F (4 + b)``), as :mod:`reshard._transport.sparse` chooses.
* The sparse transport runs the flat schedule: every region straight from its chosen
  sender (``p2p``'s model, on the encoded bytes).
* Detection streams each region once through memory on its sender:
  :data:`DETECT_BYTES_PER_ELEMENT` bytes per engine-dtype element at
  :data:`DETECT_GBPS`, before the transfer (not overlapped with it). The positions and
  values of the changed elements are not counted (a fraction ``F`` more).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from reshard.errors import ConfigError
from reshard.sim.links import Prediction

__all__ = ["DETECT_BYTES_PER_ELEMENT", "DETECT_GBPS", "sparse_prediction", "wire_fraction"]

DETECT_BYTES_PER_ELEMENT = 11
"""Read the fp32 source (4), cast into a scratch buffer (2), read it and the kept copy
(2 + 2), write a bool mask (1)."""
DETECT_GBPS = 1500.0
"""One GPU streaming short elementwise passes: about half an H100's 3.35 TB/s of HBM."""


def wire_fraction(changed: float, itemsize: int) -> float:
    """Expected wire bytes of a large region against dense, ``changed`` of its
    ``itemsize``-byte values changed at random."""
    if not 0.0 <= changed <= 1.0:
        raise ConfigError(f"changed must be a fraction in [0, 1], got {changed}")
    return min(1.0, 1 / (8 * itemsize) + changed, changed * (4 + itemsize) / itemsize)


def sparse_prediction(pairs: tuple[np.ndarray, np.ndarray, np.ndarray], changed: float,
                      itemsize: int, p2p: Callable[[tuple], Prediction]) -> Prediction:
    """The ``sparse`` row: ``p2p`` (the flat schedule's model) of the plan's rank pairs
    with their bytes scaled to the encoded ones, after the slowest sender's detection."""
    src, dst, nbytes = pairs
    fraction = wire_fraction(changed, itemsize)
    moved = p2p((src, dst, nbytes * fraction))
    per_sender = np.bincount(src, nbytes) if len(src) else np.zeros(1)
    detect = float(per_sender.max()) / itemsize * DETECT_BYTES_PER_ELEMENT / (DETECT_GBPS * 1e9)
    stages = {**moved.stages, "detect": detect, "changed": changed, "wire_fraction": fraction}
    return Prediction("sparse", moved.seconds + detect, moved.bottleneck, moved.link,
                      moved.rank, moved.lower_bound_s, stages, moved.loads)

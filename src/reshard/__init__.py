"""reshard: move model weights between two distributed layouts, sending each
destination only the bytes it needs.

The doors, from the simplest:

* :func:`redistribute` -- one collective call: a DTensor (or a ``{name: DTensor}``
  model) onto another device mesh and placements;
* :func:`plan` -> :class:`Executor` -- plan once (torch-free), run many times;
* :class:`RefitSender` / :class:`RefitReceiver` -- the RL refit between a trainer job
  and an inference job (:mod:`reshard.refit`), with vLLM and Hugging Face glue in
  :mod:`reshard.integrations`.

``import reshard`` loads no torch: the layout algebra and the planner are plain Python;
the names that need ``torch.distributed`` load on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from reshard.errors import (
    AuthError,
    ClusterError,
    ConfigError,
    FingerprintMismatchError,
    LayoutError,
    MappingError,
    PlanError,
    ReshardError,
    TensorMismatchError,
    TransferError,
)
from reshard.layout import Layout
from reshard.local import execute_local
from reshard.mesh import Mesh
from reshard.pieces import LocalView, Piece
from reshard.placement import Replicate, Shard, StridedShard
from reshard.planner import Plan, plan
from reshard.stats import PlanStats
from reshard.tensor_plan import TensorPlan, Transfer

if TYPE_CHECKING:
    from reshard.dtensor import redistribute
    from reshard.executor import Executor, RunStats, execute
    from reshard.gate import new_token
    from reshard.refit import RefitReceiver, RefitSender, RefitStats

#: Names that need torch.distributed, loaded on first use: name -> module.
_LAZY = {
    "redistribute": "reshard.dtensor",
    "Executor": "reshard.executor",
    "RunStats": "reshard.executor",
    "execute": "reshard.executor",
    "RefitSender": "reshard.refit",
    "RefitReceiver": "reshard.refit",
    "RefitStats": "reshard.refit",
    "new_token": "reshard.gate",
}

__all__ = [
    "AuthError", "ClusterError", "ConfigError", "Executor", "FingerprintMismatchError", "Layout",
    "LayoutError", "LocalView", "MappingError", "Mesh", "Piece", "Plan", "PlanError",
    "PlanStats", "RefitReceiver", "RefitSender", "RefitStats", "Replicate", "ReshardError",
    "RunStats", "Shard", "StridedShard", "TensorMismatchError", "TensorPlan", "Transfer",
    "TransferError", "execute", "execute_local", "new_token", "plan",
    "redistribute",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'reshard' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

"""reshard: move model weights between two distributed layouts, sending each
destination only the bytes it needs."""

from .errors import (
    FingerprintMismatchError,
    LayoutError,
    PlanError,
    ReshardError,
    TensorMismatchError,
    TransferError,
)
from .layout import Layout, LocalView, Piece
from .local import execute_local
from .mesh import Mesh
from .placement import Replicate, Shard, StridedShard
from .plan import Plan, TensorPlan, Transfer, plan
from .stats import PlanStats

__all__ = [
    "FingerprintMismatchError", "Layout", "LayoutError", "LocalView", "Mesh", "Piece", "Plan",
    "PlanError", "PlanStats", "Replicate", "ReshardError", "Shard", "StridedShard",
    "TensorMismatchError", "TensorPlan", "Transfer", "TransferError", "execute_local", "plan",
]
__version__ = "0.1.0"

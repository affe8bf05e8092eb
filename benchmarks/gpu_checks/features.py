"""Probe: the torch features the library uses, present or missing on the torch installed
there (the GPU machine may have an older torch than the pinned one), and every reshard
module imported."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from .results import ERROR, PASS, SKIPPED, Check, run_check


def _lookup(path: str) -> Any:
    """The object at ``module:attr.attr`` (the module is imported), or None."""
    module, _, attrs = path.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for name in filter(None, attrs.split(".")):
            obj = getattr(obj, name)
    except (ImportError, AttributeError):
        return None
    return obj


def _has(path: str) -> bool:
    return _lookup(path) is not None


def _takes(path: str, *params: str) -> bool:
    """Whether the callable at ``path`` exists and accepts every keyword in ``params``."""
    obj = _lookup(path)
    return obj is not None and set(params) <= set(inspect.signature(obj).parameters)


def _takes_only_self(path: str) -> bool:
    """Whether the pybind method at ``path`` exists and takes no argument but ``self``
    (read from its docstring's signature line: pybind methods have no ``inspect``
    signature)."""
    first = (getattr(_lookup(path), "__doc__", None) or "").split("\n", 1)[0]
    match = re.match(r"\w+\((.*)\) ->", first)
    return match is not None and "," not in match.group(1)


#: (feature, what in reshard uses it, probe)
FEATURES: tuple[tuple[str, str, Callable[[], bool]], ...] = (
    ("torch.distributed", "every executor", dist.is_available),
    ("NCCL built in", "NCCL groups", lambda: dist.is_available() and dist.is_nccl_available()),
    ("P2POp(group_peer=)", "Comm.exchange on a registered NCCL group",
     lambda: _takes("torch.distributed:P2POp", "group_peer")),
    ("ProcessGroupNCCL._start_coalescing()/_end_coalescing() (no device argument)",
     "Comm.exchange on a stateless NCCL group",
     lambda: all(map(_takes_only_self, ("torch.distributed:ProcessGroupNCCL._start_coalescing",
                                        "torch.distributed:ProcessGroupNCCL._end_coalescing")))),
    ("ProcessGroupGloo", "stateless gloo groups (Comm.from_store)",
     lambda: _has("torch.distributed:ProcessGroupGloo")),
    ("DTensor.from_local(shape=, stride=)", "reshard.tools.bench, reshard.dtensor",
     lambda: _takes("torch.distributed.tensor:DTensor.from_local", "shape", "stride")),
    ("_StridedShard", "reshard.dtensor",
     lambda: _has("torch.distributed.tensor.placement_types:_StridedShard")),
    ("DTensorSpec, TensorMeta", "reshard.dtensor",
     lambda: all(map(_has, ("torch.distributed.tensor._dtensor_spec:DTensorSpec",
                            "torch.distributed.tensor._dtensor_spec:TensorMeta")))),
    ("torch.float8_e4m3fn", "fp8 layouts", lambda: _has("torch:float8_e4m3fn")),
    ("reduce_tensor / rebuild_cuda_tensor", "the colocated transport on CUDA (CUDA IPC)",
     lambda: all(map(_has, ("torch.multiprocessing.reductions:reduce_tensor",
                            "torch.multiprocessing.reductions:rebuild_cuda_tensor")))),
    ("UntypedStorage._share_fd_cpu_", "the colocated transport on the host",
     lambda: _has("torch:UntypedStorage._share_fd_cpu_")),
)

#: reshard modules imported, with the optional package each needs beyond torch, if any
MODULES = (("reshard.executor", None), ("reshard.dtensor", None), ("reshard.refit", None),
           ("reshard.refit.elastic", None), ("reshard.integrations.hf", None),
           ("reshard.integrations.vllm", "vllm"), ("reshard.tools.cli", None),
           ("reshard.tools.bench", None))


def torch_features() -> list[Check]:
    """The torch features the library uses, present or missing, and every module imported
    (an import error there is what the library needs from a newer torch)."""
    out = [run_check(f"torch: {name}", lambda probe=probe, used=used: (
        (PASS, f"used by {used}") if probe() else (ERROR, f"missing; used by {used}")))
        for name, used, probe in FEATURES]
    out += [run_check(f"import {m}", lambda m=m, needs=needs: _import(m, needs))
            for m, needs in MODULES]
    return out


def _import(module: str, needs: str | None) -> tuple[str, str]:
    if needs is not None and importlib.util.find_spec(needs) is None:
        return SKIPPED, f"needs {needs}, not installed here"
    importlib.import_module(module)
    return PASS, "imported"

"""The machine the check runs on: whether there is a device to measure, and the
versions of Python, torch, CUDA, NCCL and the packages the test files use."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch


def device_available(device: str) -> bool:
    """Whether ``device`` ("cuda" or "cpu") can be measured here."""
    return device == "cpu" or torch.cuda.is_available()


def no_device_line() -> str:
    """The one line printed where there is no CUDA device."""
    return f"gpu_check: no CUDA device here (torch {torch.__version__}); nothing to measure"


def is_cuda(device: str) -> bool:
    return torch.device(device).type == "cuda"


def environment(device: str) -> dict[str, Any]:
    """Python, torch, the device and the packages the test files use."""
    env: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "platform": platform.platform(),
        "cpus": os.cpu_count(), "device": device}
    if is_cuda(device):
        props = torch.cuda.get_device_properties(torch.device(device))
        env.update(device_name=props.name, capability=f"{props.major}.{props.minor}",
                   device_memory_bytes=props.total_memory, nccl=_nccl_version())
    else:
        env["device_name"] = platform.processor() or platform.machine()
    env["packages"] = {name: _version(name) for name in
                       ("numpy", "pytest", "hypothesis", "transformers", "rich", "matplotlib")}
    return env


def _nccl_version() -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except Exception:
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None

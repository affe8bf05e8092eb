"""A stand-in for ``sgl_kernel`` (SGLang's kernels; no CPU wheel on PyPI) for the CPU
harness (``reshard.tools.sglang_cpu``). SGLang's CPU engine imports several of its names
at start; on a tiny dense model it calls one, ``assign_req_to_token_pool_cpu``, written
here in torch. Any other raises ``NotImplementedError`` when called, naming itself."""

from __future__ import annotations

from typing import Any


def assign_req_to_token_pool_cpu(req_pool_indices: Any, req_to_token: Any, start_offset: Any,
                                 end_offset: Any, out_cache_loc: Any, max_len: int) -> None:
    """Request ``i``'s token slots ``[start_i, end_i)`` get the next ``end_i - start_i``
    cache locations of ``out_cache_loc`` (requests in order)."""
    pos = 0
    for i in range(req_pool_indices.numel()):
        start, end = int(start_offset[i]), int(end_offset[i])
        req_to_token[int(req_pool_indices[i]), start:end] = out_cache_loc[pos:pos + end - start]
        pos += end - start


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"sgl_kernel.{name} has no CPU stand-in in reshard's "
                                  "SGLang CPU harness")

    missing.__name__ = name
    return missing

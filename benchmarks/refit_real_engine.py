"""The vLLM side of ``benchmarks/refit_real.py``: a worker extension (reshard's, plus the
``bench_*`` methods below) through which one engine is refitted by every method.

* ``bench_gb_*``: gather-and-broadcast as RL frameworks run it against vLLM (vLLM's own
  ``nccl`` backend, here over gloo): packed buckets broadcast from trainer rank 0 to every
  worker, unpacked with vLLM's ``unpack_tensor`` and loaded with ``model.load_weights``
  inside vLLM's layerwise reload (``initialize_layerwise_reload`` ...
  ``finalize_layerwise_reload``), as ``NCCLWeightTransferEngine`` does.
* ``bench_disk_reload``: vLLM's own ``reload_weights`` from safetensors files.
* ``bench_floor``: the bare exchange of the bytes this rank needs, over reshard's group.
* ``bench_fingerprint``: a digest of everything the forward reads (parameters as held,
  and the packed CPU GEMMs through their outputs on a fixed input): two engines hold the
  same weights exactly when the digests are equal.
* ``bench_mem_start`` / ``bench_mem_peak``: resident memory and its peak (``VmHWM``).
"""

from __future__ import annotations

import time
import zlib
from pathlib import Path
from typing import Any

import torch

from benchtools import profiled
from refit_real_models import nbytes, packed_buckets
from reshard.integrations.vllm import ReshardWorkerExtension
from reshard.integrations.vllm.internals import (
    has_own_lm_head,
    logical_params,
    reset_moe_kernels,
)
from reshard.integrations.vllm.memory import reset_peak_rss, return_freed_memory, rss_bytes


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


class BenchExtension(ReshardWorkerExtension):
    """ReshardWorkerExtension plus the benchmark's other methods and checks."""

    def bench_mem_start(self) -> int:
        return_freed_memory()
        reset_peak_rss()
        self._bench_rss0 = rss_bytes()
        return self._bench_rss0

    def bench_mem_peak(self) -> int:
        return rss_bytes("VmHWM") - self._bench_rss0

    # -- gather-and-broadcast ------------------------------------------------------------
    def bench_gb_init(self, host: str, port: int, meta: list, bucket_bytes: int) -> int:
        from reshard.comm import Comm

        world = 1 + self.vllm_config.parallel_config.world_size
        self._gb = Comm.from_store(host, port, 1 + self.rank, world)
        self._gb_meta = [(n, list(s), d) for n, s, d in meta]
        self._gb_buckets = packed_buckets(self._gb_meta, bucket_bytes)
        return len(self._gb_buckets)

    def bench_gb_refit(self) -> dict[str, Any]:
        import torch.distributed as dist
        from vllm.config import set_current_vllm_config
        from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model = self.model_runner.get_model()
        t0, received, load_s = time.perf_counter(), 0, 0.0
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            reset_moe_kernels(model)  # see bench_disk_reload
            initialize_layerwise_reload(model)
            for idx in self._gb_buckets:
                names, shapes, dtypes = zip(*(self._gb_meta[i] for i in idx))
                sizes = [nbytes(s, d) for s, d in zip(shapes, dtypes)]
                packed = torch.empty(sum(sizes), dtype=torch.uint8)
                opts = dist.BroadcastOptions()
                opts.rootRank = 0
                self._gb.pg.broadcast([packed], opts).wait()
                received += packed.numel()
                t1 = time.perf_counter()
                model.load_weights(unpack_tensor(packed, list(names), [list(s) for s in shapes],
                                                 [getattr(torch, d) for d in dtypes], sizes))
                load_s += time.perf_counter() - t1
                del packed
            t1 = time.perf_counter()
            finalize_layerwise_reload(model, self.vllm_config.model_config)
            load_s += time.perf_counter() - t1
        return_freed_memory()  # the buckets and the reload's copies: back to the host
        return {"seconds": time.perf_counter() - t0, "bytes_received": received,
                "load_seconds": load_s}

    def bench_gb_close(self) -> None:
        self._gb.close()
        self._gb = None

    # -- checkpoint to disk and reload ---------------------------------------------------
    def bench_disk_reload(self, directory: str) -> dict[str, Any]:
        from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

        files = sorted(str(p) for p in Path(directory).glob("*.safetensors"))
        t0 = time.perf_counter()
        # vLLM 0.32 CPU redoes the experts' pad + prepack only on a first load
        # (``moe_kernel is None``): without this, every later reload leaves them unpacked
        # under a kernel that reads them packed (reshard's commit does the same)
        reset_moe_kernels(self.model_runner.get_model())
        self.reload_weights(weights_iterator=safetensors_weights_iterator(files, False))
        return_freed_memory()  # the reload's transient copies: back to the host
        return {"seconds": time.perf_counter() - t0,
                "bytes_received": sum(Path(f).stat().st_size for f in files)}

    def bench_profile_refit(self, top: int = 30) -> str:
        """One reshard refit under cProfile: the top functions by cumulative time."""
        return profiled(self._reshard_state().refit, top)

    # -- the floor -----------------------------------------------------------------------
    def bench_floor(self) -> dict[str, Any]:
        """One bare exchange over reshard's group (collective with the trainer ranks'
        floor): exactly the bytes of the plan, per rank pair, as ``reshard bench``."""
        from reshard.tools.bench import floor_runner

        state = self._reshard_state()
        receiver = state.receiver
        if getattr(self, "_bench_floor", None) is None:
            # the floor runs after reshard's last refit and check: the logical buffers
            # (this rank's shard) give way to the floor's own receive buffers (the same
            # bytes), so a model near the host's memory runs it as it ran reshard
            state.buffers.clear()
            receiver.targets, receiver.shadow = {}, {}
            for ex in receiver.executors:  # their staging arenas
                ex.release()
            return_freed_memory()
            self._bench_floor = floor_runner(receiver.meeting.plan, receiver.comm)
        t0 = time.perf_counter()
        self._bench_floor()
        return {"seconds": time.perf_counter() - t0}

    def bench_floor_close(self) -> None:
        self._bench_floor = None

    # -- the check -----------------------------------------------------------------------
    @torch.no_grad()
    def bench_fingerprint(self) -> dict[str, int]:
        """name -> CRC-32 of every non-empty parameter as held, and of every packed CPU
        GEMM's output on one fixed input (its weight is empty once packed); an embedding
        beside an LM head of its own is only looked up, so its packed copy is skipped."""
        model = self.model_runner.get_model()
        where = logical_params(model)
        unread = ("VocabParallelEmbedding",) if has_own_lm_head(model) else ()
        gen = torch.Generator().manual_seed(0)
        out = {}
        for mname, module in model.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                if p.numel():
                    out[f"{mname}.{pname}"] = _crc(p)
            shape = where.get(f"{mname}.weight", (None, None, (), None))[2]
            if (callable(getattr(module, "cpu_linear", None)) and len(shape) == 2
                    and type(module).__name__ not in unread):
                x = torch.randn(3, shape[1], generator=gen).to(self.vllm_config.model_config.dtype)
                out[f"{mname} (packed GEMM)"] = _crc(module.cpu_linear(x, module.weight, None))
        return out

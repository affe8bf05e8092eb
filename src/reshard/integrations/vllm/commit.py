"""The commit half of one vLLM rank's refit (:class:`Commit`, mixed into
:class:`~reshard.integrations.vllm.state.ReshardState`): the received logical buffers
made live, or prepared beside the serving engine and swapped in between two forward
passes.

Commit of the buffered parameters. vLLM CPU's packed GEMMs (unquantized linear
layers and LM heads: most of the bytes) are processed in place: each module is lent
its buffer and reruns vLLM's own ``process_weights_after_loading`` (the GEMM
packing; the old packed copy is dropped first), then gets its own parameters back,
one module at a time (``kernels.process_in_place``); an embedding beside an
LM head of its own is written in place and its packed GEMM copy, which nothing
reads, is not remade. vLLM CPU's unquantized MoE experts are prepacked by vLLM's own
kernel straight from their buffers into the live expert weights (padded first where
the kernel pads; ``kernels.prepack_experts``): nothing of the layer is
replaced, and no second copy of the experts exists. The rest goes through vLLM's
layerwise reload:
``initialize_layerwise_reload`` puts each layer back in checkpoint format (on the
meta device); each logical buffer is copied whole into its parameter through the
layer's deferred loader; when a layer is complete vLLM materializes it, reruns
``process_weights_after_loading`` (CPU GEMM packing, MoE pad + prepack) and copies
the result into the original kernel tensors; layers written in place are put back as
they are; ``finalize_layerwise_reload`` finishes. CPU MoE work-around, for the
experts that go this way (zentorch's, or with biases): vLLM 0.32 reruns the CPU
experts' pad + prepack only on a first load (``quant_method.moe_kernel is None``), so
that attribute is reset, on the modules reloaded, before every commit.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from reshard.errors import MappingError
from reshard.integrations.vllm.internals import (
    quiet_reload,
    reset_moe_kernels,
    restore_loaders,
    snapshot_loaders,
    unread_packed_copies,
)
from reshard.integrations.vllm.kernels import (
    prepack_experts,
    process_in_place,
    stand_in,
    take_over,
)
from reshard.integrations.vllm.memory import HeapBound, return_freed_memory, rss_bytes

__all__ = ["Commit", "converted"]


def _copy_into(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """The loader a commit uses: the buffer already is this rank's logical tensor."""
    param.data.copy_(loaded_weight)


def converted(how: str, logical: torch.Tensor) -> torch.Tensor:
    """What vLLM's loader computes from a checkpoint tensor (see ``CONVERSIONS``)."""
    if how == "neg_exp":  # Mamba: A = -exp(A_log), in float32
        return -torch.exp(logical.float())
    raise MappingError(f"unknown conversion {how!r}")


def _converting_loader(how: str) -> Any:
    """The commit's loader for a converted parameter."""
    def copy_converted(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        param.data.copy_(converted(how, loaded_weight))
    return copy_converted


class Commit:
    """The commit of :class:`~reshard.integrations.vllm.state.ReshardState`: its
    methods read what the state set up at the meeting (``where``, ``buffers``,
    ``direct``, ``experts``, ``aliases``, ``derived``, ``own_storage``, ``mapping``)."""

    @torch.no_grad()
    def prepare(self) -> float:
        """After ``receive(go_live=False)``, beside the serving engine (the background
        thread of an overlapped refit): run vLLM's processing of the packed GEMMs
        (:attr:`direct`) on stand-ins of their modules -- copies that share nothing
        the engine reads -- so that :meth:`swap` only hands each module its new packed
        copy. Costs, until the swap, one more packed copy of those modules (about what
        the rank received of them). Returns the seconds it took."""
        from vllm.config import set_current_vllm_config

        t0 = time.perf_counter()
        self.prepared = {}
        unread = unread_packed_copies(self.model)
        with set_current_vllm_config(self.vllm_config):
            for mname, names in self.direct.items():
                module = self.model.get_submodule(mname) if mname else self.model
                if type(module).__name__ in unread:
                    continue  # written in place at the swap
                standin = stand_in(module, list(self.own_storage.values()))
                process_in_place(standin, {self.where[n][1]: self.buffers[n] for n in names})
                self.prepared[mname] = standin
                for name in names:  # a tied tensor's other holders pack the new weight too
                    for alias, attr in self.aliases.get(name, []):
                        holder = self.model.get_submodule(alias)
                        if type(holder).__name__ in unread:
                            continue
                        other = stand_in(holder)
                        other._parameters[attr] = standin._parameters[self.where[name][1]]
                        process_in_place(other, {})
                        self.prepared[alias] = other
        self.prepare_seconds = time.perf_counter() - t0
        return self.prepare_seconds

    def swap(self) -> float:
        """Make the version received with ``receive(go_live=False)`` live: the shadow of
        the in-place parameters over them, then :meth:`commit` (with the modules
        :meth:`prepare` made, only their new packed copies handed over). Runs in the
        worker's own thread between two forward passes (a worker RPC), never beside one."""
        t0 = time.perf_counter()
        self.receiver.go_live()
        shadow = time.perf_counter() - t0
        seconds = self.commit()
        self.last.update(shadow_seconds=shadow, swap_seconds=time.perf_counter() - t0)
        return seconds

    @torch.no_grad()
    def commit(self) -> float:
        """Make the logical buffers live: vLLM CPU's packed GEMMs (linear layers, LM
        heads) processed in place (:meth:`_commit_direct`), everything else through
        vLLM's layerwise reload (:meth:`_commit_reload`)."""
        from vllm.config import set_current_vllm_config

        t0 = time.perf_counter()
        with set_current_vllm_config(self.vllm_config):
            self._commit_direct()
            self._commit_reload({n: b for n, b in self.buffers.items()
                                 if self.where[n][0] not in self.direct
                                 and self.where[n][0] not in self.experts})
        return self._committed(t0)

    def _commit_direct(self) -> None:
        """Each module of :attr:`direct` gets its buffers and reruns vLLM's processing
        after loading (``kernels.process_in_place``); the other holders of a tied
        tensor are processed with it, except an embedding beside an LM head of its own,
        whose packed GEMM copy nothing reads (the embedding lookup reads its weight)."""
        unread = unread_packed_copies(self.model)
        prepared, self.prepared = self.prepared, {}
        written: set[int] = set()  # storages a hand-over wrote (a tied weight: once)
        heap = self._heap = HeapBound(self.heap_slack_bytes)
        for mname, names in self.direct.items():
            heap.check()
            module = self.model.get_submodule(mname) if mname else self.model
            logical = {self.where[n][1]: self.buffers[n] for n in names}
            if mname in prepared:  # processed beside the engine: hand it over
                take_over(module, prepared[mname], written)
            elif type(module).__name__ in unread:
                for attr, tensor in logical.items():  # read as loaded: in place is all
                    getattr(module, attr).data.copy_(tensor)
            else:
                process_in_place(module, logical, heap)
            for name in names:
                for alias, _ in self.aliases.get(name, []):
                    holder = self.model.get_submodule(alias)
                    if alias in prepared:
                        take_over(holder, prepared[alias], written)
                    elif type(holder).__name__ not in unread:
                        process_in_place(holder, {})  # its weight is the one just written
        for mname, names in self.experts.items():
            heap.check()
            prepack_experts(self.model.get_submodule(mname),
                            {self.where[n][1]: self.buffers[n] for n in names})

    def _commit_reload(self, buffers: dict[str, torch.Tensor]) -> None:
        """Copy ``buffers`` into the live model through vLLM's layerwise reload."""
        import vllm.model_executor.model_loader.reload.layerwise as lw

        if not buffers:
            return
        model = self.model
        saved = snapshot_loaders(model.parameters())
        kept = self.live_names | {n for n in self.buffers if n not in buffers}
        with quiet_reload(model, kept):
            # the modules this reload loads: each buffer's and its tied holders' (a
            # holder prepacked in place is left out below)
            loaded = {m for n in buffers for m, _ in [self.where[n][:2],
                                                      *self.aliases.get(n, [])]}
            reset_moe_kernels(model, [model.get_submodule(m) if m else model
                                      for m in loaded - set(self.experts)])
            lw.initialize_layerwise_reload(model)
            try:
                for name, buf in buffers.items():
                    # a tied tensor is loaded into every module holding it, so that each
                    # reprocesses its own copy (the LM head's GEMM)
                    for mname, attr in [self.where[name][:2], *self.aliases.get(name, [])]:
                        if mname in self.experts:
                            # holds the owner's parameter object, which the owner's
                            # reload writes: loading it here would reprocess the experts
                            continue
                        module = model.get_submodule(mname) if mname else model
                        param = getattr(module, attr)
                        # the restored parameter is vLLM's stored metadata object: its
                        # loader is put back afterwards, or later reloads would inherit ours
                        saved += snapshot_loaders([param])
                        how = self.mapping.converts.get(name)
                        param.weight_loader = _converting_loader(how) if how else _copy_into
                        param.weight_loader = lw.make_online_process_loader(module, attr)
                        param.weight_loader(param, buf)
            finally:
                lw.finalize_layerwise_reload(model, self.vllm_config.model_config)
                restore_loaders(saved)
            for buffer, name in self.derived:  # views a reload leaves on the old storage
                if name in buffers:
                    buffer.copy_(buffers[name].view(buffer.shape))

    def _committed(self, t0: float) -> float:
        heap, self._heap = self._heap, None
        trims = heap.trims if heap is not None else 0
        if self.heap_slack_bytes is not None:  # else kept for the next commit's copies
            return_freed_memory()
            trims += 1
        seconds = time.perf_counter() - t0
        self._version, self.stale = self.receiver.version, False
        self.whole = True  # the receiver's targets hold the live version: lendable
        self.last.update(committed=True, commit_seconds=seconds, stale=False,
                         commit_trims=trims,
                         swap_forward=self.forwards,
                         peak_rss_extra=self._peak_extra(),
                         rss_extra=rss_bytes() - self.rss_at_init)
        return seconds


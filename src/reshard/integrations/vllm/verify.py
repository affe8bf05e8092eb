"""The check of one vLLM rank's refit against vLLM's own loaders (:class:`Checks`,
mixed into :class:`~reshard.integrations.vllm.state.ReshardState`), for the tests and
the demo.

``reshard_verify(path)`` compares this rank's logical tensors with
what vLLM's own ``model.load_weights`` makes of the full state dict saved at ``path`` (a
dry run of layerwise reload that captures each layer before processing and puts the
live kernel tensors back), bit for bit, plus the parameters vLLM keeps unpacked live.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from reshard.integrations.vllm.commit import converted
from reshard.integrations.vllm.internals import quiet_reload, restore_loaders, snapshot_loaders
from reshard.integrations.vllm.kernels import packed_expert_mismatches, packed_gemm_mismatches

__all__ = ["Checks"]


class Checks:
    """The checks of :class:`~reshard.integrations.vllm.state.ReshardState`."""

    @torch.no_grad()
    def vllm_reference(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What vLLM's own ``model.load_weights`` makes of a full checkpoint-format state
        dict on this rank, as logical tensors -- without touching the live weights.

        A dry run of layerwise reload: every layer is restored in checkpoint format and
        loaded by the model's own loaders; when a layer is complete its logical tensors
        are captured and the live kernel tensors are put back, unprocessed. (Tensors
        vLLM never moves to meta, such as biases, are written in place with the same
        loaders.)"""
        import vllm.model_executor.model_loader.reload.layerwise as lw
        from vllm.config import set_current_vllm_config

        model = self.model
        names = {m: n for n, m in model.named_modules()}
        captured: dict[str, torch.Tensor] = {}

        def capture(layer: torch.nn.Module, info: Any) -> None:
            lw.materialize_layer(layer, info)
            for p in lw.get_layer_tensors(layer).values():
                p.weight_loader = lw._get_original_loader(p)
            for pname, args in info.loaded_weights:
                param = getattr(layer, pname)
                args.arguments["param"] = param
                param.weight_loader(*args.args, **args.kwargs)
            prefix = names[layer]
            for pname, p in layer._parameters.items():
                if p is not None:
                    name = f"{prefix}.{pname}" if prefix else pname
                    # in its checkpoint dtype, as a fresh load stores it: a bias vLLM
                    # turned to float32 takes the checkpoint's values unrounded here
                    logical = self.where[name][3] if name in self.where else p.dtype
                    captured[name] = p.detach().to(logical, copy=True)
            lw._place_kernel_tensors(layer, info)
            info.reset()

        saved = snapshot_loaders(model.parameters())
        original = lw._layerwise_process
        lw._layerwise_process = capture
        try:
            with set_current_vllm_config(self.vllm_config), quiet_reload(model):
                lw.initialize_layerwise_reload(model)
                try:
                    model.load_weights(iter(state_dict.items()))
                finally:
                    lw.finalize_layerwise_reload(model, self.vllm_config.model_config)
        finally:
            lw._layerwise_process = original
            restore_loaders(saved)
        return captured

    def verify(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Compare the logical buffers of the last refit with :meth:`vllm_reference` of
        ``state_dict``, bit for bit; also the live parameters vLLM keeps unpacked."""
        ref = self.vllm_reference(state_dict)
        mismatched = [n for n, b in {**self.buffers, **self.live}.items()
                      if n not in ref or not _same(ref[n], self._as_loaded(n, b))]
        mismatched += [f"{n} (derived buffer)" for d, n in self.derived
                       if n in ref and not _same(d, ref[n].view(d.shape))]
        mismatched += packed_gemm_mismatches(self.model, ref, self.aliases)
        mismatched += packed_expert_mismatches(self.model, ref, list(self.experts))
        live = dict(self.model.named_parameters())
        # packed linears are empty on CPU (shape differs); MoE experts are reordered in
        # place whatever their shape: compare the others, which vLLM leaves as loaded
        experts = {n for n, (m, _, _, _) in self.where.items()
                   if hasattr(self.model.get_submodule(m) if m else self.model, "w13_weight")}
        live_checked = [n for n, b in self.buffers.items() if n in live and n not in experts
                        and tuple(live[n].shape) == tuple(b.shape)]
        live_mismatched = [n for n in live_checked if not _same(
            live[n].data, self._as_loaded(n, self.buffers[n]))]
        return {"rank": self.rank, "checked": len(self.buffers) + len(self.live),
                "in_place_checked": len(self.live), "mismatched": mismatched,
                "live_checked": len(live_checked), "live_mismatched": live_mismatched}

    def _as_loaded(self, name: str, logical: torch.Tensor) -> torch.Tensor:
        """A logical tensor as vLLM's loader stores it (its conversion applied)."""
        how = self.mapping.converts.get(name)
        return logical if how is None else converted(how, logical).to(self.where[name][3])


def _same(held: torch.Tensor, logical: torch.Tensor) -> bool:
    """Bit for bit the same values; where vLLM holds a tensor in another dtype than its
    checkpoint form (a bias it turned to float32), the same through an exact cast both
    ways."""
    if held.dtype == logical.dtype:
        if held.element_size() == 1 and held.is_floating_point():  # FP8: no torch.equal
            return torch.equal(held.view(torch.uint8), logical.view(torch.uint8))
        return torch.equal(held, logical)
    return (torch.equal(held, logical.to(held.dtype)) and
            torch.equal(held.to(logical.dtype), logical))

"""The reshard plugin SGLang loads in each of its processes (entry point
``sglang.srt.plugins``; ``SGLANG_PLUGINS`` may restrict which load): it hooks the model
runner's ``update_weights_from_tensor`` so that requests with ``load_format="reshard"``
reach this rank's refit state (:func:`reshard.integrations.sglang.rank.handle`)."""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    from reshard.integrations.sglang.internals import install_hook
    from reshard.integrations.sglang.rank import handle

    install_hook(handle)

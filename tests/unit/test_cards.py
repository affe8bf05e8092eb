"""A card per rank (reshard.tools.netns.use_card) runs each rank with an unprivileged
filesystem uid: refused up front, with the reason, where that uid could not read the
Python environment."""

from __future__ import annotations

import sys

import reshard.tools.netns as netns


def test_cards_need_a_world_readable_environment(tmp_path, monkeypatch):
    private = tmp_path / "venv"
    private.mkdir(mode=0o700)
    private.chmod(0o700)
    monkeypatch.setattr(sys, "prefix", str(private))
    reason = netns.cards_unavailable_reason()
    assert reason is not None and f"cannot read {private}" in reason
    assert "drwx------" in reason

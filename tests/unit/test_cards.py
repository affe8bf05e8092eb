"""A card per rank (reshard.tools.netns.use_card) runs each rank with an unprivileged
filesystem uid: refused up front, with the reason, where that uid could not read the
Python environment."""

from __future__ import annotations

import sys

import pytest

import reshard.tools.netns as netns


def test_cards_need_a_world_readable_environment(tmp_path, monkeypatch):
    private = tmp_path / "venv"
    private.mkdir(mode=0o700)
    private.chmod(0o700)
    monkeypatch.setattr(sys, "prefix", str(private))
    reason = netns.cards_unavailable_reason()
    assert reason is not None and f"cannot read {private}" in reason
    assert "drwx------" in reason



def test_a_directory_of_the_process_group_is_read_by_its_group_bits(monkeypatch):
    """The unprivileged uid keeps the process's group, so a directory of that group
    without group access is refused even where others may read it (drwx---r-x: the
    kernel checks the group bits, not the others' bits); with them it is accepted."""
    import os
    import shutil
    import tempfile
    from pathlib import Path

    env = Path(tempfile.mkdtemp(prefix="reshard-cards-"))
    try:
        for d in env.parents:
            if d.stat().st_mode & 0o005 != 0o005:
                pytest.skip(f"the temporary directory's parent {d} is not open to others")
        os.chown(env, -1, os.getegid())
        monkeypatch.setattr(sys, "prefix", str(env))
        monkeypatch.setattr(netns, "__file__", str(env / "netns.py"))  # the env alone
        env.chmod(0o705)
        reason = netns.cards_unavailable_reason()
        assert reason is not None and f"cannot read {env}" in reason, reason
        assert "drwx---r-x" in reason
        env.chmod(0o755)
        assert netns.cards_unavailable_reason() is None
    finally:
        shutil.rmtree(env)

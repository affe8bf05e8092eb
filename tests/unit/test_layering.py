"""Imports flow one way: the layout, plan and schedule layers (and the planners built on
them) load without torch, let alone torch.distributed, and run with no processes."""

from __future__ import annotations

import subprocess
import sys


def test_core_layers_import_without_torch():
    code = ("import sys, reshard, reshard.layout, reshard.plan, reshard.schedule, "
            "reshard.topology, reshard.specs, reshard.models; "
            "print('torch' in sys.modules, 'torch.distributed' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "False"]

"""Where the check finds the repository: its root, and the one command's script."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"  # what a probe subprocess runs

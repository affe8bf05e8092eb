"""The README's one-call example runs as written, under torchrun, on 4 gloo processes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc

README = Path(__file__).resolve().parents[2] / "README.md"
MARKER = "<!-- example: one-call -->"


def example_code() -> str:
    text = README.read_text()
    block = text[text.index(MARKER):]
    return block.split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_one_call_example_runs_as_written(tmp_path):
    script = tmp_path / "one_call.py"
    script.write_text(example_code())
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "4", str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # four processes share one stdout: a line's newline may land after another's text
    said = sorted(re.findall(r"rank \d: \(Replicate\(\), Shard\(dim=1\)\) \(8, 4\), "
                             r"wo \(8, 4\)", proc.stdout))
    assert said == [f"rank {r}: (Replicate(), Shard(dim=1)) (8, 4), wo (8, 4)"
                    for r in range(4)], proc.stdout

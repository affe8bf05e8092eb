"""GPU readiness: does reshard work on one CUDA GPU, and does it pack fast enough?

    PYTHONPATH=src python3 benchmarks/gpu_check.py --out DIR

The one command of the GPU check. The check itself is the package next to this file,
``benchmarks/gpu_checks/``: one probe per module (``features``, ``correctness``,
``packing``, ``quant``, ``nccl``, ``ipc``, ``colocated``, ``pytest_runs``), a shared runner
(``runner``) and report (``report``); its ``__init__`` says what each measures.
``--device cpu --quick`` is its debug mode on the host (``tests/unit/test_gpu_check.py``).
"""

from __future__ import annotations

import sys

from gpu_checks import main  # this file's folder is on sys.path when it runs

if __name__ == "__main__":
    sys.exit(main())

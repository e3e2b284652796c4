#!/usr/bin/env python
"""Compare our schedules with PyTorch's pipelining schedules under one cost model: the ``schedules``
benchmark.

The body is :mod:`megatron_zb.bench.schedules` (``python -m megatron_zb.bench schedules`` runs the same
from an installed package); this script runs it from the checkout with the same command line and output.

Usage: python scripts/bench_schedules.py [--out FILE.md] [--settings unit,paper] [--skip NAMES]
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from megatron_zb.bench.schedules import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

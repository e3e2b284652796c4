#!/usr/bin/env python
"""Rerunnable benchmarks of megatron-zb on a CPU machine (gloo, real processes): the ``cpu`` benchmark.

The body is :mod:`megatron_zb.bench.cpu` (``python -m megatron_zb.bench cpu`` runs the same from an
installed package); this script runs it from the checkout with the same command line and output.

Usage: python scripts/benchmark.py [--quick] [--out DIR] [--sections real,memory,emulated,postval,dp]
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from megatron_zb.bench.cpu import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

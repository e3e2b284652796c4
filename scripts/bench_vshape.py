#!/usr/bin/env python
"""Benchmarks of the V-shaped schedules, interleaved-zb and the exact solver (simulated): the ``vshape``
benchmark.

The body is :mod:`megatron_zb.bench.vshape` (``python -m megatron_zb.bench vshape`` runs the same from an
installed package); this script runs it from the checkout with the same command line and output.

Usage:
    python scripts/bench_vshape.py                       # every section except the exact grid
    python scripts/bench_vshape.py --sections exact --exact-time-limit 20
    python scripts/bench_vshape.py --sections table8,unit,sweep,interleaved,exact
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from megatron_zb.bench.vshape import main  # noqa: E402

if __name__ == "__main__":
    main()

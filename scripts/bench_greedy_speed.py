#!/usr/bin/env python
"""Time the greedy zero-bubble scheduler: the ``greedy-speed`` benchmark.

The body is :mod:`megatron_zb.bench.greedy_speed` (``python -m megatron_zb.bench greedy-speed`` runs the
same from an installed package); this script runs it from the checkout with the same command line and
output.

    python scripts/bench_greedy_speed.py [--repeats 3] [--pp 8 32 64]
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from megatron_zb.bench.greedy_speed import main  # noqa: E402

if __name__ == "__main__":
    main()

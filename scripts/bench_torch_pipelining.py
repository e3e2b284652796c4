#!/usr/bin/env python
"""Benchmark: megatron-zb's profiled schedules beside PyTorch's built-ins, all run by PyTorch's own
pipeline runtime (``torch.distributed.pipelining``) on CPU with gloo, in one run: the
``torch-pipelining`` benchmark.

The body is :func:`megatron_zb.bench.torch_pipelining.main` (``python -m megatron_zb.bench
torch-pipelining`` runs the same from an installed package); this script runs it from the checkout with
the same command line and output.

Usage:
    python scripts/bench_torch_pipelining.py                 # PP=2, 8 microbatches, 7 paired rounds
    python scripts/bench_torch_pipelining.py --pp 4 --rounds 5
    python scripts/bench_torch_pipelining.py --rounds 21 --builtins Schedule1F1B,ScheduleDualPipeV --ours 1f1b,1f1b-v,auto

What is measured and how: ``megatron_zb/bench/torch_pipelining.py``; results: docs/torch_pipelining.md.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from megatron_zb.bench.torch_pipelining import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())

"""Time the greedy zero-bubble scheduler: p in {8, 32, 64} x m in {2p, 8p}, ZB-1p and ZB-2p limits.

Prints a markdown table (median wall-clock seconds of --repeats calls, and the bubble rate of
the result) with the command and machine at the top. A benchmark, not a test: no thresholds.

    python scripts/bench_greedy_speed.py [--repeats 3] [--pp 8 32 64]
    python -m megatron_zb.bench greedy-speed [...]       # the same, from an installed package
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

from megatron_zb.schedules import CostModel, simulate
from megatron_zb.schedules.generators.greedy import zb_greedy


def main(argv: list[str] | None = None, *, invoked_as: tuple[str, ...] = ("scripts/bench_greedy_speed.py",)) -> None:
    """The benchmark on ``argv`` (default ``sys.argv[1:]``); ``invoked_as``: what follows ``python`` in
    the command line printed first (``scripts/bench_greedy_speed.py``, or ``-m megatron_zb.bench.greedy_speed``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="calls per cell; the median is reported")
    ap.add_argument("--pp", type=int, nargs="+", default=[8, 32, 64], help="pipeline sizes")
    args = ap.parse_args(argv)
    print(f"command: python {' '.join(invoked_as)} {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"date {time.strftime('%Y-%m-%d')}")
    # the 6.2B model's profiled costs (paper Table 9, m=24 row), memory in units of one stage's M_B
    costs = CostModel(t_f=29.718, t_b=29.444, t_w=19.927, t_comm=0.527, mem_b=1.0, mem_w=0.432)
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    print("\n| p | m | limit | wall s (median) | CPU s (median) | bubble rate |\n|---|---|---|---|---|---|")
    for p in args.pp:
        for m in (2 * p, 8 * p):
            for k in (1, 2):
                times, cpu = [], []
                for _ in range(args.repeats):
                    t0, c0 = time.perf_counter(), time.process_time()
                    sched = zb_greedy(num_ranks=p, num_microbatches=m, costs=costs, memory_limit=k * p)
                    times.append(time.perf_counter() - t0)
                    cpu.append(time.process_time() - c0)
                r = simulate(sched, costs)
                print(f"| {p} | {m} | {k}p | {statistics.median(times):.3f} | {statistics.median(cpu):.3f} "
                      f"| {r.bubble_rate:.4f} |", flush=True)
                print(f"  p={p} m={m} {k}p done", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main(invoked_as=("-m", "megatron_zb.bench.greedy_speed"))

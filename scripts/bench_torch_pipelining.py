#!/usr/bin/env python
"""Benchmark: megatron-zb's profiled schedules beside PyTorch's built-ins, all run by PyTorch's own
pipeline runtime (``torch.distributed.pipelining``) on CPU with gloo, in one run.

Usage:
    python scripts/bench_torch_pipelining.py                 # PP=2, 8 microbatches, 7 paired rounds
    python scripts/bench_torch_pipelining.py --pp 4 --rounds 5
    python scripts/bench_torch_pipelining.py --rounds 21 --builtins Schedule1F1B,ScheduleDualPipeV --ours 1f1b,1f1b-v,auto

What is measured and how: ``megatron_zb/bench/torch_pipelining.py``; results: docs/torch_pipelining.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_zb.bench.machine import LoadSampler, machine  # noqa: E402
from megatron_zb.bench.torch_pipelining import BUILTINS, OURS, TorchBenchConfig, bench_rank, report  # noqa: E402
from megatron_zb.testing.distributed import run_distributed  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2, help="pipeline ranks (processes, one thread each)")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=7, help="paired rounds (every schedule once per round)")
    ap.add_argument("--layers", type=int, default=8, help="transformer layers (divisible by 2 x pp)")
    ap.add_argument("--seq", type=int, default=256, help="tokens per sample")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--builtins", default=",".join(BUILTINS),
                    help="PyTorch's schedule classes to run, comma-separated (default: all five)")
    ap.add_argument("--ours", default=",".join(OURS),
                    help="megatron-zb families (or auto) to run, comma-separated; NAME@BUILTIN: NAME re-planned with "
                         "that built-in's measured peak activation memory as its limit")
    a = ap.parse_args(argv)
    pick = {k: tuple(n for n in getattr(a, k).split(",") if n) for k in ("builtins", "ours")}
    bc = TorchBenchConfig(pp=a.pp, microbatches=a.microbatches, rounds=a.rounds, **pick)
    bc = replace(bc, model=replace(bc.model, layers=a.layers, seq=a.seq, hidden=a.hidden, ffn=4 * a.hidden))
    print(machine())
    sampler = LoadSampler()
    t0 = time.perf_counter()
    res = run_distributed(partial(bench_rank, bc), world_size=bc.pp, timeout=3600, threads=1,
                          preload=("torch", "torch.distributed", "megatron_zb"))
    print(report(bc, res))
    print(f"\n{sampler.stop()}\nwall time {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

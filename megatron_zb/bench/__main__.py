"""The one benchmark entry point: ``python -m megatron_zb.bench NAME [its options]``.

Every benchmark of the project, by name (``python -m megatron_zb.bench`` lists them); the options
after the name go to that benchmark, whose ``--help`` says what it measures. Each is a module of the
installed package (:data:`BENCHMARKS`), run as ``python -m MODULE`` would run it, so every benchmark
runs from an installed wheel; the scripts in a source checkout's ``scripts/`` (``python
scripts/bench_vshape.py ...``) only call these modules. docs/benchmarks.md records the results.
"""

from __future__ import annotations

import runpy
import sys
from typing import NamedTuple, Sequence

__all__ = ["BENCHMARKS", "Benchmark", "main"]


class Benchmark(NamedTuple):
    """One benchmark: the module that runs it and what it measures."""

    module: str
    """The module run as ``__main__`` (``python -m MODULE``), inside this package."""
    summary: str
    """One line: what it measures."""


BENCHMARKS: dict[str, Benchmark] = {
    "cpu": Benchmark("megatron_zb.bench.cpu", "measured on CPU (gloo): tiny GPT PP=2 against megatron-core's 1F1B, "
                                              "activation memory, an emulated cluster, post-validation, DP overlap"),
    "schedules": Benchmark("megatron_zb.bench.schedules", "simulated: every schedule of ours beside PyTorch's under "
                                                          "one cost model"),
    "vshape": Benchmark("megatron_zb.bench.vshape", "simulated: the V-shaped schedules, interleaved-zb and the exact "
                                                    "solver"),
    "greedy-speed": Benchmark("megatron_zb.bench.greedy_speed", "wall time of the greedy zero-bubble scheduler"),
    "torch-pipelining": Benchmark("megatron_zb.bench.torch_pipelining", "our profiled schedules beside PyTorch's "
                                                                        "built-ins, run by torch.distributed.pipelining"),
    "vocab": Benchmark("megatron_zb.bench.vocab", "measured on CPU (gloo): --enable-vocab-parallel against "
                                                  "the same schedules without it, beside the planner"),
    "zero2": Benchmark("megatron_zb.bench.zero2", "measured on CPU (gloo): sharded gradients (ZeRO-2) in W groups "
                                                  "of K against the distributed optimizer, memory and time"),
    "gpu": Benchmark("megatron_zb.testing.gpu_bench", "a GPU node: megatron-core's 1F1B against zb, zb-2p "
                                                      "and zbv (scripts/gpu_selftest.sh runs it)"),
}
"""Name -> benchmark, in the order ``python -m megatron_zb.bench`` lists them."""


def _listing() -> str:
    width = max(map(len, BENCHMARKS))
    rows = [f"  {name:<{width}}  {b.summary}" for name, b in BENCHMARKS.items()]
    return ("usage: python -m megatron_zb.bench NAME [options of NAME]   (NAME --help: its options)\n\n"
            "benchmarks:\n" + "\n".join(rows))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark named by ``argv[0]`` with the rest of ``argv``; returns the exit status
    (2 for a missing or unknown name, listing the names; 0 for ``--list`` / ``--help``, listing them)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print(_listing())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    bench = BENCHMARKS.get(name)
    if bench is None:
        print(f"python -m megatron_zb.bench: error: unknown benchmark {name!r}\n\n{_listing()}", file=sys.stderr)
        return 2
    return _run(bench.module, rest)


def _run(module: str, rest: list[str]) -> int:
    """Run ``module`` as ``__main__`` (``runpy.run_module``: ``sys.argv[0]`` becomes its file) with
    ``rest`` as its arguments, ``sys.argv`` restored after; its exit status (they end with
    ``sys.exit(main())`` or return)."""
    saved, sys.argv = sys.argv, [f"python -m {module}", *rest]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())

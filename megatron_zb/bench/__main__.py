"""The one benchmark entry point: ``python -m megatron_zb.bench NAME [its options]``.

Every benchmark of the project, by name (``python -m megatron_zb.bench`` lists them); the options
after the name go to that benchmark, whose ``--help`` says what it measures. The command lines live
in ``scripts/`` (a source checkout; ``pip install`` does not install them) and in
:mod:`megatron_zb.testing.gpu_bench`; the measured sections in :mod:`megatron_zb.bench`. The
scripts still run on their own (``python scripts/bench_vshape.py ...``): this entry only dispatches.
docs/benchmarks.md records the results.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

__all__ = ["BENCHMARKS", "Benchmark", "main"]

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
"""``scripts/`` of the source checkout this package runs from."""


class Benchmark(NamedTuple):
    """One benchmark: what runs it and what it measures."""

    target: str
    """``scripts/NAME.py`` (a script of the checkout) or ``module:NAME`` (a module run with ``-m``)."""
    summary: str
    """One line: what it measures."""


BENCHMARKS: dict[str, Benchmark] = {
    "cpu": Benchmark("benchmark.py", "measured on CPU (gloo): tiny GPT PP=2 against megatron-core's 1F1B, "
                                     "activation memory, an emulated cluster, post-validation, DP overlap"),
    "schedules": Benchmark("bench_schedules.py", "simulated: every schedule of ours beside PyTorch's under one "
                                                 "cost model"),
    "vshape": Benchmark("bench_vshape.py", "simulated: the V-shaped schedules, interleaved-zb and the exact solver"),
    "greedy-speed": Benchmark("bench_greedy_speed.py", "wall time of the greedy zero-bubble scheduler"),
    "torch-pipelining": Benchmark("bench_torch_pipelining.py", "our profiled schedules beside PyTorch's "
                                                               "built-ins, run by torch.distributed.pipelining"),
    "vocab": Benchmark("module:megatron_zb.bench.vocab", "measured on CPU (gloo): --enable-vocab-parallel against "
                                                         "the same schedules without it, beside the planner"),
    "gpu": Benchmark("module:megatron_zb.testing.gpu_bench", "a GPU node: megatron-core's 1F1B against zb, zb-2p "
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
    (2 for a missing or unknown name, listing the names)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_listing())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    bench = BENCHMARKS.get(name)
    if bench is None:
        print(f"python -m megatron_zb.bench: error: unknown benchmark {name!r}\n\n{_listing()}", file=sys.stderr)
        return 2
    if bench.target.startswith("module:"):
        module = bench.target.removeprefix("module:")
        return _run(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True),
                    argv=[f"python -m {module}", *rest])
    script = SCRIPTS / bench.target
    if not script.is_file():
        print(f"python -m megatron_zb.bench: error: {name} runs {script}, which is not here (the benchmark "
              f"scripts are in a source checkout of megatron-zb, not in an installed wheel)", file=sys.stderr)
        return 2
    return _run(lambda: runpy.run_path(str(script), run_name="__main__"), argv=[str(script), *rest])


def _run(call: Callable[[], object], *, argv: list[str]) -> int:
    """Run a benchmark's ``__main__`` with ``sys.argv`` = ``argv`` (restored after); its exit status
    (they end with ``sys.exit(main())`` or return)."""
    saved, sys.argv = sys.argv, argv
    try:
        call()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return 0

if __name__ == "__main__":
    sys.exit(main())

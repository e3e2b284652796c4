"""Benchmarks a user can rerun: real PP=2 CPU timings, an emulated cluster, activation memory.

The ``cpu`` benchmark (:mod:`megatron_zb.bench.cpu`) drives them; every benchmark of the project is a
module here (or :mod:`megatron_zb.testing.gpu_bench`) and runs by name through one entry point,
``python -m megatron_zb.bench NAME`` (:mod:`megatron_zb.bench.__main__`), from an installed package too;
``scripts/benchmark.py`` and ``scripts/bench_*.py`` only call these modules. ``docs/benchmarks.md``
records the results.
"""

from .emulated import (EmulatedConfig, EmulatedCosts, EmulatedStage, SleepClock, build_emulated_stages,
                       emulated_forward_step, emulated_loss_func)

__all__ = [
    "EmulatedConfig", "EmulatedCosts", "EmulatedStage", "SleepClock", "build_emulated_stages",
    "emulated_forward_step", "emulated_loss_func",
]

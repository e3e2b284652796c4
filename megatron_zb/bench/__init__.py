"""Benchmarks a user can rerun: real PP=2 CPU timings, an emulated cluster, activation memory.

``scripts/benchmark.py`` drives them; every benchmark of the project runs by name through one entry
point, ``python -m megatron_zb.bench NAME`` (:mod:`megatron_zb.bench.__main__`); ``docs/benchmarks.md``
records the results.
"""

from .emulated import (EmulatedConfig, EmulatedCosts, EmulatedStage, SleepClock, build_emulated_stages,
                       emulated_forward_step, emulated_loss_func)

__all__ = [
    "EmulatedConfig", "EmulatedCosts", "EmulatedStage", "SleepClock", "build_emulated_stages",
    "emulated_forward_step", "emulated_loss_func",
]

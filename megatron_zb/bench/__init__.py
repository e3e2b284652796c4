"""Benchmarks a user can rerun: real PP=2 CPU timings, an emulated cluster, activation memory.

``scripts/benchmark.py`` drives them; ``docs/benchmarks.md`` records the results.
"""

from .emulated import (EmulatedConfig, EmulatedCosts, EmulatedStage, SleepClock, build_emulated_stages,
                       emulated_forward_step, emulated_loss_func)

__all__ = [
    "EmulatedConfig", "EmulatedCosts", "EmulatedStage", "SleepClock", "build_emulated_stages",
    "emulated_forward_step", "emulated_loss_func",
]

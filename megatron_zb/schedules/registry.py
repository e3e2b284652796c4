"""Schedules by name: the one place that maps a user's ``--schedule NAME`` to a generator.

Importing this module imports :mod:`megatron_zb.schedules.generators`, whose modules register
every built-in schedule in :data:`SCHEDULES` (see :mod:`.catalog`).

Units: ``costs`` are per *stage* (with several chunks per rank, a stage is one chunk);
``memory_limit`` is the per-rank peak activation memory in the unit of ``costs.mem_b``.
"""

from __future__ import annotations

from . import generators  # noqa: F401  (registers the built-in schedules)
from .catalog import SCHEDULES, ScheduleSpec, register
from .costs import CostModel
from .ir import Schedule, ScheduleError

__all__ = ["SCHEDULES", "ScheduleSpec", "build_schedule", "get_spec", "register", "schedule_names", "vocab_schedule_names"]


def get_spec(name: str) -> ScheduleSpec:
    """The :class:`ScheduleSpec` for ``name``; a clear error lists the known names."""
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of: {', '.join(SCHEDULES)}") from None


def schedule_names() -> list[str]:
    """Every registered name, in registration order."""
    return list(SCHEDULES)


def vocab_schedule_names() -> list[str]:
    """The registered schedules that place the vocabulary passes, in registration order."""
    return [name for name, spec in SCHEDULES.items() if spec.vocab_parallel]


def build_schedule(name: str, *, num_ranks: int, num_microbatches: int, costs: CostModel | None = None,
                   memory_limit: float | None = None, num_chunks: int = 2) -> Schedule:
    """Build the schedule called ``name``.

    Args:
        name: one of :func:`schedule_names` (``"1f1b"``, ``"zb-h1"``, ``"zb"``, ...).
        num_ranks: pipeline-parallel size ``p``.
        num_microbatches: microbatches per iteration ``m`` (any ``m >= 1``).
        costs: per-stage costs (defaults: unit times, ``mem_w = mem_b / 2``).
        memory_limit: per-rank activation limit for cost-aware schedules, unit of ``costs.mem_b``;
            ``None``: ``costs.memory_limit``, else the schedule's default (the generator resolves
            it with :func:`~.limits.resolve_limit`).
        num_chunks: model chunks per rank for the interleaved placement.
    """
    spec = get_spec(name)
    costs = costs if costs is not None else CostModel()
    sched = spec.build(num_ranks=num_ranks, num_microbatches=num_microbatches, costs=costs,
                       memory_limit=memory_limit, num_chunks=num_chunks)
    sched.name = name
    return sched

"""Schedules by name: the one place that maps a user's ``--schedule NAME`` to a generator.

Units: ``costs`` are per *stage* (with several chunks per rank, a stage is one chunk);
``memory_limit`` is the per-rank peak activation memory in the unit of ``costs.mem_b``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .costs import CostModel
from .ir import Schedule, ScheduleError


@dataclass(frozen=True)
class ScheduleSpec:
    """What a schedule name stands for.

    Attributes:
        name: the user-facing name (``--schedule NAME``).
        description: one line for ``--help`` and the README table.
        placement: ``"plain"`` (one stage per rank), ``"interleaved"`` (``v`` chunks per rank,
            stage ``s`` on rank ``s % p``) or ``"v"`` (two chunks per rank in a V).
        split_backward: whether the schedule splits backward into B and W.
        cost_aware: whether the generator uses the cost model / memory limit.
    """

    name: str
    description: str
    placement: str
    split_backward: bool
    cost_aware: bool
    build: Callable[..., Schedule]

    def chunks_per_rank(self, num_chunks: int) -> int:
        return {"plain": 1, "interleaved": num_chunks, "v": 2}[self.placement]


def _greedy(limit_in_p: float | None) -> Callable[..., Schedule]:
    def build(*, num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: float | None,
              **_: object) -> Schedule:
        from .greedy import zb_greedy  # the greedy scheduler is the heaviest module: import on use
        sc = costs.resolve(num_ranks)
        if memory_limit is None and limit_in_p is not None:
            memory_limit = limit_in_p * num_ranks * max(sc.mem_b)
        return zb_greedy(num_ranks=num_ranks, num_microbatches=num_microbatches, costs=costs,
                         memory_limit=memory_limit)
    return build


def _baseline(fn_name: str, module: str) -> Callable[..., Schedule]:
    def build(*, num_ranks: int, num_microbatches: int, num_chunks: int = 2, **_: object) -> Schedule:
        import importlib
        fn = getattr(importlib.import_module(f"{__package__}.{module}"), fn_name)
        kwargs = {"num_chunks": num_chunks} if fn_name == "interleaved_1f1b" else {}
        return fn(num_ranks=num_ranks, num_microbatches=num_microbatches, **kwargs)
    return build


SCHEDULES: dict[str, ScheduleSpec] = {
    spec.name: spec for spec in [
        ScheduleSpec("1f1b", "Megatron's 1F1B, fused backward: peak p*M_B, bubble (p-1)(T_F+T_B+T_W)",
                     "plain", False, False, _baseline("one_f_one_b", "baselines")),
        ScheduleSpec("interleaved-1f1b", "Megatron's interleaved 1F1B with v chunks per rank (--chunks)",
                     "interleaved", False, False, _baseline("interleaved_1f1b", "baselines")),
        ScheduleSpec("zb-h1", "handcrafted ZB-H1: 1F1B's peak memory, bubble (p-1)(T_F+T_B-T_W)",
                     "plain", True, False, _baseline("zb_h1", "handcrafted")),
        ScheduleSpec("zb-h2", "handcrafted ZB-H2: peak (2p-1)*M_B, bubble (p-1)(T_F+T_B-2T_W)",
                     "plain", True, False, _baseline("zb_h2", "handcrafted")),
        ScheduleSpec("zb", "greedy zero-bubble scheduler under --memory-limit (default p*M_B, as 1F1B)",
                     "plain", True, True, _greedy(1.0)),
        ScheduleSpec("zb-1p", "greedy zero-bubble scheduler with memory limit p*M_B (ZB-1p)",
                     "plain", True, True, _greedy(1.0)),
        ScheduleSpec("zb-2p", "greedy zero-bubble scheduler with memory limit 2p*M_B (ZB-2p)",
                     "plain", True, True, _greedy(2.0)),
    ]
}


def register(spec: ScheduleSpec) -> None:
    """Add a schedule family (used by modules that define more schedules, e.g. the V family)."""
    SCHEDULES[spec.name] = spec


def get_spec(name: str) -> ScheduleSpec:
    """The :class:`ScheduleSpec` for ``name``; a clear error lists the known names."""
    _load_optional()
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of: {', '.join(SCHEDULES)}") from None


def schedule_names() -> list[str]:
    _load_optional()
    return list(SCHEDULES)


def _load_optional() -> None:
    """Import modules that register further schedules, when they exist."""
    import importlib
    for mod in ("vshape", "exact"):
        try:
            importlib.import_module(f"{__package__}.{mod}")
        except ModuleNotFoundError as e:
            if e.name != f"{__package__}.{mod}":
                raise


def build_schedule(name: str, *, num_ranks: int, num_microbatches: int, costs: CostModel | None = None,
                   memory_limit: float | None = None, num_chunks: int = 2) -> Schedule:
    """Build the schedule called ``name``.

    Args:
        name: one of :func:`schedule_names` (``"1f1b"``, ``"zb-h1"``, ``"zb"``, ...).
        num_ranks: pipeline-parallel size ``p``.
        num_microbatches: microbatches per iteration ``m`` (any ``m >= 1``).
        costs: per-stage costs (defaults: unit times, ``mem_w = mem_b / 2``).
        memory_limit: per-rank activation limit for cost-aware schedules, unit of ``costs.mem_b``;
            ``None`` takes the schedule's default.
        num_chunks: model chunks per rank for the interleaved placement.
    """
    spec = get_spec(name)
    costs = costs if costs is not None else CostModel()
    if memory_limit is None:
        memory_limit = costs.memory_limit
    sched = spec.build(num_ranks=num_ranks, num_microbatches=num_microbatches, costs=costs,
                       memory_limit=memory_limit, num_chunks=num_chunks)
    sched.name = name
    return sched

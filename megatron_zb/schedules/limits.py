"""The memory-limit rule, written once: which limit a schedule is built for, and what "fits" means.

Unit: a memory limit is the peak activation memory allowed on *each rank* (the sum over the stages
the rank holds), in the unit of ``costs.mem_b`` -- bytes, or one stage's ``M_B`` (with several
chunks per rank, one *chunk's* ``M_B``). ``inf`` means no limit; a finite limit must be ``> 0``.

Resolution (:func:`resolve_limit`, called by every cost-aware generator):

1. the ``memory_limit`` argument, when given;
2. else ``costs.memory_limit``, when set;
3. else the schedule's own default (each generator states it in its docstring; the ``megatron-zb
   list`` descriptions repeat it), raised to the placement's feasible minimum when it is below it
   (possible only when ``B`` allocates, ``mem_w > mem_b``: one microbatch then peaks after its
   ``B``, :meth:`~.costs.StageCosts.microbatch_peak`); a default of ``0`` -- no activation memory
   at all -- means no limit (``inf``), not "nothing fits". An explicit limit is never raised: below
   the minimum it is refused (:func:`check_minimum`).

Fits (:func:`fits`): held memory fits a limit when ``held <= limit * (1 + 1e-9) + 1e-9``
(:data:`MEMORY_SLACK`, relative and absolute: summing per-stage floats in another order moves the
total by far less). The simulator's memory check (:mod:`.timing`), every generator's scheduling
decisions and its "below the minimum" refusal (:func:`check_minimum`), and the planner use this
one rule, so a generator never builds a schedule the simulator would reject, nor refuses a limit
the simulator would accept.
"""

from __future__ import annotations

import math

from .costs import CostModel
from .ir import ScheduleError

__all__ = ["MEMORY_SLACK", "check_minimum", "count_that_fit", "fits", "parse_limit", "resolve_limit",
           "slack_ceiling"]

MEMORY_SLACK = 1e-9
"""Relative and absolute slack of every memory-limit comparison (float summation noise)."""


def slack_ceiling(limit: float | None) -> float:
    """The most held memory that fits ``limit`` (``inf`` for ``None`` or ``inf``: no limit)."""
    if limit is None or math.isinf(limit):
        return math.inf
    return limit * (1 + MEMORY_SLACK) + MEMORY_SLACK


def fits(held: float, limit: float | None) -> bool:
    """Whether ``held`` memory fits ``limit`` (same unit; ``None``: no limit)."""
    return held <= slack_ceiling(limit)


def count_that_fit(limit: float, size: float) -> int:
    """How many items of ``size`` (``> 0``) fit ``limit`` together: the largest ``k`` with ``fits(k * size, limit)``
    (``limit`` finite)."""
    return math.floor(slack_ceiling(limit) / size)


def parse_limit(memory_limit: object) -> float:
    """A memory limit as a float ``> 0`` (``inf`` allowed); else a :class:`ScheduleError` naming it."""
    try:
        limit = float(memory_limit)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ScheduleError(f"memory_limit must be a number, got {memory_limit!r}") from None
    if math.isnan(limit) or limit <= 0:
        raise ScheduleError(f"memory_limit is {memory_limit!r}; it must be > 0")
    return limit


def resolve_limit(memory_limit: float | None, costs: CostModel, default: float, *, minimum: float = 0.0) -> float:
    """The limit a schedule is built for: ``memory_limit``, else ``costs.memory_limit``, else
    ``max(default, minimum)``.

    Args:
        memory_limit: the caller's limit (unit of ``costs.mem_b``), or ``None``.
        costs: the cost model (its ``memory_limit`` is the second choice).
        default: the schedule's own default, same unit; ``<= 0`` (no activation memory) or ``inf``
            means no limit.
        minimum: the placement's feasible minimum, same unit: a default below it is raised to it.

    Returns:
        The limit, ``> 0``; ``inf`` for no limit.

    Raises:
        ScheduleError: the chosen limit is not a number ``> 0``.
    """
    if memory_limit is None:
        memory_limit = costs.memory_limit
    if memory_limit is None:
        default = default if default >= minimum else minimum
        memory_limit = default if default > 0 else math.inf
    return parse_limit(memory_limit)


def check_minimum(limit: float, need: float, why: str, *, placement: str = "") -> None:
    """Refuse ``limit`` when ``need`` (the least any schedule of the placement holds) does not fit it.

    Raises:
        ScheduleError: ``memory_limit L is below the minimum N[ for the P placement]: <why>``.
    """
    if not fits(need, limit):
        where = f" for the {placement} placement" if placement else ""
        raise ScheduleError(f"memory_limit {limit:g} is below the minimum {need:g}{where}: {why}")

"""Input checks and warm-up estimates shared by the cost-aware generators.

Units: times in the unit of the costs. The memory-limit rule is :mod:`..limits`.
"""

from __future__ import annotations

import math
import operator
from typing import Literal, Sequence

from ..costs import CostModel, StageCosts
from ..ir import ScheduleError

__all__ = ["check_count", "check_cost_model", "first_b_caps"]


def check_count(what: str, value: object) -> int:
    """``value`` as an ``int >= 1`` (any integer type but ``bool``); else a :class:`ScheduleError` naming ``what``."""
    if isinstance(value, bool):
        raise ScheduleError(f"{what} must be an integer >= 1, got {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise ScheduleError(f"{what} must be an integer >= 1, got {value!r}") from None
    if n < 1:
        raise ScheduleError(f"{what} must be an integer >= 1, got {n}")
    return n


def check_cost_model(costs: object) -> CostModel:
    """``costs`` if it is a :class:`~..costs.CostModel`, else a :class:`ScheduleError`."""
    if not isinstance(costs, CostModel):
        raise ScheduleError(f"costs must be a CostModel, got {type(costs).__name__}")
    return costs


def first_b_caps(stage_to_rank: Sequence[int], sc: StageCosts, m: int, *,
                 rounding: Literal["floor", "ceil", "floor+1"]) -> tuple[int, ...]:
    """Per rank, how many forwards of its first stage fit before its first ``B`` can arrive.

    The time is microbatch 0's forward from the rank's first stage to the last stage and its
    input gradient back to the rank's last stage (``t_comm`` per hop between ranks), divided by
    ``t_f`` of the rank's first stage; ``rounding`` turns that ratio into a count (``floor``: those
    that fit, ``ceil`` or ``floor+1``: one more, overlapping the arrival), clipped to ``1..m``.
    """
    s2r = list(stage_to_rank)
    n = len(s2r)
    caps = []
    for r in range(max(s2r) + 1):
        local = [s for s in range(n) if s2r[s] == r]
        t = 0.0
        for s in range(local[0], n):            # microbatch 0's forward from the first stage to the end ...
            t += sc.t_f[s] + (sc.t_comm if s + 1 < n and s2r[s + 1] != s2r[s] else 0.0)
        for s in range(n - 1, local[-1], -1):   # ... and its backward back to this rank
            t += sc.t_b[s] + (sc.t_comm if s2r[s - 1] != s2r[s] else 0.0)
        ratio = t / sc.t_f[local[0]]
        if rounding == "floor":
            k = math.floor(ratio + 1e-9)
        elif rounding == "ceil":
            k = math.ceil(ratio - 1e-9)
        else:
            k = math.floor(ratio + 1e-9) + 1
        caps.append(max(1, min(m, k)))
    return tuple(caps)

"""Schedule library: one IR (:mod:`.ir`), one timing kernel (:mod:`.timing`) behind the simulator
and the cost-aware generators, the generators (:mod:`.generators`, looked up by name in
:mod:`.registry`), lowering, plots."""

from .costs import CostModel, StageCosts
from .ir import (Action, Op, Placement, Schedule, ScheduleError, dump, interleaved_placement, load, plain_placement,
                 v_placement, validate)
from .lowering import check_lowered, lower
from .simulator import DeadlockError, MemoryLimitError, SimResult, simulate

__all__ = [
    "Action", "CostModel", "Op", "Placement", "DeadlockError", "MemoryLimitError", "Schedule", "ScheduleError", "SimResult",
    "StageCosts", "check_lowered", "dump", "interleaved_placement", "load", "lower", "plain_placement",
    "simulate", "v_placement", "validate",
]

"""A cost- and memory-aware simulator for schedules in the IR.

Semantics (the zero-bubble paper's model, implemented once in :mod:`.timing`): each rank runs its
actions in list order, one at a time, each as soon as its inputs are done; ``F(i, s)`` waits for
``F(i, s-1)``; ``B(i, s)`` / ``BW(i, s)`` wait for ``F(i, s)`` and for the input-gradient backward
of ``(i, s+1)``; ``W(i, s)`` waits for ``B(i, s)``; a dependency between two different ranks adds
``t_comm`` (latency; it does not occupy either rank). Communication actions of a lowered schedule
are ignored: transfers are modelled this way.

Memory: ``F`` allocates ``mem_b``; ``B`` changes the held memory by ``mem_w - mem_b`` (frees, or
allocates when ``mem_w > mem_b``); ``W`` frees ``mem_w``; ``BW`` frees ``mem_b``. The peak is taken
over each rank's action order, after every action (so also right after an allocating ``B``).

Vocabulary passes (``IF``, ``S``, ``T``, ``IB``; schedules with ``vocab_barriers`` 1 or 2) are
timed with ``costs.vocab`` and their collectives as barriers across ranks (:mod:`.timing`); ``S``
allocates ``vocab.mem_s`` and ``T`` frees it.

Data-parallel reduce (opt-in: ``costs.dp_reduce``, a :class:`~.dp_reduce.DPReduceModel`; default
``None`` models none): each rank's gradient buckets are reduced as :mod:`.timing` describes, and a
rank's iteration ends when its compute and its reduce are both done, so ``total_time``, ``span``,
``makespan`` and ``bubble_rate`` include the exposed reduce; :attr:`SimResult.reduce` lists the
buckets and :attr:`SimResult.compute_time` is the compute's end alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from .costs import CostModel, StageCosts
from .ir import Schedule, ScheduleError, validate
from .timing import Bucket, DeadlockError, Timeline, encode
from .wgrad_groups import check_wgrad_groups

__all__ = ["DeadlockError", "MemoryLimitError", "SimResult", "deadlocks", "simulate"]


class MemoryLimitError(ScheduleError):
    """A rank's activation memory exceeds the cost model's ``memory_limit``."""


@dataclass
class SimResult:
    """What the simulator predicts for one iteration.

    Attributes:
        schedule: the simulated (compute-only) schedule.
        start, end: per rank, start/end time of each action, aligned with ``schedule.ranks``.
        total_time: time from 0 (first action of rank 0) to the end of the last action on any
            rank: one isolated iteration, as when an optimizer step synchronises all ranks. With
            ``costs.dp_reduce``: to the end of the last rank's compute *and* reduce.
        span: per rank, end of its last action (or of its reduce, when later) minus start of its
            first action.
        makespan: ``max(span)``, the zero-bubble paper's "cost" (the largest execution time of
            any stage): the iteration period once consecutive iterations may overlap across
            ranks, which optimizer post-validation allows. Equal to ``total_time`` for every
            schedule whose rank 0 starts first and finishes last (1F1B, ZB-H1, ...).
        busy: per rank, total compute time.
        peak_memory: per rank, peak held activation memory (units of ``mem_b``).
        reduce: with ``costs.dp_reduce``, per rank its buckets ``(stage, ready, start, end)`` in
            launch order (overlapped or serial, as the model says); ``None`` without.
        bubble_rate: ``(makespan - max(busy)) / makespan`` -- the zero-bubble paper's definition,
            with the busiest rank's work standing for ``m * (T_F + T_B + T_W)``.
    """

    schedule: Schedule
    costs: StageCosts
    start: list[list[float]]
    end: list[list[float]]
    total_time: float
    busy: list[float]
    peak_memory: list[float]
    reduce: list[list[Bucket]] | None = None

    @property
    def span(self) -> list[float]:
        ends = self.rank_end
        return [(t - s[0]) if s else 0.0 for s, t in zip(self.start, ends)]

    @property
    def rank_end(self) -> list[float]:
        """Per rank, the end of its last action, or of its last bucket reduce when later."""
        ends = [e[-1] if e else 0.0 for e in self.end]
        if self.reduce is None:
            return ends
        return [max([t] + [b[3] for b in bs]) for t, bs in zip(ends, self.reduce)]

    @property
    def compute_time(self) -> float:
        """End of the last compute action on any rank (``total_time`` without the reduce)."""
        return max((e[-1] for e in self.end if e), default=0.0)

    @property
    def exposed_reduce(self) -> list[float]:
        """Per rank, reduce time after its last compute action (zeros without ``dp_reduce``)."""
        return [t - (e[-1] if e else 0.0) for t, e in zip(self.rank_end, self.end)]

    @property
    def makespan(self) -> float:
        return max(self.span)

    @property
    def bubble_rate(self) -> float:
        return (self.makespan - max(self.busy)) / self.makespan if self.makespan > 0 else 0.0

    @property
    def idle_fraction(self) -> list[float]:
        """Per rank, the fraction of ``total_time`` spent not computing."""
        return [(self.total_time - b) / self.total_time if self.total_time else 0.0 for b in self.busy]

    @property
    def max_peak_memory(self) -> float:
        return max(self.peak_memory)

    def summary(self) -> str:
        mem = ", ".join(f"{x:g}" for x in self.peak_memory)
        dp = "" if self.reduce is None else (
            f", DP reduce exposed up to {max(self.exposed_reduce):.4g} (compute alone {self.compute_time:.4g})")
        return (f"schedule {self.schedule.name or '?'}: makespan {self.makespan:.4g} "
                f"(isolated iteration {self.total_time:.4g}), "
                f"bubble rate {self.bubble_rate:.4f}, peak activation memory per rank [{mem}]{dp}")


def simulate(schedule: Schedule, costs: CostModel | StageCosts, *, enforce_memory: bool = True,
             check: bool = True) -> SimResult:
    """Simulate one iteration of ``schedule`` under ``costs``.

    Args:
        schedule: any schedule in the IR (communication actions are ignored).
        costs: a :class:`CostModel` (resolved for the schedule's stages) or resolved costs.
        enforce_memory: raise :class:`MemoryLimitError` when a rank exceeds ``memory_limit``.
        check: validate the schedule first.

    Raises:
        ScheduleError: the schedule is invalid (``check=True``), or the costs' reduce is per weight-gradient
            group (``dp_reduce.wgrad_group``) and the schedule's ``W``'s are not grouped so.
        DeadlockError: no rank can proceed; the message lists each rank's blocked action.
        MemoryLimitError: a rank exceeds the memory limit (``enforce_memory=True``).
    """
    sched = schedule.compute_only() if any(not a.is_compute for _, _, a in schedule.actions()) else schedule
    if check:
        validate(sched)
    sc = costs.resolve(sched.num_stages) if isinstance(costs, CostModel) else costs
    if len(sc.t_f) != sched.num_stages:
        raise ScheduleError(f"costs are resolved for {len(sc.t_f)} stages, schedule has {sched.num_stages}")
    if sc.dp_reduce is not None and sc.dp_reduce.wgrad_group is not None:
        check_wgrad_groups(sched, sc.dp_reduce.wgrad_group)  # the reduce per group times groups back to back
    timeline = Timeline(sched.stage_to_rank, sched.num_microbatches, sc, num_ranks=sched.num_ranks,
                        vocab_barriers=sched.vocab_barriers)
    orders = [[encode(a) for a in acts] for acts in sched.ranks]
    start, end = timeline.play(orders, record=True)
    peaks = timeline.peak
    over = [(r, i) for r, i in enumerate(timeline.over) if i >= 0]
    if enforce_memory and over:
        r, i = over[0]
        raise MemoryLimitError(
            f"rank {r} action #{i} {sched.ranks[r][i]} brings activation memory above the limit "
            f"{sc.memory_limit:g} (peak on that rank {peaks[r]:g})")
    dur = timeline.duration
    busy = [sum(dur[op][s] for op, _, s in seq) for seq in orders]
    reduce = None if sc.dp_reduce is None else [timeline.reduce_buckets(r) for r in range(sched.num_ranks)]
    return SimResult(sched, sc, start, end, timeline.total_time(), busy, peaks, reduce)


def deadlocks(schedule: Schedule) -> bool:
    """True when the per-rank orders of ``schedule`` can never all finish (cost-independent)."""
    try:
        simulate(schedule, CostModel(), enforce_memory=False, check=False)
    except DeadlockError:
        return True
    return False

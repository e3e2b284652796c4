"""The data-parallel gradient reduce of one iteration, predicted from a simulated schedule.

Consumes a :class:`~megatron_zb.schedules.simulator.SimResult` (the timing rules live in the
simulator only) and adds what megatron-zb's runtime does with ``--overlap-grad-reduce``
(:mod:`megatron_zb.runtime.grad_sync`): each stage's gradient buffer is split into buckets
(:class:`DPReduceModel`); a stage's buckets become ready during its last weight-gradient action
(the last ``W``, or the last ``BW`` when the stage runs no ``W``), in bucket order and in
proportion to their bytes -- the runtime reports each weight right after its last W entry,
and megatron-core orders buckets from the last layer back, the order a W computes them in;
each rank then reduces its ready buckets one after the other on one data-parallel channel
(``latency + bytes / bandwidth`` each). Without overlap, every bucket of the rank is reduced
after its last compute action. The iteration ends when the last rank has finished computing
*and* reducing.

Times are in the simulator's unit (e.g. ms when the costs are in ms); ``bandwidth`` is bytes
per that unit. :func:`reduce_aware_tail` reorders each rank's trailing ``W`` actions (all
their B's have run, so any order is valid) stage by stage when that shortens the predicted
iteration: on a V or interleaved rank, finishing one chunk's W's first lets its buckets reduce
while the other chunk's W's still run.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Sequence

from .ir import Action, Op, Schedule
from .simulator import SimResult, simulate

__all__ = ["DPReduceModel", "DPReduceResult", "RankReduce", "reduce_aware_tail", "simulate_dp_reduce"]


@dataclass(frozen=True)
class DPReduceModel:
    """Sizes and speed of the data-parallel reduce.

    Attributes:
        stage_bytes: gradient bytes of each stage (index = stage).
        bucket_bytes: bucket size in bytes (``--ddp-bucket-size`` x element size); ``None``: one
            bucket per stage. Every stage is split alike here (megatron-core keeps one bucket on
            pipeline ranks after the first: model those with ``None``).
        bandwidth: bytes per time unit of the data-parallel collective (algorithm bandwidth).
        latency: fixed time per bucket collective.
    """

    stage_bytes: Sequence[float]
    bucket_bytes: float | None
    bandwidth: float
    latency: float = 0.0

    def buckets(self, stage: int) -> list[float]:
        """Bucket sizes (bytes) of ``stage``, in the order they become ready."""
        total = float(self.stage_bytes[stage])
        if self.bucket_bytes is None or self.bucket_bytes >= total:
            return [total]
        n = int(total // self.bucket_bytes)
        sizes = [float(self.bucket_bytes)] * n
        if total - n * self.bucket_bytes > 0:
            sizes.append(total - n * self.bucket_bytes)
        return sizes

    def reduce_time(self, nbytes: float) -> float:
        """Time of one bucket's collective."""
        return self.latency + nbytes / self.bandwidth


@dataclass
class RankReduce:
    """One rank's predicted reduce: ``(stage, ready, start, end)`` per bucket, in launch order."""

    rank: int
    compute_end: float
    buckets: list[tuple[int, float, float, float]] = field(default_factory=list)

    @property
    def reduce_end(self) -> float:
        return max([self.compute_end] + [b[3] for b in self.buckets])

    @property
    def exposed(self) -> float:
        """Reduce time after the rank's last compute action."""
        return self.reduce_end - self.compute_end

    @property
    def total(self) -> float:
        """Sum of the rank's bucket reduce times."""
        return sum(b[3] - b[2] for b in self.buckets)


@dataclass
class DPReduceResult:
    """The prediction with and without overlap.

    Attributes:
        sim: the compute-only simulation.
        overlapped, serial: per rank, the reduce with ``--overlap-grad-reduce`` and without.
    """

    sim: SimResult
    overlapped: list[RankReduce]
    serial: list[RankReduce]

    @property
    def time_overlapped(self) -> float:
        """Predicted iteration time with overlap (compute and reduce of every rank done)."""
        return max(r.reduce_end for r in self.overlapped)

    @property
    def time_serial(self) -> float:
        """Predicted iteration time with the whole reduce after each rank's compute."""
        return max(r.reduce_end for r in self.serial)

    @property
    def hideable(self) -> float:
        """Iteration time the overlap saves in the prediction."""
        return self.time_serial - self.time_overlapped

    def summary(self) -> str:
        exposed = max(r.exposed for r in self.overlapped)
        return (f"DP reduce: iteration {self.time_serial:.3g} without overlap, {self.time_overlapped:.3g} with "
                f"(compute only {self.sim.total_time:.3g}; exposed reduce {exposed:.3g}, hidden {self.hideable:.3g})")


def _ready_times(sim: SimResult, rank: int, model: DPReduceModel) -> list[tuple[int, float, float]]:
    """``(stage, ready time, bytes)`` of every bucket of ``rank``'s stages."""
    acts, start, end = sim.schedule.ranks[rank], sim.start[rank], sim.end[rank]
    last: dict[int, int] = {}
    for i, a in enumerate(acts):
        if a.op is Op.W or (a.op is Op.BW and not any(b.op is Op.W and b.stage == a.stage for b in acts)):
            last[a.stage] = i
    out = []
    for stage, i in last.items():
        sizes = model.buckets(stage)
        total, done = sum(sizes), 0.0
        for size in sizes:
            done += size
            out.append((stage, start[i] + (end[i] - start[i]) * done / total, size))
    return sorted(out, key=lambda x: x[1])


def _channel(rank: int, compute_end: float, ready: list[tuple[int, float, float]], model: DPReduceModel,
             *, overlap: bool) -> RankReduce:
    r = RankReduce(rank=rank, compute_end=compute_end)
    free = 0.0
    for stage, t, size in ready:
        begin = max(t if overlap else compute_end, free)
        free = begin + model.reduce_time(size)
        r.buckets.append((stage, t, begin, free))
    return r


def simulate_dp_reduce(sim: SimResult, model: DPReduceModel) -> DPReduceResult:
    """Predict the data-parallel reduce of ``sim``'s iteration with and without overlap."""
    over, serial = [], []
    for rank in range(sim.schedule.num_ranks):
        compute_end = sim.end[rank][-1] if sim.end[rank] else 0.0
        ready = _ready_times(sim, rank, model)
        over.append(_channel(rank, compute_end, ready, model, overlap=True))
        serial.append(_channel(rank, compute_end, ready, model, overlap=False))
    return DPReduceResult(sim=sim, overlapped=over, serial=serial)


def _with_tail_order(schedule: Schedule, rank: int, order: Sequence[int]) -> Schedule | None:
    """``schedule`` with ``rank``'s trailing W's regrouped stage by stage in ``order`` (None: no tail)."""
    acts = list(schedule.ranks[rank])
    k = len(acts)
    while k > 0 and acts[k - 1].op is Op.W:
        k -= 1
    tail = acts[k:]
    if len({a.stage for a in tail}) < 2:
        return None
    new_tail: list[Action] = [a for s in order for a in tail if a.stage == s]
    ranks = [list(r) for r in schedule.ranks]
    ranks[rank] = acts[:k] + new_tail
    return dataclasses.replace(schedule, ranks=ranks)


def reduce_aware_tail(schedule: Schedule, costs: object, model: DPReduceModel) -> tuple[Schedule, DPReduceResult]:
    """The schedule whose trailing W's (per rank, regrouped by stage) give the shortest predicted
    iteration with overlap; ``schedule`` itself unless a reordering is strictly shorter."""
    best = schedule
    best_res = simulate_dp_reduce(simulate(schedule, costs), model)
    for rank in range(schedule.num_ranks):
        stages = sorted({a.stage for a in best.ranks[rank] if a.op is Op.W})
        for order in itertools.permutations(stages):
            cand = _with_tail_order(best, rank, order)
            if cand is None:
                break
            res = simulate_dp_reduce(simulate(cand, costs), model)
            if res.time_overlapped < best_res.time_overlapped - 1e-12:
                best, best_res = cand, res
    return best, best_res

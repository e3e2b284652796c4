"""The data-parallel gradient reduce of one iteration: its model, and predictions built on it.

:class:`DPReduceModel` (defined in :mod:`.costs`, whose :class:`~.costs.CostModel` holds it) describes what megatron-zb's runtime does with ``--overlap-grad-reduce``
(:mod:`megatron_zb.runtime.grad_sync`): each stage's gradient buffer is split into buckets; a
stage's buckets become ready during its last weight-gradient action, in bucket order and in
proportion to their bytes -- the runtime reports each weight right after its last W entry, and
megatron-core orders buckets from the last layer back, the order a W computes them in; each rank
reduces its ready buckets one after the other on one data-parallel channel (``latency + bytes /
bandwidth`` each). Without overlap every bucket of a rank is reduced after its last compute
action. The timing rules live once, in :class:`~.timing.Timeline`; a model is switched on by
putting it in :attr:`.costs.CostModel.dp_reduce` (off by default), after which
:func:`~.simulator.simulate` and every generator that times candidates through the kernel count
the reduce in a rank's end.

Units: times in the simulator's unit (e.g. ms when the costs are in ms); ``bandwidth`` is bytes
per that unit; sizes in bytes.

This module adds the comparisons: :func:`simulate_dp_reduce` predicts an iteration with and
without overlap, and :func:`reduce_aware_tail` regroups each rank's trailing ``W`` actions (all
their B's have run, so any order is valid) stage by stage when that shortens the predicted
iteration: on a V or interleaved rank, finishing one chunk's W's first lets its buckets reduce
while the other chunk's W's still run. (On the plain placement a rank has one stage, so the
order of its W's does not change when its buckets are ready.) :func:`overlapped_reduce_tail` is
how the V family and ``interleaved-zb`` call it: only when the costs hold an overlapped reduce.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Sequence

from .costs import CostModel, DPReduceModel, StageCosts
from .ir import Action, Op, Schedule, ScheduleError
from .simulator import SimResult, simulate
from .timing import Bucket

__all__ = ["DPReduceModel", "DPReduceResult", "RankReduce", "overlapped_reduce_tail", "reduce_aware_tail",
           "simulate_dp_reduce"]


@dataclass
class RankReduce:
    """One rank's predicted reduce: ``(stage, ready, start, end)`` per bucket, in launch order."""

    rank: int
    compute_end: float
    buckets: list[Bucket] = field(default_factory=list)

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
        sim, serial_sim: the simulations with the overlapped and the serial reduce.
        overlapped, serial: per rank, the reduce with ``--overlap-grad-reduce`` and without.
    """

    sim: SimResult
    serial_sim: SimResult
    overlapped: list[RankReduce]
    serial: list[RankReduce]

    @property
    def time_overlapped(self) -> float:
        """Predicted iteration time with overlap (compute and reduce of every rank done)."""
        return self.sim.total_time

    @property
    def time_serial(self) -> float:
        """Predicted iteration time with the whole reduce after each rank's compute."""
        return self.serial_sim.total_time

    @property
    def hideable(self) -> float:
        """Iteration time the overlap saves in the prediction."""
        return self.time_serial - self.time_overlapped

    def summary(self) -> str:
        exposed = max(r.exposed for r in self.overlapped)
        return (f"DP reduce: iteration {self.time_serial:.4g} without overlap, {self.time_overlapped:.4g} with "
                f"(compute only {self.sim.compute_time:.4g}; exposed reduce {exposed:.4g}, "
                f"hidden {self.hideable:.4g})")


def _ranks(sim: SimResult) -> list[RankReduce]:
    return [RankReduce(rank=r, compute_end=e[-1] if e else 0.0, buckets=list(b))
            for r, (e, b) in enumerate(zip(sim.end, sim.reduce or [[] for _ in sim.end]))]


def _with_model(costs: CostModel | StageCosts, model: DPReduceModel) -> CostModel | StageCosts:
    """``costs`` with ``model`` as its reduce (resolved for resolved costs)."""
    if isinstance(costs, CostModel):
        return dataclasses.replace(costs, dp_reduce=model)
    return dataclasses.replace(costs, dp_reduce=model.resolve(len(costs.t_f)))


def simulate_dp_reduce(sim: SimResult, model: DPReduceModel | None = None) -> DPReduceResult:
    """Predict the data-parallel reduce of ``sim``'s schedule with and without overlap.

    ``model`` defaults to ``sim.costs.dp_reduce`` (its ``overlap`` is ignored: both are predicted).
    """
    model = model if model is not None else sim.costs.dp_reduce
    if model is None:
        raise ScheduleError("simulate_dp_reduce needs a DPReduceModel (none given, none in the costs)")
    over = simulate(sim.schedule, _with_model(sim.costs, dataclasses.replace(model, overlap=True)),
                    enforce_memory=False, check=False)
    serial = simulate(sim.schedule, _with_model(sim.costs, dataclasses.replace(model, overlap=False)),
                      enforce_memory=False, check=False)
    return DPReduceResult(sim=over, serial_sim=serial, overlapped=_ranks(over), serial=_ranks(serial))


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


def reduce_aware_tail(schedule: Schedule, costs: CostModel | StageCosts,
                      model: DPReduceModel | None = None) -> tuple[Schedule, DPReduceResult]:
    """The schedule whose trailing W's (per rank, regrouped by stage) give the shortest predicted
    iteration with overlap; ``schedule`` itself unless a reordering is strictly shorter.
    ``model`` defaults to ``costs.dp_reduce``."""
    model = model if model is not None else costs.dp_reduce
    if model is None:
        raise ScheduleError("reduce_aware_tail needs a DPReduceModel (none given, none in the costs)")
    over = _with_model(costs, dataclasses.replace(model, overlap=True))
    best, best_time = schedule, simulate(schedule, over).total_time
    for rank in range(schedule.num_ranks):
        stages = sorted({a.stage for a in best.ranks[rank] if a.op is Op.W})
        for order in itertools.permutations(stages):
            cand = _with_tail_order(best, rank, order)
            if cand is None:
                break
            t = simulate(cand, over, check=False).total_time
            if t < best_time - 1e-12 * max(1.0, abs(best_time)):
                best, best_time = cand, t
    return best, simulate_dp_reduce(simulate(best, over), model)


def overlapped_reduce_tail(schedule: Schedule, costs: CostModel | StageCosts) -> Schedule:
    """What a generator returns for ``schedule`` under ``costs``: :func:`reduce_aware_tail`'s
    schedule when ``costs.dp_reduce`` is an overlapped reduce, else ``schedule`` itself (no reduce,
    or a serial one, which starts after the rank's compute whatever the order of its W's). The
    result ``is schedule`` unless the regrouping is strictly shorter."""
    if costs.dp_reduce is None or not costs.dp_reduce.overlap:
        return schedule
    return reduce_aware_tail(schedule, costs)[0]

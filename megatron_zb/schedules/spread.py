"""The iteration time when action durations vary: Monte Carlo over a measured duration spread.

The simulator gives every action of one ``(op, stage)`` the same duration. Measured durations vary
from one action to the next (on the 2-core CPU machine 10-40% around the median at hidden 256), and
an iteration waits at every cross-rank dependency for the *later* of two actions, so the typical
iteration is longer than the iteration of the typical durations (Jensen's inequality: the expected
maximum exceeds the maximum of the expectations). Measured on a PP=2 ZB-H1 run, hidden 256: the
simulation with the median durations predicted 0.95 of the median iteration; replaying each
iteration with its own recorded action durations gave 0.99-1.00, and so did drawing them from
the measured distribution (docs/planning.md).

:class:`DurationSpread` describes the variation as quantiles of ``duration / median`` per compute op
(pooled over stages: dimensionless, so it applies to any stage layout and placement);
:func:`simulate_spread` draws every action's duration independently from it (seeded, so a
prediction is reproducible), plays the schedule through the timing kernel
(:class:`~.timing.Timeline` with ``per_action``) and returns the median and the 10th / 90th
percentiles of the makespan over the draws.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from typing import Mapping, Sequence

from .costs import CostModel, StageCosts
from .ir import Op, Schedule, ScheduleError
from .timing import OPS, Timeline, encode

__all__ = ["DurationSpread", "SpreadResult", "simulate_spread"]

LEVELS = 20
"""Quantiles a spread keeps per op: levels 0.025, 0.075, ..., 0.975 (the middle of each 5% band)."""


@dataclass(frozen=True)
class DurationSpread:
    """Measured variation of one compute action's duration around its ``(op, stage)`` median.

    Attributes:
        quantiles: per op (``Op.F``, ``Op.B``, ``Op.W``, and ``Op.BW`` for a backward measured
            fused), ascending quantiles of ``duration / median``
            at the middles of ``n`` equally likely bands, levels ``(k + 0.5) / n`` (dimensionless;
            at least 1 value, all > 0). A draw picks one of them with equal probability, so a rare
            outlier weighs as the top band's middle and no more. An op without an entry does not
            vary (factor 1).
    """

    quantiles: Mapping[Op, tuple[float, ...]]

    def __post_init__(self) -> None:
        for op, q in self.quantiles.items():
            if not Op(op).is_compute:
                raise ScheduleError(f"duration spread of {op}: only compute actions (F, B, W, BW) vary")
            if not q or any(not x > 0 for x in q) or any(b < a for a, b in zip(q, q[1:])):
                raise ScheduleError(f"duration spread of {op}: need ascending quantiles > 0, got {list(q)}")

    @classmethod
    def from_samples(cls, samples: Mapping[Op, Sequence[Sequence[float]]], *, levels: int = LEVELS) -> "DurationSpread":
        """The spread of measured durations: ``samples[op]`` holds one list of durations per stage (any
        unit); each is divided by its own median, then the pooled ratios give ``levels`` quantiles
        at levels ``(k + 0.5) / levels`` (linear interpolation between order statistics). Ops without
        samples are left out."""
        out: dict[Op, tuple[float, ...]] = {}
        for op, per_stage in samples.items():
            ratios = sorted(x / med for xs in per_stage if xs and (med := statistics.median(xs)) > 0 for x in xs)
            if ratios:
                out[Op(op)] = tuple(_interpolate(ratios, (k + 0.5) / levels) for k in range(levels))
        return cls(out)

    def factor(self, op: Op, u: float) -> float:
        """The duration factor of a draw ``u`` in [0, 1): the quantile of band ``floor(u * n)``."""
        q = self.quantiles.get(op)
        return 1.0 if q is None else q[min(int(u * len(q)), len(q) - 1)]


def _interpolate(xs: Sequence[float], u: float) -> float:
    """Value at level ``u`` in [0, 1] of ascending ``xs`` (levels equally spaced), linear in between."""
    pos = u * (len(xs) - 1)
    i = min(int(pos), len(xs) - 2) if len(xs) > 1 else 0
    return xs[i] if len(xs) == 1 else xs[i] + (xs[i + 1] - xs[i]) * (pos - i)


@dataclass(frozen=True)
class SpreadResult:
    """Makespan of one iteration over the draws (unit of the costs).

    Attributes:
        median: median makespan over the draws (the prediction).
        low / high: 10th / 90th percentile.
        draws: how many iterations were drawn.
    """

    median: float
    low: float
    high: float
    draws: int


def simulate_spread(schedule: Schedule, costs: CostModel | StageCosts, spread: DurationSpread, *,
                    action_overhead: float = 0.0, draws: int = 64, seed: int = 0) -> SpreadResult:
    """Makespan of ``schedule`` with every action's duration drawn from ``spread`` (module doc).

    One action lasts ``median x factor + action_overhead``: ``costs`` give the medians (compute
    only, without the overhead); a fused ``BW`` lasts its duration (``t_bw``, else ``t_b + t_w``)
    x a factor of the spread's ``BW`` entry when it has one (a backward measured fused), else its
    ``B`` and ``W`` parts drawn independently (``t_bw`` unused); it pays the overhead once. ``draws`` iterations from
    ``random.Random(seed)``; memory is not checked (the durations do not change what is held).
    """
    if draws < 1:
        raise ScheduleError(f"draws must be >= 1, got {draws}")
    sched = schedule.compute_only()
    sc = costs.resolve(sched.num_stages) if isinstance(costs, CostModel) else costs
    n, m = sched.num_stages, sched.num_microbatches
    table = [[[0.0] * m for _ in range(n)] for _ in OPS]  # [op code][stage][mb], refilled per draw
    tl = Timeline(sched.stage_to_rank, m, sc, num_ranks=sched.num_ranks, per_action=table,
                  vocab_barriers=sched.vocab_barriers)  # refuses a schedule with vocabulary passes
    orders = [[encode(a) for a in acts] for acts in sched.ranks]
    rng = random.Random(seed)
    spans = []
    for _ in range(draws):
        _draw(table, sc, spread, rng, action_overhead)
        tl.reset()
        tl.play(orders)
        spans.append(tl.makespan())
    spans.sort()
    return SpreadResult(statistics.median(spans), _interpolate(spans, 0.1), _interpolate(spans, 0.9), draws)


def _draw(table: list[list[list[float]]], sc: StageCosts, spread: DurationSpread, rng: random.Random,
          overhead: float) -> None:
    """Fill ``table[op code][stage][mb]`` with one draw of every action's duration (see :func:`simulate_spread`)."""
    m = len(table[0][0])
    part = {op: [[t * spread.factor(op, rng.random()) for _ in range(m)] for t in base]
            for op, base in ((Op.F, sc.t_f), (Op.B, sc.t_b), (Op.W, sc.t_w))}
    fused = Op.BW in spread.quantiles
    for k, op in enumerate(OPS):
        for s in range(len(sc.t_f)):
            if op != Op.BW:
                row = part[op][s]
            elif fused:
                row = [sc.duration(Op.BW, s) * spread.factor(Op.BW, rng.random()) for _ in range(m)]
            else:
                row = [b + w for b, w in zip(part[Op.B][s], part[Op.W][s])]
            table[k][s][:] = [x + overhead for x in row]

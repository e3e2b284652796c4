"""The memory-limit rule (megatron_zb/schedules/limits.py), as every cost-aware generator applies it.

Resolution: the ``memory_limit`` argument, else ``costs.memory_limit``, else the schedule's own
default (the expected defaults are worked by hand below); no activation memory at all means no
limit. "Fits": the generators' refusals and the simulator's check are the same comparison, so a
limit a hair under the minimum (within the slack) is accepted by both, and one clearly under is
refused by the generator.
"""

from __future__ import annotations

import math

import pytest

from megatron_zb.schedules import CostModel, MemoryLimitError, ScheduleError, simulate
from megatron_zb.schedules.generators.baselines import interleaved_1f1b
from megatron_zb.schedules.generators.greedy import zb_greedy
from megatron_zb.schedules.limits import MEMORY_SLACK, count_that_fit, fits, resolve_limit
from megatron_zb.schedules.registry import build_schedule

P, M = 4, 6
COSTS = CostModel(t_f=1.0, t_b=1.2, t_w=0.8, t_comm=0.1, mem_b=2.0, mem_w=0.8)
# By hand, mem_b = 2 per stage, p = 4:
#   plain (one stage per rank): p * max(mem_b) = 8 (zb, zb-1p), 2p * max(mem_b) = 16 (zb-2p);
#   V (8 chunks of 2): R = max_r (p - r) (mem_b[2r] + mem_b[2r+1]) = 4 * 4 = 16, M = 2 + 2 = 4;
#     zbv R = 16; v-half (p/2 + 1)/p R = 3/4 * 16 = 12; v-min (p/3 + 1.5)/p R = (17/6)/4 * 16 = 34/3.
DEFAULTS = {"zb": 8.0, "zb-1p": 8.0, "zb-2p": 16.0, "zbv": 16.0, "v-half": 12.0, "v-min": 34 / 3}
MINIMUM = {"zb": 2.0, "zb-1p": 2.0, "zb-2p": 2.0, "zbv": 4.0, "v-half": 4.0, "v-min": 4.0, "interleaved-zb": 4.0}


@pytest.mark.parametrize("name", list(MINIMUM))
def test_resolution_order_argument_then_costs_then_default(name):
    explicit = build_schedule(name, num_ranks=P, num_microbatches=M, costs=COSTS.with_limit(9.0), memory_limit=10.0)
    assert explicit.meta["memory_limit"] == 10.0
    from_costs = build_schedule(name, num_ranks=P, num_microbatches=M, costs=COSTS.with_limit(9.0))
    assert from_costs.meta["memory_limit"] == 9.0
    default = build_schedule(name, num_ranks=P, num_microbatches=M, costs=COSTS).meta["memory_limit"]
    if name == "interleaved-zb":   # interleaved 1F1B's peak under the same costs
        assert default == simulate(interleaved_1f1b(num_ranks=P, num_microbatches=M, num_chunks=2),
                                   COSTS, enforce_memory=False).max_peak_memory
    else:
        assert default == pytest.approx(DEFAULTS[name], rel=1e-12)


def test_zb_greedy_called_directly_defaults_to_zb_2p():
    assert zb_greedy(num_ranks=P, num_microbatches=M, costs=COSTS).meta["memory_limit"] == 16.0


@pytest.mark.parametrize("name", list(MINIMUM))
def test_no_activation_memory_means_no_limit(name):
    sched = build_schedule(name, num_ranks=P, num_microbatches=M, costs=CostModel(mem_b=0.0))
    assert sched.meta["memory_limit"] == math.inf


@pytest.mark.parametrize("name", list(MINIMUM))
def test_generator_and_simulator_agree_at_the_minimum(name):
    low = MINIMUM[name]
    hair = low * (1 - MEMORY_SLACK / 2)   # under the minimum by less than the slack: fits
    sched = build_schedule(name, num_ranks=P, num_microbatches=M, costs=COSTS, memory_limit=hair)
    simulate(sched, COSTS.with_limit(hair))  # the simulator accepts what the generator built
    with pytest.raises(MemoryLimitError):
        simulate(sched, COSTS.with_limit(low * (1 - 1e-6)))
    with pytest.raises(ScheduleError, match=f"below the minimum {low:g}"):
        build_schedule(name, num_ranks=P, num_microbatches=M, costs=COSTS, memory_limit=low * (1 - 1e-6))


def test_fits_and_count_worked_by_hand():
    assert fits(4.0, 4.0) and fits(4.0 + 4e-9, 4.0) and not fits(4.0 + 6e-9, 4.0)  # slack 4e-9 + 1e-9
    assert fits(1e30, None) and fits(1e30, math.inf)
    assert count_that_fit(10.0, 2.5) == 4 and count_that_fit(9.99, 2.5) == 3 and count_that_fit(3 * 0.1, 0.1) == 3
    with pytest.raises(ScheduleError, match="must be > 0"):
        resolve_limit(0.0, COSTS, 8.0)
    assert resolve_limit(None, COSTS, 0.0) == math.inf


# B allocates (mem_w > mem_b: with sequence parallelism what each W keeps can outgrow what F saved).
# By hand, mem_b = 2 and mem_w = 3 per stage, p = 4:
#   plain: one microbatch holds 2 after its F and 3 after its B: minimum max(2, 3) = 3;
#   V and interleaved (two stages q1 < q2 per rank): both F's 4, after B(q2) with q1 still held
#     2 + 3 = 5, after B(q1) 3: minimum 5 (4 when B frees).
ALLOC = CostModel(t_f=1.0, t_b=1.2, t_w=0.8, t_comm=0.1, mem_b=2.0, mem_w=3.0)
ALLOC_MINIMUM = {"zb": 3.0, "zb-1p": 3.0, "zb-2p": 3.0, "zbv": 5.0, "v-half": 5.0, "v-min": 5.0,
                 "interleaved-zb": 5.0}


def _held_after_each_action(sched) -> list[list[tuple[str, float]]]:
    """Per rank, ``(op, memory held after it)`` along the order, from mem_b = 2 and mem_w = 3 by
    hand (F +2, B +1, W -3, BW -2), not from the simulator."""
    delta = {"F": 2.0, "B": 1.0, "W": -3.0, "BW": -2.0}
    out = []
    for row in sched.ranks:
        held, trace = 0.0, []
        for a in row:
            held += delta[str(a.op)]
            trace.append((str(a.op), held))
        out.append(trace)
    return out


@pytest.mark.parametrize("name", list(ALLOC_MINIMUM))
def test_allocating_backward_limit_binds_at_b(name):
    """Every memory-limited generator checks the limit at B as well as at F: at the minimum the
    schedule fits and its peak is reached right after a B; at 1.6 x the minimum it fits too (an F
    is admitted only with room for its B's allocation); below the minimum it is refused."""
    low = ALLOC_MINIMUM[name]
    sched = build_schedule(name, num_ranks=P, num_microbatches=M, costs=ALLOC, memory_limit=low)
    traces = _held_after_each_action(sched)
    peak = max(h for t in traces for _, h in t)
    assert peak == low and all(op == "B" for t in traces for op, h in t if h == peak)
    assert simulate(sched, ALLOC.with_limit(low)).max_peak_memory == low
    wider = build_schedule(name, num_ranks=P, num_microbatches=M, costs=ALLOC, memory_limit=1.6 * low)
    assert max(h for t in _held_after_each_action(wider) for _, h in t) <= 1.6 * low
    with pytest.raises(ScheduleError, match=f"below the minimum {low:g}"):
        build_schedule(name, num_ranks=P, num_microbatches=M, costs=ALLOC, memory_limit=low * (1 - 1e-6))


def test_default_limit_raised_to_the_minimum_when_b_allocates():
    """zb-1p's default p x max(mem_b) is 2 at p = 1, below what one microbatch holds after its B
    (mem_w = 3): the default becomes 3; an explicit 2.5 is refused, not raised."""
    sched = build_schedule("zb-1p", num_ranks=1, num_microbatches=3, costs=ALLOC)
    assert sched.meta["memory_limit"] == 3.0
    assert simulate(sched, ALLOC.with_limit(3.0)).max_peak_memory == 3.0
    with pytest.raises(ScheduleError, match="below the minimum 3: rank 0 must hold one microbatch's weight-gradient"):
        build_schedule("zb-1p", num_ranks=1, num_microbatches=3, costs=ALLOC, memory_limit=2.5)
    assert resolve_limit(None, ALLOC, 2.0, minimum=3.0) == 3.0 and resolve_limit(2.5, ALLOC, 2.0, minimum=3.0) == 2.5

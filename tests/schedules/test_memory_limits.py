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

"""megatron_zb.schedules.spread: measured duration spread and the Monte Carlo makespan.

Expected values are worked out by hand in each docstring (small schedules whose timelines are a
chain of actions), not taken from the simulator.
"""

from __future__ import annotations

import pytest

from megatron_zb.schedules import CostModel, Op, ScheduleError, simulate
from megatron_zb.schedules.registry import build_schedule
from megatron_zb.schedules.spread import DurationSpread, simulate_spread


def test_from_samples_pools_ratios_to_each_stage_median():
    """Stage 0 F durations 1, 2, 3 (median 2) and stage 1 F 10, 20, 30 (median 20) both give the
    ratios 0.5, 1, 1.5; pooled and sorted: 0.5, 0.5, 1, 1, 1.5, 1.5 (positions 0-5). Two bands: levels
    0.25 and 0.75, positions 1.25 and 3.75 -> 0.5 + 0.25 x (1 - 0.5) = 0.625 and 1 + 0.75 x 0.5 = 1.375;
    W has no samples."""
    sp = DurationSpread.from_samples({Op.F: [[3.0, 1.0, 2.0], [10.0, 30.0, 20.0]], Op.W: [[]]}, levels=2)
    assert sp.quantiles == {Op.F: (0.625, 1.375)}
    # levels 1/6, 3/6, 5/6 -> positions 0.833, 2.5, 4.167 -> 0.5, 1.0, 1.5
    assert DurationSpread.from_samples({Op.F: [[3.0, 1.0, 2.0], [10.0, 30.0, 20.0]]}, levels=3).quantiles[Op.F] == \
        pytest.approx((0.5, 1.0, 1.5), rel=1e-12)


def test_factor_picks_the_band_of_the_draw():
    sp = DurationSpread({Op.F: (0.8, 1.0, 1.6)})
    assert [sp.factor(Op.F, u) for u in (0.0, 0.33, 0.34, 0.66, 0.67, 0.999)] == [0.8, 0.8, 1.0, 1.0, 1.6, 1.6]
    assert sp.factor(Op.B, 0.9) == 1.0  # an op without a spread does not vary


@pytest.mark.parametrize("quantiles", [{Op.F: ()}, {Op.F: (1.2, 1.0)}, {Op.B: (0.0, 1.0)}, {Op.SEND_F: (1.0,)}])
def test_invalid_spreads_are_refused(quantiles):
    with pytest.raises(ScheduleError, match="duration spread of"):
        DurationSpread(quantiles)


@pytest.mark.parametrize("name, placement_ranks", [("1f1b", 2), ("zb-h1", 3), ("zbv", 2)])
def test_a_spread_of_one_is_the_simulator(name, placement_ranks):
    """Every factor 1 (one band at 1.0): each draw is the simulator's iteration with the median
    durations plus the overhead (fused BW, plain and V placements alike)."""
    costs = CostModel(t_f=1.0, t_b=1.25, t_w=0.5, t_comm=0.125)
    sched = build_schedule(name, num_ranks=placement_ranks, num_microbatches=4, costs=costs)
    one = DurationSpread({Op.F: (1.0,), Op.B: (1.0,), Op.W: (1.0,)})
    want = simulate(sched, costs.with_action_overhead(0.25, split_backward=sched.splits_backward),
                    enforce_memory=False).makespan
    got = simulate_spread(sched, costs, one, action_overhead=0.25, draws=3)
    assert (got.median, got.low, got.high) == pytest.approx((want, want, want), rel=1e-12)
    assert got.draws == 3


def test_drawn_durations_set_the_makespan():
    """ZB-H1, p = 2, m = 1, T_F = T_B = T_W = 1, T_comm 0: rank 0 runs F0, then (after rank 1's F1
    and B1) B0 and W0, so the makespan is f0 + f1 + 3 with the two drawn forward times. F factors
    1 or 3 with probability 1/2 each: f0 + f1 is 2, 4, 4 or 6 -> makespan 5 (p 1/4), 7 (1/2), 9 (1/4):
    median 7, 10th percentile 5, 90th percentile 9 (128 draws). An overhead of 0.5 per action adds
    5 x 0.5 on rank 0's chain (F0, F1, B1, B0, W0)."""
    sched = build_schedule("zb-h1", num_ranks=2, num_microbatches=1)
    sp = DurationSpread({Op.F: (1.0, 3.0)})
    got = simulate_spread(sched, CostModel(), sp, draws=128)
    assert (got.median, got.low, got.high) == (7.0, 5.0, 9.0)
    assert simulate_spread(sched, CostModel(), sp, action_overhead=0.5, draws=128).median == 9.5
    # seeded: the same draws again
    assert simulate_spread(sched, CostModel(), sp, draws=5, seed=3) == simulate_spread(sched, CostModel(), sp, draws=5,
                                                                                        seed=3)
    with pytest.raises(ScheduleError, match="draws"):
        simulate_spread(sched, CostModel(), sp, draws=0)


def test_a_fused_backward_draws_from_its_own_spread():
    """1F1B, p = 2, m = 1, unit costs, T_comm 0: rank 0 runs F0, waits for F1 and BW1, runs BW0, so
    the makespan is 1 + 1 + bw1 + bw0. A BW entry scales T_B + T_W = 2 as one action: factor 1.5
    always gives 1 + 1 + 3 + 3 = 8; without it B and W are drawn from their own entries (B 2x, W 1x:
    BW = 3) -> 1 + 1 + 3 + 3 = 8 as well, and (B 1x, W 1x) -> 6."""
    sched = build_schedule("1f1b", num_ranks=2, num_microbatches=1)
    assert simulate_spread(sched, CostModel(), DurationSpread({Op.BW: (1.5,)}), draws=4).median == 8.0
    assert simulate_spread(sched, CostModel(), DurationSpread({Op.B: (2.0,)}), draws=4).median == 8.0
    assert simulate_spread(sched, CostModel(), DurationSpread({Op.F: (1.0,)}), draws=4).median == 6.0

"""The data-parallel reduce prediction (megatron_zb.schedules.dp_reduce), hand-computed cases."""

from __future__ import annotations

import pytest

from megatron_zb.schedules.costs import CostModel
from megatron_zb.schedules.dp_reduce import DPReduceModel, reduce_aware_tail, simulate_dp_reduce
from megatron_zb.schedules.ir import Action, Op, Schedule
from megatron_zb.schedules.registry import build_schedule
from megatron_zb.schedules.simulator import simulate

UNIT = CostModel(t_f=1.0, t_b=1.0, t_w=1.0)


def test_greedy_zb_hides_all_but_the_last_bucket():
    """zb, p=4, m=8, unit costs: compute ends at 27 (the simulator's total). Four buckets of
    1e6 bytes per stage at 4e6 bytes per unit take 0.25 each; they become ready at 1/4, 2/4,
    3/4 and 4/4 of the stage's last W, so with overlap only the last one (0.25) is exposed on
    the rank that finishes last; without overlap all four (1.0) are."""
    s = build_schedule("zb", num_ranks=4, num_microbatches=8, costs=UNIT)
    sim = simulate(s, UNIT)
    assert sim.total_time == pytest.approx(27.0)
    r = simulate_dp_reduce(sim, DPReduceModel(stage_bytes=[4e6] * 4, bucket_bytes=1e6, bandwidth=4e6))
    assert r.time_overlapped == pytest.approx(27.25)
    assert r.time_serial == pytest.approx(28.0)
    assert r.hideable == pytest.approx(0.75)
    assert all(len(x.buckets) == 4 for x in r.overlapped)
    assert "hidden 0.75" in r.summary()


def _one_rank_v() -> Schedule:
    """Two stages on one rank, one microbatch: F0 F1 B1 B0, then the tail W0 W1."""
    a = [Action(Op.F, 0, 0), Action(Op.F, 0, 1), Action(Op.B, 0, 1), Action(Op.B, 0, 0),
         Action(Op.W, 0, 0), Action(Op.W, 0, 1)]
    return Schedule(num_microbatches=1, stage_to_rank=[0, 0], ranks=[a], name="hand")


def test_reduce_aware_tail_runs_the_big_stage_w_first():
    """Unit costs: the tail W's run 4-5 and 5-6. Stage 1 reduces 4 bytes (1 unit at 4 B/unit),
    stage 0 0.4 bytes (0.1). Tail W0, W1: stage 1 ready at 6, done at 7. Reordered W1, W0:
    stage 1 ready at 5, done at 6; stage 0 ready at 6, done at 6.1."""
    model = DPReduceModel(stage_bytes=[0.4, 4.0], bucket_bytes=None, bandwidth=4.0)
    s = _one_rank_v()
    assert simulate_dp_reduce(simulate(s, UNIT), model).time_overlapped == pytest.approx(7.0)
    best, res = reduce_aware_tail(s, UNIT, model)
    assert [(a.op, a.stage) for a in best.ranks[0][-2:]] == [(Op.W, 1), (Op.W, 0)]
    assert res.time_overlapped == pytest.approx(6.1)
    # the reordering is kept only when it helps: equal stage sizes leave the schedule as it is
    same, _ = reduce_aware_tail(s, UNIT, DPReduceModel(stage_bytes=[4.0, 4.0], bucket_bytes=None, bandwidth=4.0))
    assert same is s

"""The data-parallel reduce prediction (megatron_zb.schedules.dp_reduce), hand-computed cases."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_zb.schedules.costs import CostModel
from megatron_zb.schedules.dp_reduce import DPReduceModel, reduce_aware_tail, simulate_dp_reduce
from megatron_zb.schedules.ir import Action, Op, Schedule, ScheduleError
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


# ------------------------------------------------------------------ the kernel (CostModel.dp_reduce)
def _with(costs: CostModel, **model) -> CostModel:
    return dataclasses.replace(costs, dp_reduce=DPReduceModel(**model))


def test_default_off_leaves_the_times_alone_and_reports_no_reduce():
    s = build_schedule("zb", num_ranks=4, num_microbatches=8, costs=UNIT)
    plain = simulate(s, UNIT)
    assert plain.reduce is None and plain.exposed_reduce == [0.0] * 4
    assert plain.compute_time == plain.total_time == pytest.approx(27.0)


def test_one_rank_f_b_w_then_two_buckets_overlapped_and_serial():
    """One stage, one microbatch, unit costs: F 0-1, B 1-2, W 2-3. 4 bytes in buckets of 3 at 2
    bytes/unit plus latency 0.5: bucket 1 (3 B) ready at 2 + 3/4 = 2.75, runs 2.75-4.75; bucket 2
    (1 B) ready at 3, runs 4.75-5.75. Serial: 3-5, 5-6."""
    s = Schedule(num_microbatches=1, stage_to_rank=[0], name="one",
                 ranks=[[Action(Op.F, 0, 0), Action(Op.B, 0, 0), Action(Op.W, 0, 0)]])
    over = simulate(s, _with(UNIT, stage_bytes=4.0, bucket_bytes=3.0, bandwidth=2.0, latency=0.5))
    assert over.reduce == [[(0, 2.75, 2.75, 4.75), (0, 3.0, 4.75, 5.75)]]
    assert over.total_time == pytest.approx(5.75) and over.compute_time == pytest.approx(3.0)
    assert over.span == [pytest.approx(5.75)] and over.exposed_reduce == [pytest.approx(2.75)]
    assert over.bubble_rate == pytest.approx((5.75 - 3.0) / 5.75)
    serial = simulate(s, _with(UNIT, stage_bytes=4.0, bucket_bytes=3.0, bandwidth=2.0, latency=0.5, overlap=False))
    assert serial.reduce == [[(0, 2.75, 3.0, 5.0), (0, 3.0, 5.0, 6.0)]]
    assert serial.total_time == pytest.approx(6.0)


def test_fused_bw_and_mixed_stages_ready_at_their_last_weight_gradient():
    """1F1B (fused BW), p=2, m=2, unit costs (BW = 2): rank 1 runs F0 1-2, BW0 2-4, F1 4-5, BW1
    5-7; rank 0 runs F0 0-1, F1 1-2, BW0 4-6, BW1 7-9, so its single bucket (1 byte at 1
    byte/unit) is ready at 9 and ends at 10 (rank 1's: 7-8). A stage whose
    last weight gradient is a BW after a W: the BW decides (ready at its end, not at the W's)."""
    s = build_schedule("1f1b", num_ranks=2, num_microbatches=2, costs=UNIT)
    r = simulate(s, _with(UNIT, stage_bytes=1.0, bucket_bytes=None, bandwidth=1.0))
    assert r.reduce == [[(0, 9.0, 9.0, 10.0)], [(1, 7.0, 7.0, 8.0)]]
    assert r.total_time == pytest.approx(10.0)
    mixed = Schedule(num_microbatches=2, stage_to_rank=[0], name="mixed", ranks=[[
        Action(Op.F, 0, 0), Action(Op.B, 0, 0), Action(Op.W, 0, 0), Action(Op.F, 1, 0), Action(Op.BW, 1, 0)]])
    # F 0-1, B 1-2, W 2-3, F 3-4, BW 4-6: ready at 6
    r = simulate(mixed, _with(UNIT, stage_bytes=1.0, bucket_bytes=None, bandwidth=1.0))
    assert r.reduce == [[(0, 6.0, 6.0, 7.0)]]


def test_per_stage_buckets_and_bad_values_are_refused():
    m = DPReduceModel(stage_bytes=[4.0, 4.0], bucket_bytes=[1.0, None], bandwidth=1.0)
    assert m.buckets(0) == [1.0] * 4 and m.buckets(1) == [4.0]
    assert DPReduceModel(stage_bytes=0.0, bucket_bytes=None, bandwidth=1.0).buckets(0) == []
    for bad in (dict(stage_bytes=[1.0], bucket_bytes=None, bandwidth=1.0),
                dict(stage_bytes=1.0, bucket_bytes=[1.0], bandwidth=1.0),
                dict(stage_bytes=1.0, bucket_bytes=None, bandwidth=0.0),
                dict(stage_bytes=-1.0, bucket_bytes=None, bandwidth=1.0),
                dict(stage_bytes=1.0, bucket_bytes=0.0, bandwidth=1.0)):
        with pytest.raises(ScheduleError, match="dp_reduce"):
            _with(UNIT, **bad).resolve(2)


def test_greedy_scores_its_candidates_with_the_reduce():
    """zb, p=2, m=3, T_F = T_B = 1, T_W = (1, 2); stage 0 reduces 4 bytes at 1 byte/unit in one
    bucket (4 units), stage 1 nothing.

    Built without the reduce, greedy fills rank 1's gaps with its W's: rank 1 runs F0 1-2, B0 2-3,
    F1 3-4, B1 4-5, W0 5-7, F2 7-8, B2 8-9, W1 9-11, W2 11-13, so B2 of stage 0 waits until 9: rank 0
    ends its last W at 11 and its reduce at 15 -- the iteration is 15 (compute alone 13).
    Built with the reduce in the costs, greedy keeps a variant that defers rank 1's W's to its tail:
    F2 6-7, B2 7-8, then W0 8-10, W1 10-12, W2 12-14; rank 0 runs B2 8-9, W2 9-10 and reduces 10-14:
    the iteration is 14 (compute 14), one unit shorter."""
    base = CostModel(t_f=1.0, t_b=1.0, t_w=[1.0, 2.0])
    with_dp = _with(base, stage_bytes=[4.0, 0.0], bucket_bytes=None, bandwidth=1.0)
    blind = simulate(build_schedule("zb", num_ranks=2, num_microbatches=3, costs=base), with_dp)
    assert blind.compute_time == pytest.approx(13.0) and blind.reduce[0] == [(0, 11.0, 11.0, 15.0)]
    assert blind.total_time == pytest.approx(15.0)
    aware_sched = build_schedule("zb", num_ranks=2, num_microbatches=3, costs=with_dp)
    aware = simulate(aware_sched, with_dp)
    assert aware.reduce[0] == [(0, 10.0, 10.0, 14.0)]
    assert aware.total_time == pytest.approx(14.0) and aware.compute_time == pytest.approx(14.0)
    assert [(a.op, a.mb) for a in aware_sched.ranks[1][-3:]] == [(Op.W, 0), (Op.W, 1), (Op.W, 2)]


def _order(text: str) -> list[tuple[Op, int, int]]:
    """``"F0.1 B0.1"`` -> ``[(Op.F, 0, 1), (Op.B, 0, 1)]`` (op, microbatch, stage)."""
    return [(Op(t[0]), int(t[1:].split(".")[0]), int(t.split(".")[1])) for t in text.split()]


def test_v_generator_returns_the_reduce_aware_tail():
    """zbv, p=2, m=2, unit costs, T_comm 0; stage 1 reduces 4 bytes, stages 0, 2 and 3 one byte
    each, at 1 byte/unit (one bucket per stage).

    Built without the reduce, rank 1 (stages 1 and 2) runs F0.1 1-2, F0.2 2-3, F1.1 3-4, F1.2 4-5,
    B0.2 5-6, B0.1 6-7, B1.2 7-8, B1.1 8-9 and the tail W0.2 9-10, W0.1 10-11, W1.2 11-12, W1.1
    12-13; rank 0 (stages 0 and 3) ends its W's at 13 too (stage 3's last at 11). With the reduce:
    rank 1's stage 2 is ready at 12 (reduce 12-13), stage 1 at 13 (13-17): the iteration is 17
    (rank 0: 11-12 and 13-14). Built with the reduce in the costs, rank 1's tail is regrouped
    stage 1 first -- W0.1 9-10, W1.1 10-11, W0.2 11-12, W1.2 12-13 -- so stage 1
    reduces 11-15 and stage 2 (ready 13) 15-16: the iteration is 16; rank 0's order is unchanged.
    Without overlap every rank reduces after its compute: rank 1 13-18, so 18."""
    with_dp = _with(UNIT, stage_bytes=[1.0, 4.0, 1.0, 1.0], bucket_bytes=None, bandwidth=1.0)
    plain = build_schedule("zbv", num_ranks=2, num_microbatches=2, costs=UNIT)
    r0 = "F0.0 F1.0 F0.3 B0.3 F1.3 B1.3 B0.0 W0.3 B1.0 W1.3 W0.0 W1.0"
    r1 = "F0.1 F0.2 F1.1 F1.2 B0.2 B0.1 B1.2 B1.1 "
    assert [[(a.op, a.mb, a.stage) for a in r] for r in plain.ranks] == [_order(r0), _order(r1 + "W0.2 W0.1 W1.2 W1.1")]
    assert simulate(plain, with_dp).total_time == pytest.approx(17.0)
    aware = build_schedule("zbv", num_ranks=2, num_microbatches=2, costs=with_dp)
    assert [[(a.op, a.mb, a.stage) for a in r] for r in aware.ranks] == [_order(r0), _order(r1 + "W0.1 W1.1 W0.2 W1.2")]
    assert "reduce-aware tail" in aware.meta["variant"]
    res = simulate_dp_reduce(simulate(aware, with_dp))
    assert res.overlapped[1].buckets == [(1, 11.0, 11.0, 15.0), (2, 13.0, 15.0, 16.0)]
    assert res.time_overlapped == pytest.approx(16.0) and res.time_serial == pytest.approx(18.0)
    # the pass finds nothing more to regroup in what the generator returns
    assert reduce_aware_tail(aware, with_dp)[0] is aware


def test_interleaved_zb_returns_the_reduce_aware_tail():
    """interleaved-zb, p=2, v=2 (stages 0, 2 on rank 0; 1, 3 on rank 1), m=3, unit costs, T_comm 0;
    stage 3 reduces 4 bytes, stages 0-2 one byte each, at 1 byte/unit (one bucket per stage).

    Built without the reduce, rank 0 runs F0.0 0-1, F1.0 1-2, F0.2 2-3, F1.2 3-4, B0.2 5-6 (after
    B0.3), W0.2 6-7, F2.0 7-8, B1.2 8-9, B0.0 9-10, B1.0 10-11, F2.2 11-12, W1.2 12-13, W0.0 13-14,
    B2.2 14-15, W1.0 15-16, B2.0 16-17, W2.2 17-18, W2.0 18-19; rank 1 runs F0.1 1-2, F1.1 2-3,
    F0.3 3-4, B0.3 4-5, F1.3 5-6, B1.3 6-7, B0.1 7-8 (after B0.2), F2.1 8-9 (after F2.0), B1.1 9-10
    (after B1.2), W0.3 10-11, W1.3 11-12, F2.3 12-13 (after F2.2), B2.3 13-14, W0.1 14-15, B2.1
    15-16 (after B2.2) and the tail W1.1 16-17, W2.3 17-18, W2.1 18-19. With the reduce: rank 1's
    stage 3 is ready at 18 (reduce 18-22), stage 1 at 19 (22-23): the iteration is 23 (rank 0:
    stage 2 18-19, stage 0 19-20). Built with the reduce in the costs, rank 1's tail is regrouped
    stage 3 first -- W2.3 16-17, W1.1 17-18, W2.1 18-19 -- so stage 3 reduces 17-21 and stage 1
    (ready 19) 21-22: the iteration is 22; rank 0's order is unchanged (its tail W2.2 W2.0 is
    already best: either order ends its reduce at 20). Without overlap rank 1 reduces 19-24."""
    with_dp = _with(UNIT, stage_bytes=[1.0, 1.0, 1.0, 4.0], bucket_bytes=None, bandwidth=1.0)
    kw = dict(num_ranks=2, num_microbatches=3, num_chunks=2)
    plain = build_schedule("interleaved-zb", costs=UNIT, **kw)
    r0 = _order("F0.0 F1.0 F0.2 F1.2 B0.2 W0.2 F2.0 B1.2 B0.0 B1.0 F2.2 W1.2 W0.0 B2.2 W1.0 B2.0 W2.2 W2.0")
    r1 = "F0.1 F1.1 F0.3 B0.3 F1.3 B1.3 B0.1 F2.1 B1.1 W0.3 W1.3 F2.3 B2.3 W0.1 B2.1 "
    assert [[(a.op, a.mb, a.stage) for a in r] for r in plain.ranks] == [r0, _order(r1 + "W1.1 W2.3 W2.1")]
    assert simulate(plain, with_dp).total_time == pytest.approx(23.0)
    aware = build_schedule("interleaved-zb", costs=with_dp, **kw)
    assert [[(a.op, a.mb, a.stage) for a in r] for r in aware.ranks] == [r0, _order(r1 + "W2.3 W1.1 W2.1")]
    assert aware.meta["variant"].endswith(" + reduce-aware tail")
    res = simulate_dp_reduce(simulate(aware, with_dp))
    assert res.overlapped[0].buckets == [(2, 18.0, 18.0, 19.0), (0, 19.0, 19.0, 20.0)]
    assert res.overlapped[1].buckets == [(3, 17.0, 17.0, 21.0), (1, 19.0, 21.0, 22.0)]
    assert res.time_overlapped == pytest.approx(22.0) and res.time_serial == pytest.approx(24.0)
    assert reduce_aware_tail(aware, with_dp)[0] is aware
    # a serial reduce starts after the compute whatever the W order: no regrouping
    serial = _with(UNIT, stage_bytes=[1.0, 1.0, 1.0, 4.0], bucket_bytes=None, bandwidth=1.0, overlap=False)
    assert build_schedule("interleaved-zb", costs=serial, **kw).ranks == plain.ranks

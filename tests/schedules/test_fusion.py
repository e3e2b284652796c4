"""A fused backward's own cost (``CostModel.t_bw``), the fused/split forms of one order
(``schedules.fusion``) and the fused-backward V family ``1f1b-v``, with hand-worked numbers."""

from __future__ import annotations

import pytest

from megatron_zb.schedules import CostModel, Schedule, ScheduleError, simulate
from megatron_zb.schedules.fusion import (AS_WRITTEN, as_run, fuse_adjacent, fuse_all, fuse_where_free, simulate_as_run,
                                          split_all, split_where_faster)
from megatron_zb.schedules.ir import B, BW, F, W, Op, v_placement
from megatron_zb.schedules.registry import build_schedule, get_spec

SPLIT = Schedule(1, [0, 1], [[F(0, 0), B(0, 0), W(0, 0)], [F(0, 1), B(0, 1), W(0, 1)]])
FUSED = Schedule(1, [0, 1], [[F(0, 0), BW(0, 0)], [F(0, 1), BW(0, 1)]])


def test_fused_backward_costs_t_bw_by_hand():
    costs = CostModel(t_f=1.0, t_b=2.0, t_w=1.0, t_bw=2.2)
    # fused: F(0,0) 0-1, F(0,1) 1-2, BW(0,1) 2-4.2, BW(0,0) 4.2-6.4
    r = simulate(FUSED, costs)
    assert r.end[1] == pytest.approx([2.0, 4.2]) and r.end[0] == pytest.approx([1.0, 6.4])
    # split: B(0,1) 2-4, W(0,1) 4-5; B(0,0) 4-6, W(0,0) 6-7 -- t_bw does not apply to B + W
    assert simulate(SPLIT, costs).makespan == pytest.approx(7.0)
    # without t_bw a BW costs t_b + t_w: 2 + 3 + 3
    assert simulate(FUSED, CostModel(t_f=1.0, t_b=2.0, t_w=1.0)).makespan == pytest.approx(8.0)
    # an overhead per action: a BW is one action
    sc = CostModel(t_bw=[2.2, 3.0]).with_action_overhead(0.1, split_backward=False).resolve(2)
    assert (sc.duration(Op.BW, 0), sc.duration(Op.BW, 1)) == pytest.approx((2.3, 3.1))
    with pytest.raises(ScheduleError, match=r"t_bw for stage 1 is 0.0; it must be finite and > 0"):
        CostModel(t_bw=[1.0, 0.0]).resolve(2)


def test_fused_and_split_forms_of_one_order():
    assert fuse_adjacent(SPLIT).ranks == FUSED.ranks
    # a W that does not directly follow its B stays split
    late = Schedule(2, [0], [[F(0, 0), F(1, 0), B(0, 0), B(1, 0), W(0, 0), W(1, 0)]])
    assert fuse_adjacent(late).ranks == late.ranks
    mixed = Schedule(2, [0], [[F(0, 0), F(1, 0), B(0, 0), B(1, 0), W(1, 0), W(0, 0)]])
    assert fuse_adjacent(mixed).ranks == [[F(0, 0), F(1, 0), B(0, 0), BW(1, 0), W(0, 0)]]
    assert fuse_all(late).ranks == [[F(0, 0), F(1, 0), BW(0, 0), BW(1, 0)]]
    assert split_all(FUSED).ranks == SPLIT.ranks
    # simulated as PyTorch runs the export (an I directly followed by its W is one B): 6.4, not 7
    assert simulate(fuse_adjacent(SPLIT), CostModel(t_f=1.0, t_b=2.0, t_w=1.0, t_bw=2.2)).makespan == pytest.approx(6.4)


@pytest.mark.parametrize("p", [2, 4])
def test_1f1b_v_fuses_every_backward_and_beats_1f1b(p):
    m = 8
    spec = get_spec("1f1b-v")
    assert spec.placement.value == "v" and not spec.split_backward
    # per chunk F = 1, fused BW = 2 (split: B = 1.5, W = 1, i.e. +25%); plain 1F1B's stage = 2 chunks
    chunk = CostModel(t_f=1.0, t_b=1.5, t_w=1.0, t_bw=2.0)
    s = build_schedule("1f1b-v", num_ranks=p, num_microbatches=m, costs=chunk)
    assert s.stage_to_rank == v_placement(p)
    assert {a.op for _, _, a in s.actions()} == {Op.F, Op.BW}
    r = simulate(s, chunk)
    assert r.max_peak_memory <= 2 * p  # 1F1B's peak: p microbatches of 2 chunks
    # hand: 1F1B on plain stages of 2 chunks takes (m + p - 1)(T_F + T_BW) = (m + p - 1) * 6; each V rank's
    # work is m * 6, and rank p-1 (the V's turn) waits (p - 1) chunk forwards before its first action and
    # (p - 1) chunk backwards follow its last: at least m * 6 + (p - 1) * 3, half of 1F1B's bubble
    one_f_one_b = build_schedule("1f1b", num_ranks=p, num_microbatches=m)
    assert simulate(one_f_one_b, CostModel(t_f=2.0, t_b=3.0, t_w=2.0, t_bw=4.0)).makespan == pytest.approx((m + p - 1) * 6)
    bound = m * 6 + (p - 1) * 3
    assert bound <= r.makespan < (m + p - 1) * 6
    assert r.makespan == pytest.approx(m * 6 + (p - 1) * 4)  # at 1F1B's peak: two thirds of 1F1B's bubble
    free = build_schedule("1f1b-v", num_ranks=p, num_microbatches=m, costs=chunk, memory_limit=1e9)
    assert simulate(free, chunk).makespan == pytest.approx(bound)  # with memory to spare, the bound is reached


def test_fuse_where_free_keeps_apart_only_the_ws_that_fill_a_bubble():
    """T_F = T_B = T_W = 1 and a fused backward 1.9 (hand). Split, the order below takes 8: rank 0
    F0 0-1, F1 1-2, B0 3-4 (after rank 1's B0 at 3), B1 5-6, W0 6-7, W1 7-8. Moving rank 0's W0 behind
    B0 makes both of its backwards fused: BW0 3-4.9, BW1 5-6.9 (rank 1's B1 ends at 5) -> 6.9, kept.
    Rank 1's W's fill its slack while rank 0 works: fusing W0 there delays rank 1's F1 and B1 (8.7),
    fusing W1 delays B1's gradient to rank 0 (7.8) -- both stay split. Memory only falls."""
    costs = CostModel(t_f=1.0, t_b=1.0, t_w=1.0, t_bw=1.9, mem_b=1.0, mem_w=0.5)
    split = Schedule(2, [0, 1], [[F(0, 0), F(1, 0), B(0, 0), B(1, 0), W(0, 0), W(1, 0)],
                                 [F(0, 1), B(0, 1), F(1, 1), B(1, 1), W(0, 1), W(1, 1)]])
    assert simulate(fuse_adjacent(split), costs).makespan == pytest.approx(8.0)
    free = fuse_where_free(split, costs)
    assert free.ranks == [[F(0, 0), F(1, 0), B(0, 0), W(0, 0), B(1, 0), W(1, 0)], split.ranks[1]]
    res = simulate(fuse_adjacent(free), costs)
    assert res.makespan == pytest.approx(6.9)
    assert fuse_adjacent(free).ranks[0] == [F(0, 0), F(1, 0), BW(0, 0), BW(1, 0)]
    assert res.max_peak_memory <= simulate(split, costs).max_peak_memory
    # splitting as dear as fusing (no t_bw): fusing W0 still ends rank 0 at 7 instead of 8
    assert simulate(fuse_adjacent(fuse_where_free(split, CostModel(t_f=1.0, t_b=1.0, t_w=1.0))),
                    CostModel(t_f=1.0, t_b=1.0, t_w=1.0)).makespan == pytest.approx(7.0)


def test_split_where_faster_splits_the_backward_whose_gradient_another_rank_waits_for():
    """T_F = T_B = T_W = 1, a fused backward 1.9 (hand), one microbatch on two ranks. Fused: F 0-1 (rank 0),
    F 1-2 (rank 1), BW 2-3.9 (rank 1), BW 3.9-5.8 (rank 0): 5.8. Rank 1's backward split -- its B 2-3
    sends the gradient, its W 3-4 runs after -- lets rank 0's BW run 3-4.9: 4.9, kept. Rank 0's split
    (B 3-4, W 4-5) would end at 5.0 > 4.9: stays fused. The result is written as it runs: the export
    and the prediction keep rank 1's adjacent B and W as two actions."""
    costs = CostModel(t_f=1.0, t_b=1.0, t_w=1.0, t_bw=1.9, mem_b=1.0, mem_w=0.5)
    assert simulate_as_run(FUSED, costs).total_time == pytest.approx(5.8)
    out = split_where_faster(FUSED, costs)
    assert out.ranks == [[F(0, 0), BW(0, 0)], [F(0, 1), B(0, 1), W(0, 1)]] and out.meta[AS_WRITTEN] is True
    assert as_run(out) is out and simulate_as_run(out, costs).total_time == pytest.approx(4.9)
    assert fuse_adjacent(out).ranks == FUSED.ranks  # unmarked, the same order would run fused again
    # splitting as dear as fusing (no t_bw): rank 1 splits (5 < 6); rank 0 split would end at 5, as its BW does: kept
    plain = CostModel(t_f=1.0, t_b=1.0, t_w=1.0)
    assert split_where_faster(FUSED, plain).ranks[0] == FUSED.ranks[0]
    with pytest.raises(ValueError, match="written as it runs: fuse where free before"):
        fuse_where_free(out, costs)

"""The timing kernel (megatron_zb.schedules.timing): rules, step-by-step runs, whole-order plays."""

from __future__ import annotations

import pytest

from megatron_zb.schedules import CostModel, DeadlockError, Op
from megatron_zb.schedules.ir import Action
from megatron_zb.schedules.timing import B_CODE, BW_CODE, F_CODE, W_CODE, Timeline, decode, encode, inputs


def test_dependency_rule():
    assert inputs(F_CODE, 0, 3) == ()
    assert inputs(F_CODE, 2, 3) == ((F_CODE, 1),)
    assert inputs(B_CODE, 0, 3) == ((F_CODE, 0), (B_CODE, 1))
    assert inputs(BW_CODE, 2, 3) == ((F_CODE, 2),)            # the last stage waits only for its own F
    assert inputs(W_CODE, 1, 3) == ((B_CODE, 1),)


def test_codes_round_trip():
    for op in (Op.F, Op.B, Op.W, Op.BW):
        a = Action(op, 3, 1)
        assert decode(encode(a)) == a
    assert encode(Action(Op.BW, 0, 2)) == (BW_CODE, 0, 2)


def test_play_two_stages_by_hand():
    """t_f=1, t_b=2, t_w=3, t_comm=0.5 on stages 0 and 1 (ranks 0 and 1), one microbatch."""
    sc = CostModel(t_f=1.0, t_b=2.0, t_w=3.0, t_comm=0.5, mem_b=4.0, mem_w=1.0).resolve(2)
    tl = Timeline([0, 1], 1, sc)
    start, end = tl.play([[(F_CODE, 0, 0), (B_CODE, 0, 0), (W_CODE, 0, 0)],
                          [(F_CODE, 0, 1), (B_CODE, 0, 1), (W_CODE, 0, 1)]], record=True)
    # rank 1: F 1.5-2.5, B 2.5-4.5, W 4.5-7.5; rank 0: F 0-1, B waits 4.5 + 0.5 -> 5-7, W 7-10
    assert start == [[0.0, 5.0, 7.0], [1.5, 2.5, 4.5]]
    assert end == [[1.0, 7.0, 10.0], [2.5, 4.5, 7.5]]
    assert tl.spans() == [10.0, 6.0] and tl.makespan() == 10.0 and tl.total_time() == 10.0
    assert tl.peak == [4.0, 4.0] and tl.mem == [0.0, 0.0]


def test_run_holds_an_action_back_and_reset_forgets():
    sc = CostModel().resolve(1)
    tl = Timeline([0], 2, sc)
    assert tl.run(0, F_CODE, 0, 0, tl.ready(F_CODE, 0, 0)) == 0.0
    assert tl.run(0, F_CODE, 1, 0, 5.0) == 5.0                 # a later ready time delays the start
    assert tl.ready(BW_CODE, 1, 0) == 6.0 and tl.mem == [2.0]
    tl.reset()
    assert tl.ready(BW_CODE, 0, 0) == float("inf") and tl.clock == [0.0] and tl.peak == [0.0]
    assert tl.run(0, F_CODE, 0, 0, tl.ready(F_CODE, 0, 0)) == 0.0


def test_memory_limit_position():
    sc = CostModel(memory_limit=1.5).resolve(1)
    tl = Timeline([0], 2, sc)
    tl.play([[(F_CODE, 0, 0), (F_CODE, 1, 0), (BW_CODE, 0, 0), (BW_CODE, 1, 0)]])
    assert tl.over == [1] and tl.peak == [2.0]


def test_deadlock_names_what_each_rank_waits_for():
    sc = CostModel().resolve(2)
    tl = Timeline([0, 1], 1, sc)
    with pytest.raises(DeadlockError, match=r"rank 0 blocked at action #0 BW\(mb=0, stage=0\) waiting for "
                                            r"F\(mb=0, stage=0\), B\(mb=0, stage=1\)"):
        tl.play([[(BW_CODE, 0, 0), (F_CODE, 0, 0)], [(F_CODE, 0, 1), (BW_CODE, 0, 1)]])

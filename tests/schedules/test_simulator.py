"""The simulator: timing semantics, communication latency, memory, deadlocks, bad costs."""

from __future__ import annotations

import pytest

from megatron_zb.schedules import (CostModel, DeadlockError, MemoryLimitError, Schedule, ScheduleError,
                                   simulate)
from megatron_zb.schedules.ir import B, BW, F, W


def test_two_stage_timeline_by_hand():
    s = Schedule(1, [0, 1], [[F(0, 0), B(0, 0), W(0, 0)], [F(0, 1), B(0, 1), W(0, 1)]])
    r = simulate(s, CostModel(t_f=[1, 2], t_b=[3, 4], t_w=[5, 6], t_comm=0.5))
    # rank 0: F 0..1; rank 1: F waits 1 + 0.5 comm -> 1.5..3.5, B 3.5..7.5, W 7.5..13.5
    assert r.start[1] == [1.5, 3.5, 7.5] and r.end[1] == [3.5, 7.5, 13.5]
    # rank 0: B waits for B(0,1) at 7.5 + 0.5 -> 8..11, W 11..16
    assert r.start[0] == [0.0, 8.0, 11.0] and r.end[0] == [1.0, 11.0, 16.0]
    assert r.total_time == 16.0
    assert r.span == [16.0, 12.0] and r.makespan == 16.0
    assert r.busy == [9.0, 12.0]
    assert r.bubble_rate == pytest.approx((16 - 12) / 16)


def test_memory_accounting_and_limit():
    s = Schedule(2, [0], [[F(0, 0), F(1, 0), B(0, 0), W(0, 0), BW(1, 0)]])
    cm = CostModel(mem_b=4.0, mem_w=1.0)
    assert simulate(s, cm).peak_memory == [8.0]
    with pytest.raises(MemoryLimitError, match=r"rank 0 action #1 F\(mb=1, stage=0\) brings activation memory above the limit 6"):
        simulate(s, cm.with_limit(6.0))
    assert simulate(s, cm.with_limit(6.0), enforce_memory=False).peak_memory == [8.0]


def test_backward_that_allocates_peaks_after_b():
    """mem_w > mem_b: B allocates mem_w - mem_b (with sequence parallelism what each W keeps can
    outgrow what F saved), so the peak comes right after a B. By hand, mem_b = 1 on both stages:
    rank 0 (mem_w 2.5): F0 1, F1 2, B0 +1.5 -> 3.5, B1 -> 5, W0 -> 2.5, W1 -> 0: peak 5 after B1;
    rank 1 (mem_w 1.5): F0 1, B0 +0.5 -> 1.5, F1 -> 2.5, B1 -> 3, W0 -> 1.5, W1 -> 0: peak 3 after B1.
    A fused BW frees mem_b (its transient is not modelled): the same order with BW peaks at 2 and 1."""
    s = Schedule(2, [0, 1], [[F(0, 0), F(1, 0), B(0, 0), B(1, 0), W(0, 0), W(1, 0)],
                             [F(0, 1), B(0, 1), F(1, 1), B(1, 1), W(0, 1), W(1, 1)]])
    cm = CostModel(mem_b=1.0, mem_w=[2.5, 1.5])
    assert simulate(s, cm).peak_memory == [5.0, 3.0]
    with pytest.raises(MemoryLimitError, match=r"rank 0 action #3 B\(mb=1, stage=0\) brings activation memory "
                                               r"above the limit 4\.5"):
        simulate(s, cm.with_limit(4.5))
    fused = Schedule(2, [0, 1], [[F(0, 0), F(1, 0), BW(0, 0), BW(1, 0)], [F(0, 1), BW(0, 1), F(1, 1), BW(1, 1)]])
    assert simulate(fused, cm).peak_memory == [2.0, 1.0]


def test_deadlock_reports_the_blocked_action_of_every_rank():
    # rank 0 waits for mb 0's gradient before sending mb 1; rank 1 wants mb 1 before returning it
    s = Schedule(2, [0, 1], [[F(0, 0), BW(0, 0), F(1, 0), BW(1, 0)], [F(0, 1), F(1, 1), BW(0, 1), BW(1, 1)]])
    with pytest.raises(DeadlockError) as e:
        simulate(s, CostModel())
    msg = str(e.value)
    assert "rank 0 blocked at action #1 BW(mb=0, stage=0) waiting for B(mb=0, stage=1)" in msg
    assert "rank 1 blocked at action #1 F(mb=1, stage=1) waiting for F(mb=1, stage=0)" in msg


@pytest.mark.parametrize("kwargs, flag", [
    (dict(t_f=-1.0), "t_f"), (dict(t_b=0.0), "t_b"), (dict(t_w=float("nan")), "t_w"),
    (dict(t_comm=-0.1), "t_comm"), (dict(mem_b=1.0, mem_w=-2.0), "mem_w"), (dict(memory_limit=0.0), "memory_limit"),
    (dict(t_f=[1.0, 2.0, 3.0]), "t_f has 3 values"),
])
def test_bad_costs_are_rejected_naming_the_field(kwargs, flag):
    s = Schedule(1, [0, 1], [[F(0, 0), BW(0, 0)], [F(0, 1), BW(0, 1)]])
    with pytest.raises(ScheduleError, match=flag):
        simulate(s, CostModel(**kwargs))


def test_transfers_within_one_rank_are_free():
    s = Schedule(1, [0, 0], [[F(0, 0), F(0, 1), BW(0, 1), BW(0, 0)]])
    assert simulate(s, CostModel(t_comm=100.0)).total_time == 6.0

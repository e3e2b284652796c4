"""Weight-gradient groups (issue 42's schedule side): the rewrite of a split-backward schedule into
groups of k back-to-back W's per stage, and the timing of a reduce-scatter per bucket per group.
Expected orders and times are written out by hand below."""

from __future__ import annotations

import pytest

from megatron_zb.schedules import CostModel, Schedule, ScheduleError, simulate, validate
from megatron_zb.schedules.costs import DPReduceModel
from megatron_zb.schedules.ir import BW, B, F, W
from megatron_zb.schedules.registry import build_schedule
from megatron_zb.schedules.wgrad_groups import check_wgrad_groups, group_wgrads, wgrad_group_of


def _one_stage() -> Schedule:
    """One stage, two micro batches, each W right after its B."""
    return Schedule(2, [0], [[F(0, 0), B(0, 0), W(0, 0), F(1, 0), B(1, 0), W(1, 0)]], name="one")


def _costs(k: int | None) -> CostModel:
    """Unit F, B, W; a stage of 100 bytes in two buckets of 50; each collective 0.1 + 50 / 100 = 0.6."""
    return CostModel(t_f=1.0, t_b=1.0, t_w=1.0, t_comm=0.0,
                     dp_reduce=DPReduceModel(stage_bytes=100, bucket_bytes=50, bandwidth=100, latency=0.1,
                                             wgrad_group=k))


def test_zb_h1_groups_of_two_run_where_their_last_w_ran():
    """ZB-H1 at p = 2, m = 4: rank 0 runs W0 after B0 and W1 after B1 (as written by the generator);
    grouped by 2, W0 waits for W1's place, W2 for W3's; nothing else moves."""
    s = build_schedule("zb-h1", num_ranks=2, num_microbatches=4)
    g = group_wgrads(s, 2)
    validate(g)
    assert [str(a) for a in g.ranks[0]] == [
        "F(mb=0, stage=0)", "F(mb=1, stage=0)", "B(mb=0, stage=0)", "F(mb=2, stage=0)", "B(mb=1, stage=0)",
        "W(mb=0, stage=0)", "W(mb=1, stage=0)", "F(mb=3, stage=0)", "B(mb=2, stage=0)", "B(mb=3, stage=0)",
        "W(mb=2, stage=0)", "W(mb=3, stage=0)"]
    assert wgrad_group_of(g) == 2 and wgrad_group_of(s) is None
    for r, (old, new) in enumerate(zip(s.compute_only().ranks, g.ranks)):  # only W's moved
        assert [a for a in old if a.op.value != "W"] == [a for a in new if a.op.value != "W"], r
        assert sorted(map(str, old)) == sorted(map(str, new)), r
    assert group_wgrads(s, 1).ranks == s.compute_only().ranks


@pytest.mark.parametrize("name,p", [("zb", 4), ("zbv", 4), ("interleaved-zb", 2), ("zb-2p-vocab-1", 2)])
def test_every_group_size_gives_a_valid_grouped_schedule(name, p):
    m = 2 * p
    s = build_schedule(name, num_ranks=p, num_microbatches=m)
    for k in (1, 2, 3, m):
        g = group_wgrads(s, k)
        validate(g)
        check_wgrad_groups(g, k)
        simulate(g, CostModel(t_f=1.0, t_b=1.0, t_w=1.0, t_comm=0.0), enforce_memory=False)


def test_a_fused_backward_and_a_group_below_one_are_refused():
    with pytest.raises(ScheduleError, match=r"fuses its backward \(BW\(mb=0, stage=0\)\).*split-backward family"):
        group_wgrads(Schedule(1, [0], [[F(0, 0), BW(0, 0)]], name="1f1b"), 2)
    with pytest.raises(ScheduleError, match="at least one micro batch, not 0"):
        group_wgrads(_one_stage(), 0)


def test_the_reduce_per_group_refuses_an_ungrouped_schedule():
    with pytest.raises(ScheduleError, match=r"stage 0's W's of micro batches \[0, 1\] are not back to back \(positions \[2, 5\]\)"):
        simulate(_one_stage(), _costs(2))


def test_bucket_ready_times_and_reduce_scatters_by_hand():
    """F0 B0 F1 B1 then the W's at 4..5 and 5..6 (grouped order).

    * k = 2 (layer-major over both): bucket 1 (the first half of the bytes) ready at 4 + 2 x 0.5 = 5,
      bucket 2 at 6; reduced 5.0-5.6 and 6.0-6.6: two collectives, the iteration ends at 6.6;
    * k = 1: each W readies both buckets (4.5, 5.0 then 5.5, 6.0): four collectives back to back on the
      channel, 4.5-5.1, 5.1-5.7, 5.7-6.3, 6.3-6.9;
    * no group (gradients kept for the iteration): the last W readies both, 5.5-6.1, 6.1-6.7."""
    grouped = group_wgrads(_one_stage(), 2)
    assert [str(a) for a in grouped.ranks[0]][-2:] == ["W(mb=0, stage=0)", "W(mb=1, stage=0)"]
    expect = {2: ([(0, 5.0, 5.0, 5.6), (0, 6.0, 6.0, 6.6)], 6.6),
              1: ([(0, 4.5, 4.5, 5.1), (0, 5.0, 5.1, 5.7), (0, 5.5, 5.7, 6.3), (0, 6.0, 6.3, 6.9)], 6.9),
              None: ([(0, 5.5, 5.5, 6.1), (0, 6.0, 6.1, 6.7)], 6.7)}
    for k, (buckets, total) in expect.items():
        res = simulate(grouped, _costs(k))
        assert [b[0] for b in res.reduce[0]] == [b[0] for b in buckets], k
        assert [t for b in res.reduce[0] for t in b[1:]] == pytest.approx([t for b in buckets for t in b[1:]]), k
        assert res.total_time == pytest.approx(total), k


def test_two_work_buffers_make_a_bucket_wait_for_the_reduce_two_before_it_by_hand():
    """F0 B0 W0 F1 B1 W1 (k = 1), unit costs, a stage of 150 bytes in three buckets of 50, each reduce
    0.1 + 50 / 50 = 1.1, two work buffers.

    * W0 (2..3): bucket 1 written by 2 + 1/3, reduced 2.333-3.433; bucket 2 by 2.667, reduced 3.433-4.533;
      bucket 3 waits for bucket 1's buffer (3.433), written by 3.767, reduced 4.533-5.633. The group ends at
      3.767, so F1 runs 3.767-4.767, B1 4.767-5.767, W1 from 5.767;
    * W1: bucket 1 (buffer free since 4.533) by 6.1, reduced 6.1-7.2; bucket 2 (free 5.633) by 6.433, reduced
      7.2-8.3; bucket 3 waits for 7.2, written by 7.533, reduced 8.3-9.4: the iteration ends at 9.4;
    * without the buffer limit: F1 3-4, B1 4-5, W1 5-6, the reduces back to back from 2.333 to 8.933."""
    sched = group_wgrads(_one_stage(), 1)
    def costs(buffers):
        return CostModel(t_f=1.0, t_b=1.0, t_w=1.0, t_comm=0.0,
                         dp_reduce=DPReduceModel(stage_bytes=150, bucket_bytes=50, bandwidth=50, latency=0.1,
                                                 wgrad_group=1, work_buffers=buffers))
    third = 1 / 3
    res = simulate(sched, costs(2))
    assert res.start[0] == pytest.approx([0, 1, 2, 3 + 2 * third + 0.1, 4 + 2 * third + 0.1, 5 + 2 * third + 0.1])
    assert [t for b in res.reduce[0] for t in b[1:]] == pytest.approx(
        [2 + third, 2 + third, 3.433333, 2 + 2 * third, 3.433333, 4.533333, 3.766667, 4.533333, 5.633333,
         6.1, 6.1, 7.2, 6.433333, 7.2, 8.3, 7.533333, 8.3, 9.4])
    assert res.total_time == pytest.approx(9.4)
    free = simulate(sched, costs(None))
    assert free.start[0] == pytest.approx([0, 1, 2, 3, 4, 5]) and free.total_time == pytest.approx(8.933333)


def test_reduces_that_block_the_compute_run_between_the_buckets_by_hand():
    """The same schedule and costs with ``blocks_compute`` (gloo on a CPU: the reduce takes the compute's cores):
    W0 writes bucket 1 by 2.333 and reduces it to 3.433, bucket 2 by 3.767 (reduced to 4.867), bucket 3 by 5.2
    (to 6.3); F1 then runs 6.3-7.3, B1 7.3-8.3, W1 from 8.3: buckets by 8.633, 10.067 and 11.5, each reduced
    1.1 after it, the iteration ending at 12.6."""
    sched = group_wgrads(_one_stage(), 1)
    costs = CostModel(t_f=1.0, t_b=1.0, t_w=1.0, t_comm=0.0,
                      dp_reduce=DPReduceModel(stage_bytes=150, bucket_bytes=50, bandwidth=50, latency=0.1,
                                              wgrad_group=1, work_buffers=2, blocks_compute=True))
    res = simulate(sched, costs)
    assert res.start[0] == pytest.approx([0, 1, 2, 6.3, 7.3, 8.3])
    assert [b[1] for b in res.reduce[0]] == pytest.approx([2.333333, 3.766667, 5.2, 8.633333, 10.066667, 11.5])
    assert [b[3] for b in res.reduce[0]] == pytest.approx([3.433333, 4.866667, 6.3, 9.733333, 11.166667, 12.6])
    assert res.total_time == pytest.approx(12.6)


def test_larger_groups_hold_more_w_inputs_and_issue_fewer_reduce_scatters():
    """ZB at p = 4, m = 8 with the W's inputs as large as F's activations: the peak grows with k (the
    group's earlier W inputs are held until it runs) and each rank issues ceil(m / k) x 2 collectives."""
    s = build_schedule("zb", num_ranks=4, num_microbatches=8)
    peaks, counts = {}, {}
    for k in (1, 2, 3, 4, 8):
        res = simulate(group_wgrads(s, k), CostModel(t_f=1.0, t_b=1.0, t_w=1.0, t_comm=0.0, mem_w=1.0,
                                                     dp_reduce=DPReduceModel(stage_bytes=100, bucket_bytes=50,
                                                                             bandwidth=100, wgrad_group=k)),
                       enforce_memory=False)
        peaks[k] = max(res.peak_memory)
        counts[k] = {len(b) for b in res.reduce}
    assert [peaks[k] for k in (1, 2, 4, 8)] == sorted(peaks[k] for k in (1, 2, 4, 8)) and peaks[8] > peaks[1], peaks
    assert counts == {1: {16}, 2: {8}, 3: {6}, 4: {4}, 8: {2}}


def test_a_group_without_overlap_or_below_one_is_refused_by_the_model():
    for k, overlap in ((0, True), (2, False)):
        with pytest.raises(ScheduleError, match=r"dp_reduce.wgrad_group is"):
            CostModel(t_f=1.0, t_b=1.0, t_w=1.0, dp_reduce=DPReduceModel(stage_bytes=1, bucket_bytes=None, bandwidth=1,
                                                                         overlap=overlap, wgrad_group=k)).resolve(1)


def test_group_runs_tell_the_runtime_where_each_group_runs():
    """ZB-H1 at p = 2, m = 4 grouped by 2 (the order above): rank 0's group {W0, W1} runs at W1, {W2, W3} at
    W3; the lowered rank (sends and receives between the actions) gives the same; k = 1 or None: no groups.
    An odd group at the end (k = 3 of 4): {W0, W1, W2} at W2, {W3} alone at W3."""
    from megatron_zb.schedules import lower
    from megatron_zb.schedules.wgrad_groups import group_runs

    g = group_wgrads(build_schedule("zb-h1", num_ranks=2, num_microbatches=4), 2)
    expected = {(0, 0): (), (0, 1): (0, 1), (0, 2): (), (0, 3): (2, 3)}
    assert group_runs(g.ranks[0], 2) == expected
    assert group_runs(lower(g).ranks[0], 2) == expected
    assert group_runs(g.ranks[0], 1) == {} and group_runs(g.ranks[0], None) == {}
    three = group_wgrads(build_schedule("zb-h1", num_ranks=2, num_microbatches=4), 3)
    assert group_runs(three.ranks[1], 3) == {(1, 0): (), (1, 1): (), (1, 2): (0, 1, 2), (1, 3): (3,)}


def test_work_buffers_without_a_group_or_below_one_are_refused_by_the_model():
    for k, buffers in ((None, 2), (2, 0)):
        with pytest.raises(ScheduleError, match=r"dp_reduce.work_buffers is"):
            CostModel(t_f=1.0, t_b=1.0, t_w=1.0, dp_reduce=DPReduceModel(stage_bytes=1, bucket_bytes=None, bandwidth=1,
                                                                         wgrad_group=k, work_buffers=buffers)).resolve(1)

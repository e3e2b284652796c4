"""The executor's per-rank plan: lowered and checked once per schedule, reused by every call."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_zb.runtime import get_forward_backward_func
from megatron_zb.runtime.executor import plan_rank
from megatron_zb.schedules import CostModel, ScheduleError, lower
from megatron_zb.schedules.registry import build_schedule
from megatron_zb.schedules.ir import Action, Schedule


def test_plan_holds_the_rank_part_of_the_lowered_schedule():
    sched = build_schedule("zb-h1", num_ranks=4, num_microbatches=8)
    lowered = lower(sched)
    for rank in range(4):
        plan = plan_rank(sched, rank=rank)
        assert list(plan.actions) == lowered.ranks[rank]
        assert [plan.actions[i] for i in plan.recv_positions] == [a for a in lowered.ranks[rank] if a.op.startswith("RECV")]
        assert plan.out_of_order_stages == frozenset()


def test_forward_only_plan_keeps_forwards_and_their_transfers_in_order():
    sched = build_schedule("zb-2p", num_ranks=4, num_microbatches=8)
    full = plan_rank(sched, rank=1)
    fwd = plan_rank(sched, rank=1, forward_only=True)
    assert list(fwd.actions) == [a for a in full.actions if a.op in ("F", "SEND_F", "RECV_F")]
    assert all(fwd.actions[i].op == "RECV_F" for i in fwd.recv_positions)


def test_already_lowered_schedule_runs_as_written_and_is_still_checked():
    lowered = lower(build_schedule("1f1b", num_ranks=2, num_microbatches=4))
    assert list(plan_rank(lowered, rank=0).actions) == lowered.ranks[0]
    broken = Schedule(lowered.num_microbatches, lowered.stage_to_rank,
                      [list(lowered.ranks[0]), [a for a in lowered.ranks[1] if a.op != "RECV_F"]])
    with pytest.raises(ScheduleError, match="send"):
        plan_rank(broken, rank=0)
    plan_rank(broken, rank=0, validate=False)  # the runtime's safety-net tests need this


def test_out_of_order_forwards_are_found_per_stage():
    # rank 0 runs F(1, 0) before F(0, 0): its data iterator must be read through the in-order buffer
    ranks = [[Action("F", 1, 0), Action("F", 0, 0), Action("BW", 1, 0), Action("BW", 0, 0)]]
    plan = plan_rank(Schedule(2, [0], ranks), rank=0)
    assert plan.out_of_order_stages == frozenset({0})
    with pytest.raises(ValueError, match="rank 3"):
        plan_rank(Schedule(2, [0], ranks), rank=3)


def test_forward_backward_builds_each_plan_once_and_rebuilds_after_replan():
    """One process (no process group): the install protocol builds locally."""
    fb = get_forward_backward_func("zb", costs=CostModel(t_f=1.0, t_b=1.0, t_w=1.0))
    with pytest.raises(KeyError, match="no schedule installed for 4 pipeline ranks and 8"):
        fb.plan_for(4, 8, 2)
    fb.install(4, 8)
    fb.install(4, 16)
    plan = fb.plan_for(4, 8, 2)
    assert fb.plan_for(4, 8, 2) is plan                       # cached
    assert fb.plan_for(4, 8, 2, forward_only=True) is not plan
    assert fb.plan_for(4, 8, 2).schedule.num_microbatches == 8
    measured = CostModel(t_f=1.0, t_b=2.0, t_w=1.0)
    fb.install(4, 8, costs=measured)
    assert fb.plan_for(4, 8, 2) is not plan                   # new costs: new schedule, new plan
    assert fb.costs is measured and fb.installed(4, 16) is None   # other m's: built again from these costs
    installed = build_schedule("zb-h1", num_ranks=4, num_microbatches=8)
    fb.install(4, 8, schedule=installed)
    assert list(fb.plan_for(4, 8, 2).actions) == lower(installed).ranks[2]
    with pytest.raises(dataclasses.FrozenInstanceError):   # the options are the caller's, fixed: no caller
        fb.options.costs = measured                         # switches measurements or costs by mutating them


def test_wgrad_group_option_groups_every_installed_schedule_and_the_plan_runs_each_group_at_its_last_w():
    """``wgrad_group=2``: the built schedule, a re-planned one and one installed as given are all grouped
    by 2; rank 0's plan then runs {W0, W1} at W1 and {W2, W3} at W3 (ZB-H1, p = 2, m = 4). A schedule
    whose W's are not back to back in groups of its recorded size is refused by the plan."""
    from megatron_zb.schedules.wgrad_groups import wgrad_group_of

    fb = get_forward_backward_func("zb", wgrad_group=2)
    fb.install(2, 4)
    assert wgrad_group_of(fb.schedule_for(2, 4)) == 2
    fb.install(2, 4, costs=CostModel(t_f=1.0, t_b=2.0, t_w=1.0))
    assert wgrad_group_of(fb.schedule_for(2, 4)) == 2
    fb.install(2, 4, schedule=build_schedule("zb-h1", num_ranks=2, num_microbatches=4))
    assert fb.plan_for(2, 4, 0).w_groups == {(0, 0): (), (0, 1): (0, 1), (0, 2): (), (0, 3): (2, 3)}
    assert plan_rank(build_schedule("zb-h1", num_ranks=2, num_microbatches=4), rank=0).w_groups == {}
    claimed = dataclasses.replace(build_schedule("zb-h1", num_ranks=2, num_microbatches=4), meta={"wgrad_group": 2})
    with pytest.raises(ScheduleError, match="not back to back"):
        plan_rank(claimed, rank=0)


def test_install_refuses_another_placement_and_reports_what_cannot_be_built():
    """The install protocol checks the placement the model was built for, and a schedule that cannot be
    built comes back as NotBuilt, naming why, with nothing installed."""
    from megatron_zb.runtime import NotBuilt

    fb = get_forward_backward_func("zb-h1")
    with pytest.raises(RuntimeError, match=r"places stages as \[0, 1, 1, 0\], this rank's model was built for \[0, 1\]"):
        fb.install(2, 4, schedule=build_schedule("zbv", num_ranks=2, num_microbatches=4))
    assert fb.installed(2, 4) is None
    fixed = get_forward_backward_func(build_schedule("zb-h1", num_ranks=2, num_microbatches=4))
    outcome = fixed.install(2, 8)
    assert isinstance(outcome, NotBuilt) and "for 2 pipeline ranks and 4 microbatches" in outcome.reason
    assert fixed.installed(2, 8) is None


def test_bad_schedule_fails_on_the_first_call_naming_the_action():
    sched = build_schedule("zb-h1", num_ranks=2, num_microbatches=4)
    sched.ranks[1] = [a for a in sched.ranks[1] if not (a.op == "W" and a.mb == 2)]
    fb = get_forward_backward_func(sched)
    fb.install(2, 4)   # what the first call does first
    with pytest.raises(ScheduleError, match="W"):
        fb.plan_for(2, 4, 0)


# ---------------------------------------------------------------------- receive posting (matching by order)
def _sent_to(lowered: Schedule, q: int, rank: int) -> list[tuple[str, int, int]]:
    return [(b.op[5:], b.mb, b.stage) for b in lowered.ranks[q] if b.op.startswith("SEND") and b.peer == rank]


@pytest.mark.parametrize("name,p,m", [("zbv", 2, 4), ("zbv", 4, 8), ("v-half", 4, 8), ("interleaved-zb", 4, 8),
                                      ("zb-2p", 4, 8)])
def test_receives_are_ordered_as_the_peer_sends_them(name, p, m):
    sched = build_schedule(name, num_ranks=p, num_microbatches=m)
    for rank in range(p):
        plan = plan_rank(sched, rank=rank)
        for q, order in plan.recv_order.items():
            assert [(a.op[5:], a.mb, a.stage) for a in order] == _sent_to(plan.schedule, q, rank)
            assert sorted(order, key=str) == sorted((a for a in plan.actions if a.op.startswith("RECV") and a.peer == q),
                                                    key=str)


def test_on_the_v_the_peer_sends_in_another_order_than_the_rank_needs():
    """Why matching by order needs recv_order: activations and gradients share the pair of ranks."""
    plan = plan_rank(build_schedule("zbv", num_ranks=2, num_microbatches=4), rank=1)
    needed = [a for a in plan.actions if a.op.startswith("RECV") and a.peer == 0]
    assert list(plan.recv_order[0]) != needed


@pytest.mark.parametrize("name,p,m", [("1f1b", 2, 4), ("zb-h2", 4, 8), ("zbv", 4, 8), ("interleaved-1f1b", 2, 4)])
@pytest.mark.parametrize("lookahead", [0, 1, 3, 8])
def test_program_posts_each_receive_once_in_peer_order_before_it_is_waited_for(name, p, m, lookahead):
    from megatron_zb.runtime.comm_program import Step

    sched = build_schedule(name, num_ranks=p, num_microbatches=m)
    for rank in range(p):
        plan = plan_rank(sched, rank=rank, recv_lookahead=lookahead)
        issues = plan.program.issues
        posted = [s.action for s in issues if s.step is Step.POST]
        for k, s in enumerate(issues):
            if s.step is Step.WAIT:
                assert s.action in [t.action for t in issues[:k] if t.step is Step.POST]  # posted before
        assert sorted(posted, key=str) == sorted((a for a in plan.actions if a.op.startswith("RECV")), key=str)
        for q, order in plan.recv_order.items():       # each peer's receives in its send order
            assert [a for a in posted if a.peer == q] == list(order)
        # compute, sends and waits keep the schedule's order; nothing is posted between a
        # receive's wait and the compute waiting for it
        assert [s.action for s in issues if s.step in (Step.RUN, Step.SEND, Step.WAIT)] == list(plan.actions)
        for prev, nxt in zip(issues, issues[1:]):
            assert not (prev.step is Step.WAIT and nxt.step is Step.POST), (rank, prev, nxt)


def test_posting_ahead_is_bounded_by_the_lookahead():
    """lookahead 0 and 1 post every receive right at its wait; lookahead 3 posts some earlier, never
    3 or more actions ahead of the receive action."""
    from megatron_zb.runtime.comm_program import Step

    sched = build_schedule("zb-h1", num_ranks=4, num_microbatches=8)
    for lookahead in (0, 1, 3):
        plan = plan_rank(sched, rank=1, recv_lookahead=lookahead)
        done, early = 0, 0
        for s in plan.program.issues:
            if s.step is Step.POST:
                gap = plan.actions.index(s.action) - done   # schedule actions still to run before it
                assert gap < max(lookahead, 1), (lookahead, s, gap)
                early += gap > 0
            elif s.step is not Step.RELEASE:
                done += 1
        assert (early > 0) == (lookahead > 1), lookahead

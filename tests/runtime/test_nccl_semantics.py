"""The executor's exact issue order replayed under NCCL's point-to-point semantics (issue 29).

The CPU suite runs on gloo, whose sends are buffered, so a p2p order that deadlocks on NCCL at real
activation sizes passes every CPU test. :mod:`megatron_zb.testing.nccl_model` replays each rank's
:class:`~megatron_zb.runtime.comm_program.Program` -- what :func:`~megatron_zb.runtime.executor.execute`
walks, step by step -- with NCCL's rules: one stream per communicator in issue order, a send
completes only once the peer's receive has started, the host never blocks. Every registered family
must complete at p = 2, 4, 8, in training and forward-only, at every look-ahead.

The negative controls show the model has teeth: the previous p2p layer put both directions of a
pair on one communicator and posted no receive ahead of the rank's own earlier sends (look-ahead 0
here is that order); it deadlocks every family (zbv also forward-only), exactly as the review
predicted, and completes once sends are buffered (gloo, small tensors).
"""

from __future__ import annotations

import functools

import pytest

from megatron_zb.runtime.comm_program import Issue, Step
from megatron_zb.runtime.rank_plan import RECV_LOOKAHEAD, plan_rank
from megatron_zb.schedules import Action, CostModel, Op, Schedule
from megatron_zb.schedules.registry import build_schedule, get_spec, schedule_names
from megatron_zb.testing.nccl_model import per_direction, per_pair, replay

FAMILIES = [n for n in schedule_names() if not n.endswith("-optimal")  # exact solvers: checked at p=2 below
            and not get_spec(n).vocab_parallel]  # vocabulary passes: the runtime does not run them yet
LOOKAHEADS = (0, 1, 2, 4, 8, 1000)


@functools.lru_cache(maxsize=None)
def _schedule(name: str, p: int, m: int) -> Schedule:
    """Unequal costs for the cost-aware families (T_F : T_B : T_W = 1 : 1.2 : 0.7), built once."""
    costs = CostModel(t_f=1.0, t_b=1.2, t_w=0.7, t_comm=0.1) if get_spec(name).cost_aware else None
    return build_schedule(name, num_ranks=p, num_microbatches=m, costs=costs)


def _programs(name: str, p: int, *, forward_only: bool, lookahead: int, m: int | None = None) -> dict:
    sched = _schedule(name, p, m or 2 * p)
    return {r: plan_rank(sched, rank=r, forward_only=forward_only, recv_lookahead=lookahead).program.issues
            for r in range(p)}


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_completes_under_nccl_semantics(name, p):
    for forward_only in (False, True):
        for lookahead in LOOKAHEADS:
            res = replay(_programs(name, p, forward_only=forward_only, lookahead=lookahead))
            what = f"{name} p={p} forward_only={forward_only} lookahead={lookahead}"
            assert res.completed, f"{what}: {res.describe()}"
            assert not res.mismatches, f"{what}: transfers matched out of order {res.mismatches[:3]}"


@pytest.mark.parametrize("name", ["zb-optimal", "zbv-optimal"])
def test_exact_schedules_complete_under_nccl_semantics(name):
    pytest.importorskip("ortools")
    for forward_only in (False, True):
        res = replay(_programs(name, 2, forward_only=forward_only, lookahead=8, m=4))
        assert res.completed, res.describe()


@pytest.mark.parametrize("name", FAMILIES)
def test_one_communicator_per_pair_deadlocks_every_family(name):
    """The previous p2p layer's order (both directions on one stream, receives behind sends)."""
    res = replay(_programs(name, 2, forward_only=False, lookahead=0), channel=per_pair)
    assert not res.completed, name
    assert replay(_programs(name, 2, forward_only=False, lookahead=0), channel=per_pair, eager_sends=True).completed


def test_the_reviewed_1f1b_deadlock_is_the_one_found():
    """p = 2, 1F1B's steady state: rank 0 [send F1, recv B0], rank 1 [send B0, recv F1]."""
    res = replay(_programs("1f1b", 2, forward_only=False, lookahead=0, m=4), channel=per_pair)
    assert "RECV_B(mb=0, stage=1, peer=1)" in res.blocked[0] and "SEND_F(mb=1, stage=0, peer=1)" in res.blocked[0]
    assert "RECV_F(mb=1, stage=0, peer=0)" in res.blocked[1] and "SEND_B(mb=0, stage=1, peer=0)" in res.blocked[1]


def test_zbv_forward_only_deadlocks_on_one_communicator_per_pair():
    assert not replay(_programs("zbv", 4, forward_only=True, lookahead=0), channel=per_pair).completed
    assert replay(_programs("zbv", 4, forward_only=True, lookahead=0)).completed


# ---------------------------------------------------------------- the model itself, worked by hand
def _f(mb: int, stage: int = 0) -> Action:
    return Action(Op.F, mb, stage)


def test_model_a_send_needs_the_receive_started_and_the_gate_passed():
    send = Action(Op.SEND_F, 0, 0, peer=1)
    recv = Action(Op.RECV_F, 0, 0, peer=0)
    ok = {0: [Issue(Step.RUN, _f(0)), Issue(Step.SEND, send)],
          1: [Issue(Step.POST, recv), Issue(Step.WAIT, recv), Issue(Step.RUN, _f(0, 1))]}
    assert replay(ok).completed
    # rank 1 posts its receive only after a compute action that waits for something never sent
    never = Action(Op.RECV_B, 0, 2, peer=2)
    stuck = {0: ok[0], 1: [Issue(Step.POST, never), Issue(Step.WAIT, never), Issue(Step.POST, recv),
                           Issue(Step.WAIT, recv)], 2: []}
    res = replay(stuck)
    assert not res.completed and set(res.blocked) == {0, 1}
    assert replay(stuck, eager_sends=True).blocked.keys() == {1}  # a buffered send completes alone


def test_model_groups_start_and_complete_together():
    """megatron-core's batch_isend_irecv: [send F1, recv B0] as one group on each side completes
    on one communicator, where the same ops one by one deadlock."""
    s_f1, r_f1 = Action(Op.SEND_F, 1, 0, peer=1), Action(Op.RECV_F, 1, 0, peer=0)
    s_b0, r_b0 = Action(Op.SEND_B, 0, 1, peer=0), Action(Op.RECV_B, 0, 1, peer=1)
    single = {0: [Issue(Step.SEND, s_f1), Issue(Step.POST, r_b0), Issue(Step.WAIT, r_b0)],
              1: [Issue(Step.SEND, s_b0), Issue(Step.POST, r_f1), Issue(Step.WAIT, r_f1)]}
    assert not replay(single, channel=per_pair).completed
    assert replay(single, channel=per_direction).completed
    grouped = {0: [(Issue(Step.SEND, s_f1), Issue(Step.POST, r_b0)), Issue(Step.WAIT, r_b0)],
               1: [(Issue(Step.SEND, s_b0), Issue(Step.POST, r_f1)), Issue(Step.WAIT, r_f1)]}
    assert replay(grouped, channel=per_pair).completed


def test_model_reports_transfers_matched_out_of_order():
    a0, a1 = Action(Op.SEND_F, 0, 0, peer=1), Action(Op.SEND_F, 1, 0, peer=1)
    r0, r1 = Action(Op.RECV_F, 0, 0, peer=0), Action(Op.RECV_F, 1, 0, peer=0)
    res = replay({0: [Issue(Step.SEND, a0), Issue(Step.SEND, a1)],
                  1: [Issue(Step.POST, r1), Issue(Step.POST, r0), Issue(Step.WAIT, r0), Issue(Step.WAIT, r1)]})
    assert len(res.mismatches) == 2


def test_release_points_bound_the_held_sends():
    """Each send is released after a receive the peer sends only after posting its receive; the
    bound is the largest number held at once (1F1B at p = 4: rank 0 sends 4 forwards before the
    first gradient comes back -- worked by hand: F0..F3 out, B0 back)."""
    for r, issues in _programs("1f1b", 4, forward_only=False, lookahead=RECV_LOOKAHEAD, m=8).items():
        held, most = set(), 0
        for s in issues:
            if s.step is Step.SEND:
                held.add(s.action)
                most = max(most, len(held))
            elif s.step is Step.RELEASE:
                assert s.action in held
                held.remove(s.action)
        assert most == plan_rank(build_schedule("1f1b", num_ranks=4, num_microbatches=8), rank=r).program.max_outstanding_sends
    plan0 = plan_rank(build_schedule("1f1b", num_ranks=4, num_microbatches=8), rank=0)
    assert plan0.program.max_outstanding_sends == 4

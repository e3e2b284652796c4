"""Every program the runtime plans, replayed under the NCCL model (issues 29 and 39).

The CPU suite runs on gloo: sends are buffered, communicators exist from the start, no hardware
queue is shared. A GPU job has none of that, and an issue order that passes every CPU test can hang
there. :func:`~megatron_zb.runtime.rank_plan.plan_ranks` certifies every rank's program under every
rule of :mod:`megatron_zb.runtime.nccl_model` at once (lazy communicator creation, one hardware queue,
unbuffered sends; :mod:`megatron_zb.runtime.comm_certify`) before the runtime runs it, rotating a
channel's transfers over more communicators where one would wait behind its predecessor, or refuses.

Here: every registered family, its vocabulary forms included, at p = 2, 4, 8 and m = p, 2p, 4p, in
training at every look-ahead the runtime takes (at p = 4 and 8 a rotating sample: :func:`training_lookaheads`) and
forward-only at 0, the default and the largest (at p = 8 the default), is
certified (none refused), on at
most :data:`~megatron_zb.runtime.comm_certify.MAX_SLOTS` communicators per channel -- and the negative
controls show what each part of the certificate is for: without the rotation, without the warm-up,
and with the previous layer's one communicator per pair of ranks, the same programs hang, where the
issue's review said they would. (Recorded calls of real runs: ``test_nccl_recorded.py``.)
"""

from __future__ import annotations

import functools

import pytest

from megatron_zb.runtime.comm_certify import MAX_SLOTS, program_calls
from megatron_zb.runtime.comm_program import Step, slotted_channel
from megatron_zb.runtime.nccl_model import ALL_RULES, Call, Rules, replay
from megatron_zb.runtime.rank_plan import MAX_RECV_LOOKAHEAD, RECV_LOOKAHEAD, plan_rank, plan_ranks
from megatron_zb.runtime.vocab_program import broadcast_sources
from megatron_zb.schedules import CostModel, Schedule
from megatron_zb.schedules.registry import build_schedule, get_spec, schedule_names

FAMILIES = [n for n in schedule_names() if not n.endswith("-optimal")]  # exact solvers: at p=2 below
LOOKAHEADS = range(MAX_RECV_LOOKAHEAD + 1)
FORWARD_ONLY_LOOKAHEADS = (0, RECV_LOOKAHEAD, MAX_RECV_LOOKAHEAD)


def training_lookaheads(name: str, p: int, m: int = 0) -> tuple[int, ...]:
    """The training look-aheads certified at ``p`` pipeline ranks and ``m`` micro batches: all of 0..8 at
    p = 2; at p = 4 and 8 (nine tenths of the cost) 0, the default, 8 and one more that rotates with the
    family's place in the registry (offset by ``p``), so that the families together still cover every
    look-ahead at p = 4 and at p = 8 (fixed, not random: CI runs the same set every time); at p = 8 with
    m = 32 (six tenths of the cost alone) the default only. The full sweeps were measured once
    (docs/runtime.md)."""
    if p < 4:
        return tuple(LOOKAHEADS)
    if p == 8 and m == 4 * p:
        return (RECV_LOOKAHEAD,)
    extra = (FAMILIES.index(name) + p) % len(LOOKAHEADS)
    return tuple(sorted({0, RECV_LOOKAHEAD, MAX_RECV_LOOKAHEAD, extra}))


@functools.lru_cache(maxsize=None)
def _schedule(name: str, p: int, m: int) -> Schedule:
    """Unequal costs for the cost-aware families (T_F : T_B : T_W = 1 : 1.2 : 0.7), built once."""
    costs = CostModel(t_f=1.0, t_b=1.2, t_w=0.7, t_comm=0.1) if get_spec(name).cost_aware else None
    return build_schedule(name, num_ranks=p, num_microbatches=m, costs=costs)


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_is_certified_at_every_lookahead(name):
    """Up to 84 programs per family (p x m x look-ahead: training at :func:`training_lookaheads`,
    forward-only -- only F transfers -- at 0, the default and 8, at p = 8 the default): each certified, on at
    most MAX_SLOTS communicators per channel, every communicator it names in the warm-up sequence."""
    for p in (2, 4, 8):
        for m in (p, 2 * p, 4 * p):
            for forward_only in (False, True):
                for lookahead in ((FORWARD_ONLY_LOOKAHEADS if p < 8 else (RECV_LOOKAHEAD,)) if forward_only
                                  else training_lookaheads(name, p, m)):
                    plans = plan_ranks(_schedule(name, p, m), forward_only=forward_only, recv_lookahead=lookahead)
                    program = plans[0].program
                    assert max(program.slots.values(), default=1) <= MAX_SLOTS
                    named = {c for c, _ in plans[0].communicators}
                    for r, plan in plans.items():
                        assert plan.program.slots == program.slots   # every rank rotates alike
                        assert all(s.slot < program.slots.get(slotted_channel(s, r), 1) for s in plan.program.issues)
                    assert len(named) == len(plans[0].communicators)


def test_the_training_lookaheads_cover_every_lookahead_at_p4_and_p8():
    """The rotation leaves no look-ahead uncertified at p = 4 nor at p = 8 (32 families, 9 look-aheads)."""
    for p in (4, 8):
        assert set().union(*(training_lookaheads(n, p) for n in FAMILIES)) == set(LOOKAHEADS)
    assert training_lookaheads(FAMILIES[0], 2) == tuple(range(9))


@pytest.mark.parametrize("name", [n for n in FAMILIES if get_spec(n).cost_aware])
def test_cost_aware_families_are_certified_with_unit_costs(name):
    """What a run plans before its profiling window: unit costs (another order than the costs above), at
    the default look-ahead, training; at most 6 slots were needed there (zb-2p-vocab at p = 8, m = 32)."""
    for p in (2, 4, 8):
        for m in (p, 2 * p, 4 * p):
            plans = plan_ranks(build_schedule(name, num_ranks=p, num_microbatches=m))
            assert max(plans[0].program.slots.values(), default=1) <= MAX_SLOTS


@pytest.mark.parametrize("name", ["zb-optimal", "zbv-optimal"])
def test_exact_schedules_are_certified(name):
    pytest.importorskip("ortools")
    for forward_only in (False, True):
        plan_ranks(build_schedule(name, num_ranks=2, num_microbatches=4), forward_only=forward_only, recv_lookahead=8)


def test_a_lookahead_beyond_the_bound_is_refused():
    with pytest.raises(ValueError, match=f"recv_lookahead 9: the runtime posts receives 0 to {MAX_RECV_LOOKAHEAD}"):
        plan_rank(build_schedule("zb", num_ranks=2, num_microbatches=4), rank=0, recv_lookahead=9)


# ---------------------------------------------------------------- what each part of the certificate is for
def _uncertified(name: str, p: int, m: int, lookahead: int = RECV_LOOKAHEAD) -> dict:
    """The ranks' programs as planned before certification: one communicator per channel."""
    plans = plan_ranks(_schedule(name, p, m), recv_lookahead=lookahead, validate=False)
    return {r: plan.program for r, plan in plans.items()}


@pytest.mark.parametrize("name,p", [("interleaved-zb", 2), ("interleaved-zb", 4), ("interleaved-zb", 8),
                                    ("v-half", 4)])
def test_without_the_rotation_the_default_lookahead_hangs_on_one_hardware_queue(name, p):
    """The review's finding: at the default look-ahead interleaved-zb (p = 2, 4, 8) and v-half (p = 4)
    hang on one hardware queue -- for some m in {p, 2p, 4p} -- with one communicator per direction
    (a second send of a direction queued before the receive the peer's first send needs); every
    one completes with a stream per communicator, and certified (rotated) under every rule."""
    hung = []
    for m in (p, 2 * p, 4 * p):
        calls = program_calls(_uncertified(name, p, m))
        assert replay(calls, Rules()).completed
        if not replay(calls, Rules(one_queue=True)).completed:
            hung.append(m)
        plans = plan_ranks(_schedule(name, p, m))
        certified = program_calls({r: pl.program for r, pl in plans.items()})
        assert replay(certified, ALL_RULES).completed
    assert hung, f"{name} p={p}: no m hangs without the rotation"


@pytest.mark.parametrize("name", FAMILIES)
def test_without_the_warm_up_the_programs_hang_on_lazy_creation(name):
    """The review's finding: created at their first op, communicators meet in inverted orders -- at
    look-ahead 8 rank 0 posts RECV_B(0) on the 1->0 communicator before its first send on 0->1, rank 1
    posts RECV_F(0) on 0->1 first: each host waits in a creation for the other (every family at p = 2,
    m = 2); a vocabulary schedule's collectives and transfers do so at the default look-ahead too.
    Warmed up in one global order, the same (certified) programs complete."""
    sched = _schedule(name, 2, 2)
    sources = broadcast_sources(sched) if sched.vocab_barriers else {}
    for lookahead in (8, RECV_LOOKAHEAD) if sched.vocab_barriers else (8,):
        programs = {r: pl.program for r, pl in plan_ranks(sched, recv_lookahead=lookahead).items()}
        cold = replay(program_calls(programs, sources=sources, warm=False), Rules(lazy_init=True))
        assert not cold.completed and "host in the creation of" in cold.describe(), lookahead
        assert replay(program_calls(programs, sources=sources), ALL_RULES).completed


@pytest.mark.parametrize("name", [n for n in FAMILIES if not get_spec(n).vocab_parallel])
def test_one_communicator_per_pair_hangs_every_family(name):
    """The p2p layer before issue 29 put both directions of a pair on one communicator and posted no
    receive ahead of the rank's own earlier sends (look-ahead 0 here): every family hangs with
    unbuffered sends and completes with buffered ones (gloo, small tensors)."""
    calls = program_calls(_uncertified(name, 2, 4, lookahead=0), warm=False)
    paired = {r: [_per_pair(c) for c in cs] for r, cs in calls.items()}
    assert not replay(paired, Rules()).completed
    assert replay(paired, Rules(eager_sends=True)).completed


def _per_pair(c: Call) -> Call:
    """``c`` with its direction's communicator replaced by the pair's."""
    if c.comm is None or c.comm[0] != "p2p":
        return c
    return c._replace(comm=("pair",) + tuple(sorted(c.comm[1:3])))


def test_release_points_bound_the_held_sends():
    """Each send is released after a receive the peer sends only after posting its receive; the
    bound is the largest number held at once (1F1B at p = 4: rank 0 sends 4 forwards before the
    first gradient comes back -- worked by hand: F0..F3 out, B0 back)."""
    sched = build_schedule("1f1b", num_ranks=4, num_microbatches=8)
    for r, plan in plan_ranks(sched).items():
        held, most = set(), 0
        for s in plan.program.issues:
            if s.step is Step.SEND:
                held.add(s.action)
                most = max(most, len(held))
            elif s.step is Step.RELEASE:
                assert s.action in held
                held.remove(s.action)
        assert most == plan.program.max_outstanding_sends
    assert plan_rank(sched, rank=0).program.max_outstanding_sends == 4

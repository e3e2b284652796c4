"""One rank's part of a schedule, planned once per schedule, and when that rank posts its receives.

:func:`plan_rank` lowers and checks a schedule and keeps one rank's action list with the indices
the executor (:func:`megatron_zb.runtime.executor.execute`) needs every iteration: where its
receives and sends are, the order each peer sends to it, how many ``W`` actions each stage runs.
:class:`RecvPoster` is the policy by which those receives are posted ahead of use, and
:attr:`RankPlan.program` the rank's whole issue order (:mod:`~megatron_zb.runtime.comm_program`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

from ..schedules import Action, Op, Schedule
from ..schedules.lowering import check_lowered, lower
from ..schedules.wgrad_groups import check_wgrad_groups, group_runs, wgrad_group_of
from .comm_certify import certified_programs, warmup_sequence
from .comm_program import Program, build_programs, issue_order
from .vocab_program import VocabRoles, broadcast_sources


@dataclass(frozen=True)
class RankPlan:
    """One rank's part of a lowered, checked schedule: what the executor (``execute``) walks.

    Built once per schedule by :func:`plan_rank` (lowering and validation cost milliseconds at
    large ``p * m``, which would otherwise be paid, on every rank at once, at the start of every
    iteration) and reused by every iteration.

    Attributes:
        schedule: the lowered schedule (compute and communication actions, all ranks).
        rank: the pipeline rank this plan is for.
        actions: that rank's actions, in execution order.
        recv_positions: indices into ``actions`` of its receives (posted ahead of use).
        out_of_order_stages: stages of this rank whose forwards do not run in microbatch order
            (their data iterators are read through an in-order buffer).
        forward_only: whether the plan keeps only the forwards and their transfers (evaluation).
        recv_order: per peer rank, this rank's receives from it in the order the peer's action
            list sends them -- the order they must be posted in, since transfers are matched by
            order (a V or interleaved placement carries activations and gradients over the same
            pair of ranks, and the peer may send them in another order than this rank needs them).
        recv_slot: ``(op, mb, stage)`` of each receive -> its index in ``recv_order[peer]``.
        w_per_stage: per stage of this rank, how many ``W`` actions it runs (what the
            weight-gradient store is told at the start of each iteration).
        w_groups: with weight-gradient groups (``schedule.meta["wgrad_group"]``,
            :func:`~megatron_zb.schedules.wgrad_groups.group_runs`): ``(stage, mb)`` of a group's last
            ``W`` -> the group's micro batches (the store runs them there, layer-major), of an earlier
            member -> ``()``; empty without groups.
        program: the order in which the executor issues this rank's work (compute, receive
            posts and waits, sends and their releases, vocabulary collectives;
            :mod:`~megatron_zb.runtime.comm_program`).
        communicators: every communicator the programs of all ranks use, with its members, in
            the one order in which every rank creates and warms them up
            (:func:`~megatron_zb.runtime.comm_certify.warmup_sequence`,
            :meth:`~megatron_zb.runtime.channels.Channels.ensure`).
    """

    schedule: Schedule
    rank: int
    actions: tuple[Action, ...]
    recv_positions: tuple[int, ...]
    out_of_order_stages: frozenset[int]
    forward_only: bool
    recv_order: dict[int, tuple[Action, ...]] = field(default_factory=dict)
    recv_slot: dict[tuple[Op, int, int], int] = field(default_factory=dict)
    w_per_stage: dict[int, int] = field(default_factory=dict)
    w_groups: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)
    program: Program = Program((), 0)
    communicators: tuple[tuple[tuple, tuple[int, ...]], ...] = ()


MAX_RECV_LOOKAHEAD = 8
"""The largest look-ahead the runtime takes: posting further ahead holds more receives on each
communicator, and under one hardware queue each waits for the one before it (every registered family
at p = 2, 4, 8 is certified up to 8 with at most 6 communicators per channel; at 1000, where every
receive is posted at once, some need more than :data:`~megatron_zb.runtime.comm_certify.MAX_SLOTS`)."""

RECV_LOOKAHEAD = 4
"""Default of how many plan actions ahead receives are posted: in a steady 1F1B phase (a receive,
a compute action, a send per step) a receive is posted one compute action before the one that
needs it, so the transfer hides behind that action. 8 (two compute actions) costs up to two more
stage-sized buffers on the ranks nearest the pipeline's start (measured: docs/runtime.md
"Pseudo-freed stage outputs")."""


def plan_rank(schedule: Schedule, *, rank: int, forward_only: bool = False, validate: bool = True,
              recv_lookahead: int = RECV_LOOKAHEAD) -> RankPlan:
    """Lower ``schedule`` (unless it already holds communication), check it, and keep ``rank``'s part.

    ``forward_only`` keeps only the forwards and their transfers, in the same order (evaluation).
    ``recv_lookahead``: how many actions ahead receives are posted (:class:`RecvPoster`); the
    issue order of every rank is built with it (:mod:`~megatron_zb.runtime.comm_program`) and
    certified under the NCCL model (:mod:`~megatron_zb.runtime.comm_certify`).
    ``validate=False`` skips the checks and the certificate (only for testing the runtime's own
    safety nets: p2p timeouts and the weight-gradient store's pending-W check). Raises
    :class:`~megatron_zb.schedules.ScheduleError` naming the first bad action, or where the ranks
    stop when no issue order on up to :data:`~megatron_zb.runtime.comm_certify.MAX_SLOTS`
    communicator slots replays to its end.
    """
    if not 0 <= rank < schedule.num_ranks:
        raise ValueError(f"rank {rank} is outside the schedule's {schedule.num_ranks} pipeline ranks")
    return plan_ranks(schedule, forward_only=forward_only, validate=validate, recv_lookahead=recv_lookahead)[rank]


def plan_ranks(schedule: Schedule, *, forward_only: bool = False, validate: bool = True,
               recv_lookahead: int = RECV_LOOKAHEAD) -> dict[int, RankPlan]:
    """Every rank's :func:`plan_rank` (the programs of all ranks are built and certified together)."""
    check_lookahead(recv_lookahead)
    if any(not a.is_compute for _, _, a in schedule.actions()):
        lowered = schedule  # already lowered (e.g. loaded from JSON): run it as written
        if validate:
            check_lowered(lowered)
    else:
        lowered = lower(schedule, check=validate)
    k = wgrad_group_of(lowered)
    if validate and k is not None:
        check_wgrad_groups(lowered, k)
    # every rank's part: a send's release point depends on the order the peer posts and sends
    parts = [_rank_part(lowered, r, forward_only) for r in range(lowered.num_ranks)]

    def orders() -> dict[int, list]:
        return {r: issue_order(part.actions, RecvPoster(part, recv_lookahead),
                               VocabRoles.of(lowered, r, forward_only=forward_only))
                for r, part in enumerate(parts)}

    sources = broadcast_sources(lowered) if lowered.vocab_barriers else {}
    if validate:
        programs, comms = certified_programs(orders, sources=sources, name=schedule.name)
    else:
        programs = build_programs(orders())
        comms = warmup_sequence(programs, sources)
    return {r: replace(part, program=programs[r], communicators=tuple(comms)) for r, part in enumerate(parts)}


def check_lookahead(recv_lookahead: int) -> None:
    """Refuse (``ValueError``) a look-ahead outside ``0 .. MAX_RECV_LOOKAHEAD``."""
    if not 0 <= recv_lookahead <= MAX_RECV_LOOKAHEAD:
        raise ValueError(f"recv_lookahead {recv_lookahead}: the runtime posts receives 0 to {MAX_RECV_LOOKAHEAD} "
                         f"actions ahead (default {RECV_LOOKAHEAD})")


def _rank_part(lowered: Schedule, rank: int, forward_only: bool) -> RankPlan:
    """``rank``'s :class:`RankPlan` without its program."""
    acts = lowered.ranks[rank]
    if forward_only:  # the forwards, their transfers, and the vocabulary passes that give the loss
        acts = [a for a in acts if a.op in (Op.F, Op.SEND_F, Op.RECV_F, Op.IF, Op.S)]
    stages = {a.stage for a in acts if a.op is Op.F}
    mine = {(a.op, a.mb, a.stage): a for a in acts if a.op.is_recv}
    recv_order: dict[int, tuple[Action, ...]] = {}
    for q in sorted({a.peer for a in mine.values()}):
        # the peer's sends to this rank, in its order, as this rank's receive actions
        sent = [mine.get((b.op.matching, b.mb, b.stage)) for b in lowered.ranks[q]
                if b.op.is_send and b.peer == rank]
        recv_order[q] = tuple(a for a in sent if a is not None)
    w_per_stage: dict[int, int] = {}
    for a in acts:
        if a.op is Op.W:
            w_per_stage[a.stage] = w_per_stage.get(a.stage, 0) + 1
    return RankPlan(schedule=lowered, rank=rank, actions=tuple(acts),
                    recv_positions=tuple(i for i, a in enumerate(acts) if a.op.is_recv),
                    out_of_order_stages=frozenset(s for s in stages if _forwards_out_of_order(acts, s)),
                    forward_only=forward_only, recv_order=recv_order,
                    recv_slot={(a.op, a.mb, a.stage): i for order in recv_order.values()
                               for i, a in enumerate(order)},
                    w_per_stage=w_per_stage, w_groups=group_runs(acts, wgrad_group_of(lowered)))


class RecvPoster:
    """When one rank posts its receives: the policy its issue order follows (:func:`issue_order`).

    * Receives from a peer are posted in the order that peer sends them (``plan.recv_order``):
      transfers are matched by order, as on NCCL.
    * Before action ``i`` (:meth:`ahead`), the receives whose ``RECV`` action is among the next
      ``lookahead`` actions are posted. Each direction of each pair of ranks has its own
      communicators (:class:`~megatron_zb.runtime.channels.Channels`), so a receive posted early
      never holds back one of this rank's sends (on NCCL a pair's transfers on one communicator
      run on one stream in posting order).
    * Before waiting at a ``RECV`` (:meth:`through`), that receive and the peer's earlier ones are
      posted if they are not yet.
    """

    def __init__(self, plan: RankPlan, lookahead: int) -> None:
        self.plan, self.lookahead = plan, lookahead
        self._index = plan.recv_slot
        self._posted = {q: 0 for q in plan.recv_order}   # per peer: receives posted, in its order
        self._next = 0                                  # next entry of plan.recv_positions
        self._orphans: set[tuple[Op, int, int]] = set()

    def ahead(self, i: int) -> list[Action]:
        """Receives to post before running action ``i``."""
        plan, out = self.plan, []
        pos = plan.recv_positions
        while self._next < len(pos) and pos[self._next] < i + self.lookahead:
            out += self.through(plan.actions[pos[self._next]])
            self._next += 1
        return out

    def through(self, a: Action) -> list[Action]:
        """Receives to post (in the peer's order) so that ``a``'s receive is posted."""
        key = (a.op, a.mb, a.stage)
        idx = self._index.get(key)
        if idx is None:  # the peer never sends it (only with validate=False): post it, let it time out
            if key in self._orphans:
                return []
            self._orphans.add(key)
            return [a]
        order, q = self.plan.recv_order[a.peer], a.peer
        out = list(order[self._posted[q]:idx + 1])
        self._posted[q] = max(self._posted[q], idx + 1)
        return out


def _forwards_out_of_order(acts: Sequence[Action], stage: int) -> bool:
    mbs = [a.mb for a in acts if a.op is Op.F and a.stage == stage]
    return mbs != sorted(mbs)

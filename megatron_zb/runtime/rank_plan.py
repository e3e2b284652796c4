"""One rank's part of a schedule, planned once per schedule, and when that rank posts its receives.

:func:`plan_rank` lowers and checks a schedule and keeps one rank's action list with the indices
the executor (:func:`megatron_zb.runtime.executor.execute`) needs every iteration: where its
receives and sends are, the order each peer sends to it, how many ``W`` actions each stage runs.
:class:`RecvPoster` is the policy that executor follows to post those receives ahead of use.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Sequence

from ..schedules import Action, Op, Schedule
from ..schedules.lowering import check_lowered, lower


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
        send_positions: per peer rank, indices into ``actions`` of this rank's sends to it.
        recv_slot: ``(op, mb, stage)`` of each receive -> its index in ``recv_order[peer]``.
        w_per_stage: per stage of this rank, how many ``W`` actions it runs (what the
            weight-gradient store is told at the start of each iteration).
    """

    schedule: Schedule
    rank: int
    actions: tuple[Action, ...]
    recv_positions: tuple[int, ...]
    out_of_order_stages: frozenset[int]
    forward_only: bool
    recv_order: dict[int, tuple[Action, ...]] = field(default_factory=dict)
    send_positions: dict[int, tuple[int, ...]] = field(default_factory=dict)
    recv_slot: dict[tuple[Op, int, int], int] = field(default_factory=dict)
    w_per_stage: dict[int, int] = field(default_factory=dict)


def plan_rank(schedule: Schedule, *, rank: int, forward_only: bool = False, validate: bool = True) -> RankPlan:
    """Lower ``schedule`` (unless it already holds communication), check it, and keep ``rank``'s part.

    ``forward_only`` keeps only the forwards and their transfers, in the same order (evaluation).
    ``validate=False`` skips the checks (only for testing the runtime's own safety nets: p2p
    timeouts and the weight-gradient store's pending-W check). Raises
    :class:`~megatron_zb.schedules.ScheduleError` naming the first bad action.
    """
    if not 0 <= rank < schedule.num_ranks:
        raise ValueError(f"rank {rank} is outside the schedule's {schedule.num_ranks} pipeline ranks")
    if any(not a.is_compute for _, _, a in schedule.actions()):
        lowered = schedule  # already lowered (e.g. loaded from JSON): run it as written
        if validate:
            check_lowered(lowered)
    else:
        lowered = lower(schedule, check=validate)
    acts = lowered.ranks[rank]
    if forward_only:
        acts = [a for a in acts if a.op in (Op.F, Op.SEND_F, Op.RECV_F)]
    stages = {a.stage for a in acts if a.op is Op.F}
    mine = {(a.op, a.mb, a.stage): a for a in acts if a.op.is_recv}
    recv_order: dict[int, tuple[Action, ...]] = {}
    for q in sorted({a.peer for a in mine.values()}):
        # the peer's sends to this rank, in its order, as this rank's receive actions
        sent = [mine.get((b.op.matching, b.mb, b.stage)) for b in lowered.ranks[q]
                if b.op.is_send and b.peer == rank]
        recv_order[q] = tuple(a for a in sent if a is not None)
    send_positions: dict[int, list[int]] = {}
    w_per_stage: dict[int, int] = {}
    for i, a in enumerate(acts):
        if a.op.is_send:
            send_positions.setdefault(a.peer, []).append(i)
        elif a.op is Op.W:
            w_per_stage[a.stage] = w_per_stage.get(a.stage, 0) + 1
    return RankPlan(schedule=lowered, rank=rank, actions=tuple(acts),
                    recv_positions=tuple(i for i, a in enumerate(acts) if a.op.is_recv),
                    out_of_order_stages=frozenset(s for s in stages if _forwards_out_of_order(acts, s)),
                    forward_only=forward_only, recv_order=recv_order,
                    send_positions={q: tuple(v) for q, v in send_positions.items()},
                    recv_slot={(a.op, a.mb, a.stage): i for order in recv_order.values()
                               for i, a in enumerate(order)},
                    w_per_stage=w_per_stage)


class RecvPoster:
    """When one rank posts its receives: the policy the executor (``execute``) follows.

    * Receives from a peer are posted in the order that peer sends them (``plan.recv_order``):
      transfers are matched by order, as on NCCL.
    * Before action ``i`` (:meth:`ahead`), the receives whose ``RECV`` action is among the next
      ``lookahead`` actions are posted. With ``behind_sends`` (the default on NCCL), never one
      that would be posted ahead of one of this rank's own earlier sends to the same peer: NCCL
      runs the transfers of a pair of ranks on one stream, in posting order, so a receive posted
      early would hold that send back. gloo has no such stream; there, posting early lets the
      peer's send go out at once (gloo sends only into a receive the peer has announced).
    * Before waiting at a ``RECV`` (:meth:`through`), that receive and the peer's earlier ones are
      posted if they are not yet.
    """

    def __init__(self, plan: RankPlan, lookahead: int, *, behind_sends: bool = True) -> None:
        self.plan, self.lookahead, self.behind_sends = plan, lookahead, behind_sends
        self._index = plan.recv_slot
        self._posted = {q: 0 for q in plan.recv_order}   # per peer: receives posted, in its order
        self._next = 0                                  # next entry of plan.recv_positions
        self._orphans: set[tuple[Op, int, int]] = set()

    def ahead(self, i: int) -> list[Action]:
        """Receives to post before running action ``i``."""
        plan, out = self.plan, []
        pos = plan.recv_positions
        while self._next < len(pos) and pos[self._next] < i + self.lookahead:
            j = pos[self._next]
            if self.behind_sends and self._send_pending(plan.actions[j].peer, i, j):
                break  # it would go ahead of our own earlier send to that peer
            out += self.through(plan.actions[j])
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

    def _send_pending(self, q: int, i: int, j: int) -> bool:
        """Whether this rank has a send to ``q`` at a position in ``[i, j)`` (not issued yet)."""
        pos = self.plan.send_positions.get(q, ())
        k = bisect.bisect_left(pos, i)
        return k < len(pos) and pos[k] < j


def _forwards_out_of_order(acts: Sequence[Action], stage: int) -> bool:
    mbs = [a.mb for a in acts if a.op is Op.F and a.stage == stage]
    return mbs != sorted(mbs)

"""The order in which one rank issues its work: compute, receive posts and waits, sends, releases.

A lowered schedule says *what* each rank does; the executor also has to decide *when* it posts a
receive (ahead of use, so the transfer overlaps compute) and when it lets go of a sent tensor.
Those choices decide whether the pipeline can deadlock on NCCL and how much memory the p2p layer
holds, so they are made once per schedule, here, as data: a :class:`Program` per rank, a tuple of
:class:`Issue` s that :func:`~megatron_zb.runtime.executor.execute` walks one by one and that
:mod:`megatron_zb.runtime.nccl_model` replays under NCCL's semantics (:mod:`~megatron_zb.runtime.comm_certify`).

* ``POST``   -- post the receive of a ``RECV_*`` action (allocates its buffer).
* ``WAIT``   -- wait for a posted receive (on NCCL: the compute stream waits, not the host).
* ``SEND``   -- start a ``SEND_*``.
* ``RELEASE`` -- wait for an earlier send and drop the tensor: placed right after the first
  ``WAIT`` for a receive from the same peer that the peer sends only *after* it posted the
  receive of that send (:func:`_release_points`). From then on the send needs nothing more of
  this rank, so waiting for it cannot deadlock, on any backend; sends with no such point are
  waited for at the end of the iteration. :attr:`Program.max_outstanding_sends` is the bound.
* ``RUN``    -- a compute action (F, B, W, BW, and the vocabulary passes IF, S, T, IB).
* ``COLL``   -- issue a vocabulary-parallel collective (``Issue.coll`` names it); ``WAIT`` with
  ``coll`` set waits for the rank's last one of that kind (:mod:`~megatron_zb.runtime.vocab_program`
  says where they go).

Every ``POST`` / ``SEND`` / ``COLL`` also names its communicator *slot* (:func:`assign_slots`):
the k-th transfer of a direction (and the k-th collective of a kind) travels on slot ``k mod K``
of that direction's (kind's) communicators, the same on both ends. On one hardware queue an op
whose predecessor on its communicator has not completed blocks everything issued after it;
rotating the slots lets that predecessor be ``K`` transfers back. ``K`` is the smallest number
with which every rank's program replays to its end under the NCCL model
(:mod:`~megatron_zb.runtime.comm_certify`).

Receives are posted by :class:`~megatron_zb.runtime.rank_plan.RecvPoster`'s policy: in the order
the peer sends them, up to ``lookahead`` actions ahead, never between a compute action and its
sends (they are on the peer's critical path) nor between a receive and the compute waiting for it.
Every transfer travels on a communicator of its direction (sender -> receiver,
:class:`~megatron_zb.runtime.channels.Channels`): a receive posted early never holds back a send.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Mapping, Sequence

from ..schedules import Action, Op

if TYPE_CHECKING:
    from .rank_plan import RecvPoster
    from .vocab_program import VocabRoles


class Step(enum.Enum):
    """What one :class:`Issue` does (module docstring)."""

    POST = "post"
    WAIT = "wait"
    SEND = "send"
    RELEASE = "release"
    RUN = "run"
    COLL = "coll"


@dataclass(frozen=True)
class Issue:
    """One step of a rank's :class:`Program`: ``step`` applied to the schedule action ``action``.

    Attributes:
        coll: for ``COLL`` and the ``WAIT`` of a collective: the vocabulary collective's kind
            (:mod:`~megatron_zb.runtime.vocab_program`), of microbatch ``action.mb``; else ``""``.
        slot: for ``POST`` / ``SEND`` / ``COLL``: the communicator slot it travels on (module docstring).
    """

    step: Step
    action: Action
    coll: str = ""
    slot: int = 0

    def __str__(self) -> str:
        what = f"{self.coll}(mb={self.action.mb})" if self.coll else str(self.action)
        slot = f" [slot {self.slot}]" if self.slot else ""
        return f"{self.step.value} {what}{slot}"


Channel = tuple
"""What a slot count is kept for: ``("p2p", src, dst)`` (a direction of the pipeline),
``("coll", kind)`` (an all-reduce kind) or ``("bcast", kind)`` (a kind one rank sends to every other)."""


@dataclass(frozen=True)
class Program:
    """One rank's issue order for one iteration, and the most sends it holds at once.

    Attributes:
        issues: the steps, in the order the executor issues them.
        max_outstanding_sends: the largest number of sends started and not yet released at any
            point of ``issues`` (the p2p layer's bound; completed sends are dropped earlier).
        slots: per channel (:func:`channel_of`) how many communicators its issues rotate over
            (:func:`assign_slots`; a channel not named has one).
    """

    issues: tuple[Issue, ...]
    max_outstanding_sends: int
    slots: Mapping[Channel, int] = field(default_factory=dict)


def transfer_key(a: Action) -> tuple[Op, int, int]:
    """``(receive op, microbatch, producing stage)``: the same for a send and its matching receive."""
    return (a.op.matching if a.op.is_send else a.op, a.mb, a.stage)


def issue_order(actions: Sequence[Action], poster: "RecvPoster", vocab: "VocabRoles | None" = None) -> list[Issue]:
    """``actions`` (one rank's lowered list) as POST / WAIT / SEND / RUN steps, posting by ``poster``,
    with the vocabulary collectives of ``vocab`` (this rank's roles) around the compute actions."""
    out: list[Issue] = []
    after_recv = False
    for i, a in enumerate(actions):
        op = a.op
        # look ahead, but not between a compute action and its sends nor between a receive and
        # the compute action waiting for it
        if not (op.is_send or after_recv):
            out += [Issue(Step.POST, r) for r in poster.ahead(i)]
        after_recv = op.is_recv
        if op.is_recv:
            out += [Issue(Step.POST, r) for r in poster.through(a)]
            out.append(Issue(Step.WAIT, a))
        elif op.is_send:
            out.append(Issue(Step.SEND, a))
        else:
            before, after = vocab.around(a) if vocab is not None else ((), ())
            out += [Issue(Step(step), a, coll=kind) for step, kind in before]
            out.append(Issue(Step.RUN, a))
            out += [Issue(Step(step), a, coll=kind) for step, kind in after]
    return out


def channel_of(s: Issue, rank: int) -> Channel:
    """The channel of ``rank``'s issue ``s`` (a ``POST`` / ``SEND`` / ``RELEASE``, or a collective's
    ``COLL`` / ``WAIT``)."""
    if s.coll:
        from .vocab_program import BROADCAST_KINDS

        return ("bcast" if s.coll in BROADCAST_KINDS else "coll", s.coll)
    src, dst = (rank, s.action.peer) if s.step in (Step.SEND, Step.RELEASE) else (s.action.peer, rank)
    return ("p2p", src, dst)


def assign_slots(order: Sequence[Issue], rank: int, slots: Mapping[Channel, int],
                 channels: Sequence[Channel | None] | None = None) -> list[Issue]:
    """``order`` with every POST / SEND / COLL on its communicator slot: the k-th transfer of a
    direction, and the k-th collective of a kind, on slot ``k mod slots[channel]`` (default 1;
    receives are posted in the order the peer sends them, so both ends count alike; every rank
    issues a kind in microbatch order). ``channels``: each issue's :func:`slotted_channel`, if known."""
    if channels is None:
        channels = [slotted_channel(s, rank) for s in order]
    count: dict[Channel, int] = defaultdict(int)
    out = []
    for s, channel in zip(order, channels):
        if channel is not None:
            slot = count[channel] % slots.get(channel, 1)
            if slot != s.slot:
                s = replace(s, slot=slot)
            count[channel] += 1
        out.append(s)
    return out


def slotted_channel(s: Issue, rank: int) -> Channel | None:
    """The channel of a POST / SEND / COLL (the issues that take a slot), else ``None``."""
    return channel_of(s, rank) if s.step in (Step.POST, Step.SEND, Step.COLL) else None


def build_programs(orders: dict[int, list[Issue]], slots: Mapping[Channel, int] | None = None) -> dict[int, Program]:
    """Every rank's :class:`Program` from its issue order (all ranks: a release point depends
    on the order in which the peer posts and sends), on ``slots`` communicators per channel."""
    return reslot(_with_releases(orders), slots or {})


def reslot(programs: Mapping[int, Program], slots: Mapping[Channel, int],
           channels: Mapping[int, Sequence[Channel | None]] | None = None) -> dict[int, Program]:
    """``programs`` on ``slots`` communicators per channel (:func:`assign_slots`; ``channels``: per rank
    each issue's :func:`slotted_channel`, when already known)."""
    slots = dict(slots)
    return {rank: Program(tuple(assign_slots(p.issues, rank, slots, None if channels is None else channels[rank])),
                          p.max_outstanding_sends, slots)
            for rank, p in programs.items()}


def _with_releases(orders: dict[int, list[Issue]]) -> dict[int, Program]:
    """Every rank's program on one slot per channel: its order with the releases inserted."""
    releases = _release_points(orders)
    programs = {}
    for rank, order in orders.items():
        issues: list[Issue] = []
        held = most = 0
        for k, s in enumerate(order):
            issues.append(s)
            if s.step is Step.SEND:
                held += 1
                most = max(most, held)
            for sent in releases[rank].get(k, ()):
                issues.append(Issue(Step.RELEASE, sent))
                held -= 1
        programs[rank] = Program(tuple(issues), most)
    return programs


def _release_points(orders: dict[int, list[Issue]]) -> dict[int, dict[int, list[Action]]]:
    """Per rank: index of a ``WAIT`` in its order -> the sends to release right after it.

    A send ``s`` to peer ``q`` is released after this rank's first later ``WAIT`` for a transfer
    that ``q`` sends after posting the receive of ``s``: once that transfer has arrived, ``q``
    has posted the receive, so ``s`` completes without anything further from this rank.
    """
    posted: dict[int, dict[tuple[Op, int, int], int]] = {}
    sent: dict[int, dict[tuple[Op, int, int], int]] = {}
    for rank, order in orders.items():
        posted[rank] = {transfer_key(s.action): k for k, s in enumerate(order) if s.step is Step.POST}
        sent[rank] = {transfer_key(s.action): k for k, s in enumerate(order) if s.step is Step.SEND}
    out: dict[int, dict[int, list[Action]]] = {}
    for rank, order in orders.items():
        out[rank] = {}
        waits = [(k, s.action) for k, s in enumerate(order) if s.step is Step.WAIT and not s.coll]
        for k, s in enumerate(order):
            if s.step is not Step.SEND:
                continue
            q = s.action.peer
            post_at = posted.get(q, {}).get(transfer_key(s.action))
            if post_at is None:
                continue  # the peer never posts it (validate=False): waited for at the end
            for j, w in waits:
                if j > k and w.peer == q and sent[q].get(transfer_key(w), -1) > post_at:
                    out[rank].setdefault(j, []).append(s.action)
                    break
    return out

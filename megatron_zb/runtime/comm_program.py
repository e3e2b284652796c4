"""The order in which one rank issues its work: compute, receive posts and waits, sends, releases.

A lowered schedule says *what* each rank does; the executor also has to decide *when* it posts a
receive (ahead of use, so the transfer overlaps compute) and when it lets go of a sent tensor.
Those choices decide whether the pipeline can deadlock on NCCL and how much memory the p2p layer
holds, so they are made once per schedule, here, as data: a :class:`Program` per rank, a tuple of
:class:`Issue` s that :func:`~megatron_zb.runtime.executor.execute` walks one by one and that
:mod:`megatron_zb.testing.nccl_model` replays under NCCL's semantics.

* ``POST``   -- post the receive of a ``RECV_*`` action (allocates its buffer).
* ``WAIT``   -- wait for a posted receive (on NCCL: the compute stream waits, not the host).
* ``SEND``   -- start a ``SEND_*``.
* ``RELEASE`` -- wait for an earlier send and drop the tensor: placed right after the first
  ``WAIT`` for a receive from the same peer that the peer sends only *after* it posted the
  receive of that send (:func:`_release_points`). From then on the send needs nothing more of
  this rank, so waiting for it cannot deadlock, on any backend; sends with no such point are
  waited for at the end of the iteration. :attr:`Program.max_outstanding_sends` is the bound.
* ``RUN``    -- a compute action (F, B, W, BW).

Receives are posted by :class:`~megatron_zb.runtime.rank_plan.RecvPoster`'s policy: in the order
the peer sends them, up to ``lookahead`` actions ahead, never between a compute action and its
sends (they are on the peer's critical path) nor between a receive and the compute waiting for it.
Every transfer travels on the communicator of its direction (sender -> receiver,
:class:`~megatron_zb.runtime.p2p.PipeChannels`): a receive posted early never holds back a send.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from ..schedules import Action, Op

if TYPE_CHECKING:
    from .rank_plan import RecvPoster


class Step(enum.Enum):
    """What one :class:`Issue` does (module docstring)."""

    POST = "post"
    WAIT = "wait"
    SEND = "send"
    RELEASE = "release"
    RUN = "run"


@dataclass(frozen=True)
class Issue:
    """One step of a rank's :class:`Program`: ``step`` applied to the schedule action ``action``."""

    step: Step
    action: Action

    def __str__(self) -> str:
        return f"{self.step.value} {self.action}"


@dataclass(frozen=True)
class Program:
    """One rank's issue order for one iteration, and the most sends it holds at once.

    Attributes:
        issues: the steps, in the order the executor issues them.
        max_outstanding_sends: the largest number of sends started and not yet released at any
            point of ``issues`` (the p2p layer's bound; completed sends are dropped earlier).
    """

    issues: tuple[Issue, ...]
    max_outstanding_sends: int


def transfer_key(a: Action) -> tuple[Op, int, int]:
    """``(receive op, microbatch, producing stage)``: the same for a send and its matching receive."""
    return (a.op.matching if a.op.is_send else a.op, a.mb, a.stage)


def issue_order(actions: Sequence[Action], poster: "RecvPoster") -> list[Issue]:
    """``actions`` (one rank's lowered list) as POST / WAIT / SEND / RUN steps, posting by ``poster``."""
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
            out.append(Issue(Step.RUN, a))
    return out


def build_programs(orders: dict[int, list[Issue]]) -> dict[int, Program]:
    """Every rank's :class:`Program` from its issue order (all ranks: a release point depends
    on the order in which the peer posts and sends)."""
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
        waits = [(k, s.action) for k, s in enumerate(order) if s.step is Step.WAIT]
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

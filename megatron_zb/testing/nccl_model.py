"""A model of NCCL's point-to-point semantics that replays the executor's issue order (CPU tests).

The CPU tests run on gloo, whose sends are buffered: a send completes whatever the receiver is
doing. NCCL's are not (above its internal buffer, i.e. at real activation sizes): a send completes
only once the peer's matching receive runs. This module replays every rank's
:class:`~megatron_zb.runtime.comm_program.Program` -- the exact order in which the executor issues
its work -- under NCCL's rules and reports whether the iteration completes:

* The host never blocks (``Work.wait()`` without a timeout only makes the compute stream wait).
* Each rank has one compute stream: ``RUN`` items and the stream waits of ``WAIT`` / ``RELEASE``,
  in issue order.
* Each communicator (``channel(src, dst)``: per direction in megatron-zb, per pair of ranks when
  every transfer shares one process group) has, per rank, one stream that runs its ops in issue
  order; an op starts when the op before it on that stream completed and the compute issued
  before it has run (ProcessGroupNCCL makes its stream wait for the current stream).
* Transfers of a direction on a communicator are matched by order; a send and its receive each
  complete once both have started (``eager_sends=True``: a send completes when it starts, as on
  gloo or below NCCL's buffer size). The ops of one group (a tuple of issues, as
  ``batch_isend_irecv`` makes) start together and complete together.

:func:`replay` is a test tool and the reference of what "cannot deadlock on NCCL" means; it has no
notion of time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Mapping, Sequence, Union

from ..runtime.comm_program import Issue, Step, transfer_key

Entry = Union[Issue, tuple[Issue, ...]]
"""One issued item: a single step, or a group of POST / SEND steps issued together."""


def per_direction(src: int, dst: int) -> Hashable:
    """megatron-zb's communicators: one per direction of each pair of ranks."""
    return (src, dst)


def per_pair(src: int, dst: int) -> Hashable:
    """One communicator per pair of ranks for both directions (all transfers on one process group)."""
    return frozenset((src, dst))


@dataclass
class _Op:
    rank: int
    issue: Issue
    gate: int                      # compute items that must have run before it starts
    group: int                     # ops with the same group id start and complete together
    stream: tuple = ()             # (rank, communicator): the stream it runs on
    index: int = 0                 # its place on that stream
    started: bool = False
    done: bool = False
    match: "_Op | None" = None


@dataclass
class ReplayResult:
    """What :func:`replay` found.

    Attributes:
        completed: whether every rank ran all its work and every transfer completed (the end of
            an iteration waits for every send).
        blocked: per rank that did not finish, what its compute stream waits for and the ops at
            the head of its communicator streams (empty when completed).
        mismatches: transfers matched by order whose keys differ (data would go to the wrong
            tensor), as ``(send, receive)`` descriptions.
    """

    completed: bool
    blocked: dict[int, str] = field(default_factory=dict)
    mismatches: list[tuple[str, str]] = field(default_factory=list)

    def describe(self) -> str:
        return "completed" if self.completed else "; ".join(f"rank {r}: {b}" for r, b in sorted(self.blocked.items()))


def replay(programs: Mapping[int, Sequence[Entry]], *, channel: Callable[[int, int], Hashable] = per_direction,
           eager_sends: bool = False) -> ReplayResult:
    """Replay ``programs`` (rank -> issued entries) under NCCL's semantics (module docstring)."""
    compute: dict[int, list[Issue | _Op]] = {r: [] for r in programs}    # RUN issues, or the op waited for
    streams: dict[tuple[int, Hashable], list[_Op]] = {}
    by_key: dict[tuple[int, tuple], _Op] = {}
    groups: dict[int, list[_Op]] = {}
    for rank, entries in programs.items():
        for entry in entries:
            issues = entry if isinstance(entry, tuple) else (entry,)
            gid = len(groups)
            for s in issues:
                if s.step is Step.RUN:
                    compute[rank].append(s)
                elif s.step in (Step.WAIT, Step.RELEASE):
                    compute[rank].append(by_key[(rank, _op_key(s))])
                else:
                    src, dst = (rank, s.action.peer) if s.step is Step.SEND else (s.action.peer, rank)
                    op = _Op(rank, s, gate=len(compute[rank]), group=gid, stream=(rank, channel(src, dst)))
                    groups.setdefault(gid, []).append(op)
                    op.index = len(streams.setdefault(op.stream, []))
                    streams[op.stream].append(op)
                    by_key[(rank, _op_key(s))] = op
    mismatches = _match(streams)
    pos = _run(compute, streams, groups, eager_sends)
    blocked = {r: _blocked(r, compute[r][pos[r]] if pos[r] < len(compute[r]) else None, streams)
               for r in programs if pos[r] < len(compute[r]) or any(not op.done for op in _ops_of(r, streams))}
    return ReplayResult(completed=not blocked, blocked=blocked, mismatches=mismatches)


def _op_key(s: Issue) -> tuple:
    return ("send" if s.step in (Step.SEND, Step.RELEASE) else "recv", transfer_key(s.action))


def _match(streams: dict[tuple[int, Hashable], list[_Op]]) -> list[tuple[str, str]]:
    """Pair the k-th send of each direction with the k-th receive of it on the same communicator."""
    sends: dict[tuple[int, int], list[_Op]] = {}
    recvs: dict[tuple[int, int], list[_Op]] = {}
    for (rank, _), ops in streams.items():
        for op in ops:
            if op.issue.step is Step.SEND:
                sends.setdefault((rank, op.issue.action.peer), []).append(op)
            else:
                recvs.setdefault((op.issue.action.peer, rank), []).append(op)
    bad = []
    for direction, ss in sends.items():
        for s, r in zip(ss, recvs.get(direction, [])):
            s.match, r.match = r, s
            if transfer_key(s.issue.action) != transfer_key(r.issue.action):
                bad.append((str(s.issue), str(r.issue)))
    return bad


def _run(compute: dict[int, list], streams: dict[tuple[int, Hashable], list[_Op]],
         groups: dict[int, list[_Op]], eager_sends: bool) -> dict[int, int]:
    """Advance every stream until nothing moves; return each compute stream's position.

    Work-list driven: a compute stream is looked at again when an op it may wait for completes,
    a communicator stream when its head completes or its rank's compute moves (gates), a group
    when one of its ops or one of their other ends starts.
    """
    pos = {r: 0 for r in compute}
    heads = {k: 0 for k in streams}
    by_rank: dict[int, list[tuple[int, Hashable]]] = {}
    for k in streams:
        by_rank.setdefault(k[0], []).append(k)
    todo: deque[tuple[str, Any]] = deque([("compute", r) for r in compute] + [("stream", k) for k in streams])
    while todo:
        kind, x = todo.popleft()
        if kind == "compute":
            items, moved = compute[x], False
            while pos[x] < len(items) and (isinstance(items[pos[x]], Issue) or items[pos[x]].done):
                pos[x] += 1
                moved = True
            if moved:
                todo.extend(("stream", k) for k in by_rank.get(x, ()))
        elif kind == "stream":
            ops = streams[x]
            while heads[x] < len(ops) and ops[heads[x]].done:
                heads[x] += 1
            if heads[x] < len(ops) and not ops[heads[x]].started:
                gid = ops[heads[x]].group
                group = groups[gid]
                if all(pos[op.rank] >= op.gate and all(o.group == gid for o in streams[op.stream][heads[op.stream]:op.index])
                       for op in group):
                    for op in group:
                        op.started = True
                    todo.append(("group", gid))
                    todo.extend(("group", op.match.group) for op in group if op.match is not None)
        elif not groups[x][0].done and all(op.started and _met(op, eager_sends) for op in groups[x]):
            for op in groups[x]:
                op.done = True
                todo.append(("stream", op.stream))
                todo.append(("compute", op.rank))
    return pos


def _met(op: _Op, eager_sends: bool) -> bool:
    """Whether ``op``'s transfer has met its other end (a buffered send needs no other end)."""
    if eager_sends and op.issue.step is Step.SEND:
        return True
    return op.match is not None and op.match.started


def _ops_of(rank: int, streams: dict[tuple[int, Hashable], list[_Op]]) -> list[_Op]:
    return [op for (r, _), ops in streams.items() if r == rank for op in ops]


def _blocked(rank: int, item: Issue | _Op | None, streams: dict[tuple[int, Hashable], list[_Op]]) -> str:
    waits = "nothing (its compute ran)" if item is None else item.issue if isinstance(item, _Op) else item
    heads = [str(next(op.issue for op in ops if not op.done)) for (r, _), ops in streams.items()
             if r == rank and not all(op.done for op in ops)]
    return f"compute waits for {waits}; communicator heads: {', '.join(heads) or 'none'}"

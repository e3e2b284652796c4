"""A model of NCCL and CUDA that replays what each rank issues and says whether the ranks can finish.

The CPU tests run on gloo: sends are buffered, waits block the host, communicators exist from the
start, and nothing shares a hardware queue. A GPU job differs in every one of those, and each
difference can hang an issue order that passes every CPU test. :func:`replay` plays every rank's
:class:`Call` s -- the host's issue order -- under the rules below and reports whether every rank
ran to its end; :class:`Rules` switches the rules that real NCCL/CUDA may or may not apply:

* **Host.** A rank's host issues its calls in order and never blocks, except at a
  ``HOST_WAIT`` (until the op waited for completed: gloo's wait, a wait with a timeout), a
  ``SYNC`` (until the compute stream ran everything issued before it: ``.item()``, ``torch.equal``
  on CUDA tensors, ``synchronize``), and a communicator's creation.
* **Creation is a host rendezvous.** ``CREATE`` (an eager creation, e.g. a warm-up op) blocks
  the host until every member of the communicator reached its own creation of it. With
  ``Rules.lazy_init`` a communicator not created yet is created at its first op (NCCL without
  ``device_id`` passed to ``init_process_group``: one communicator per group for collectives and
  batched p2p, one per pair of ranks for unbatched p2p).
* **Streams.** Each rank has one compute stream (``RUN`` and the stream waits ``WAIT``, in issue
  order) and, per communicator, one stream that runs its ops in issue order; an op starts when the
  op before it on its stream completed and the compute issued before it has run (ProcessGroupNCCL
  makes its stream wait for the current stream).
* **One hardware queue** (``Rules.one_queue``: ``CUDA_DEVICE_MAX_CONNECTIONS=1``): all streams
  of a rank feed one queue in issue order; the item at its head is dispatched only when it can
  start (a ``WAIT`` when its op completed, an op when its stream predecessor completed), and
  nothing behind it is dispatched before it -- per-communicator streams stop being independent.
* **Matching.** On a communicator the k-th send from ``a`` to ``b`` meets the k-th receive of
  ``b`` from ``a``; the k-th collective of every member meet each other. A p2p op completes once
  both ends started (``Rules.eager_sends``: a send completes when it starts, as on gloo or below
  NCCL's buffer), a collective once every member's started. The ops of one group (a tuple of
  calls: ``batch_isend_irecv``, coalesced collectives) start together and complete together.
* **Threads.** NCCL calls (ops and creations) from more than one host thread of a rank are
  refused (:attr:`ReplayResult.refused`): NCCL does not order them, and their order can differ
  between ranks.

Every rule reproduces its hazard on a hand-made case (``tests/runtime/test_nccl_model.py``), and
megatron-core's own 1F1B and interleaved schedules, recorded on gloo, replay clean under every
rule at once (``tests/runtime/test_nccl_recorded.py``): the control that the model is not
stricter than NCCL where megatron-core is known to work. :func:`replay` has no notion of time.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Hashable, Mapping, NamedTuple, Sequence, Union

__all__ = ["Call", "Entry", "Kind", "ReplayResult", "Rules", "ALL_RULES", "calls_of", "replay"]


class Kind(enum.Enum):
    """What one :class:`Call` does (module docstring)."""

    SEND = "send"
    RECV = "recv"
    COLL = "coll"
    RUN = "run"
    WAIT = "wait"            # the compute stream waits for an op (NCCL's Work.wait())
    HOST_WAIT = "host_wait"  # the host waits for an op
    SYNC = "sync"            # the host waits for the compute stream
    CREATE = "create"        # eager creation of a communicator


OPS = (Kind.SEND, Kind.RECV, Kind.COLL)


class Call(NamedTuple):
    """One call of a rank's host (a named tuple: the certifier builds tens of thousands per plan).

    Attributes:
        kind: what it does.
        comm: the communicator (ops and ``CREATE``): any hashable, the same on every member.
        members: the communicator's ranks (ops and ``CREATE``).
        peer: the other end of a ``SEND`` / ``RECV``.
        key: what an op carries, the same on both ends of a transfer and on every member of a
            collective (a mismatch is reported); ``WAIT`` / ``HOST_WAIT``: the ``ref`` of the op of
            this rank waited for (the last one issued with it).
        ref: how a ``WAIT`` names this op (default: ``key``; a recorded run gives each op its own).
        thread: the host thread that issues it.
        label: for reports (``RUN``: the action).
    """

    kind: Kind
    comm: Hashable = None
    members: tuple = ()
    peer: int | None = None
    key: Hashable = None
    ref: Hashable = None
    thread: str = "main"
    label: str = ""

    def __str__(self) -> str:
        if self.kind is Kind.RUN:
            return f"run {self.label}"
        if self.kind in (Kind.WAIT, Kind.HOST_WAIT):
            return f"{self.kind.value} {self.key}"
        if self.kind is Kind.SYNC:
            return "sync"
        what = "" if self.kind is Kind.CREATE else f" {self.key}"
        peer = f" peer {self.peer}" if self.peer is not None else ""
        return f"{self.kind.value}{what} on {self.comm}{peer}"


Entry = Union[Call, tuple[Call, ...]]
"""One issued item: a call, or a group of ops issued together."""


@dataclass(frozen=True)
class Rules:
    """Which of NCCL/CUDA's behaviours the replay applies (module docstring).

    Attributes:
        lazy_init: a communicator is created at its first op, a host rendezvous of its members.
        one_queue: every stream of a rank feeds one hardware queue (``CUDA_DEVICE_MAX_CONNECTIONS=1``).
        eager_sends: a send completes when it starts (gloo, or a tensor under NCCL's buffer).
    """

    lazy_init: bool = False
    one_queue: bool = False
    eager_sends: bool = False

    def __str__(self) -> str:
        on = [n for n in ("lazy_init", "one_queue", "eager_sends") if getattr(self, n)]
        return "+".join(on) or "streams only"


ALL_RULES = Rules(lazy_init=True, one_queue=True)
"""Every hazard switched on (sends unbuffered, as at real activation sizes)."""


@dataclass
class ReplayResult:
    """What :func:`replay` found.

    Attributes:
        completed: whether every rank issued all its calls and every op completed.
        blocked: per rank that did not finish, where its host and its device stand.
        mismatches: ops matched by order whose keys differ (data would go to the wrong tensor).
        refused: why the calls were not replayed (NCCL calls from two host threads), else ``""``.
        held_back: the communicators of ops that cannot start only because the op before them on
            their communicator has not completed (where the ranks stopped): the ones a rotation
            over more communicators would free (:mod:`~megatron_zb.runtime.comm_certify`).
    """

    completed: bool
    blocked: dict[int, str] = field(default_factory=dict)
    mismatches: list[tuple[str, str]] = field(default_factory=list)
    refused: str = ""
    held_back: set = field(default_factory=set)

    def describe(self) -> str:
        if self.refused:
            return f"refused: {self.refused}"
        return "completed" if self.completed else "; ".join(f"rank {r}: {b}" for r, b in sorted(self.blocked.items()))


class _Op:
    """One op of a rank during the replay (a plain class with slots: a replay makes tens of thousands)."""

    __slots__ = ("rank", "call", "index", "gate", "group", "prev", "meets", "started", "_done", "_need")

    def __init__(self, rank: int, call: Call, index: int, group: list["_Op"]) -> None:
        self.rank, self.call, self.index, self.group = rank, call, index, group
        self.gate = 0                      # compute items issued before it
        self.prev: _Op | None = None       # the op before it on its stream
        self.meets: list[_Op] = []         # its other end(s), by matching
        self.started = self._done = False
        self._need = len(call.members) - 1 if call.kind is Kind.COLL else 1

    def met(self, eager_sends: bool) -> bool:
        if not self.started:
            return False
        if eager_sends and self.call.kind is Kind.SEND:
            return True
        return len(self.meets) == self._need and all(o.started for o in self.meets)

    def done(self, eager_sends: bool) -> bool:
        if not self._done and all(o.met(eager_sends) for o in self.group):
            for o in self.group:
                o._done = True
        return self._done

    def __str__(self) -> str:
        return str(self.call)


@dataclass(eq=False)
class _Rank:
    """One rank's host and device during the replay."""

    rank: int
    entries: Sequence[Entry]
    host: int = 0                                   # next entry to issue
    compute: list = field(default_factory=list)     # RUN labels or the _Op a WAIT waits for
    queue: list = field(default_factory=list)       # one queue: every item in issue order
    cptr: int = 0                                   # compute stream / queue position
    streams: dict = field(default_factory=dict)     # comm -> its ops on this rank, in issue order
    heads: dict = field(default_factory=dict)       # comm -> index of its first op not started
    last: dict = field(default_factory=dict)        # op key -> the last op issued with it
    arrived: set = field(default_factory=set)       # communicators whose creation this host reached


def replay(programs: Mapping[int, Sequence[Entry]], rules: Rules = Rules(), *,
           created: Sequence[Hashable] = ()) -> ReplayResult:
    """Replay ``programs`` (rank -> issued entries) under ``rules`` (module docstring).

    ``created``: communicators that exist before the first call (e.g. the default group's).
    """
    refused = _threads(programs)
    if refused:
        return ReplayResult(False, refused=refused)
    ranks = {r: _Rank(r, entries) for r, entries in programs.items()}
    sim = _Replay(ranks, rules, set(created))
    mismatches = sim.match()
    sim.run()
    blocked = {r: sim.describe(st) for r, st in ranks.items() if not sim.finished(st)}
    held = {c for st in ranks.values() for c in sim.held_back(st)} if blocked else set()
    return ReplayResult(completed=not blocked, blocked=blocked, mismatches=mismatches, held_back=held)


def _threads(programs: Mapping[int, Sequence[Entry]]) -> str:
    for rank, entries in programs.items():
        threads = {c.thread for e in entries for c in _group(e) if c.kind in OPS or c.kind is Kind.CREATE}
        if len(threads) > 1:
            return f"rank {rank} issues NCCL calls from host threads {', '.join(sorted(threads))}"
    return ""


class _Replay:
    """The state of one replay: every rank, the communicators created and waited for."""

    def __init__(self, ranks: dict[int, _Rank], rules: Rules, created: set) -> None:
        self.ranks, self.rules, self.created = ranks, rules, created
        self.eager = rules.eager_sends
        self.arrivals: dict[Hashable, set[int]] = defaultdict(set)
        self.members: dict[Hashable, tuple[int, ...]] = {}
        # every rank's ops in issue order, known before the replay (the host issues in order)
        self.ops: dict[int, list[_Op]] = {}
        self.groups: dict[tuple[int, int], list[_Op]] = {}   # (rank, entry index) -> its ops
        for r, st in ranks.items():
            self.ops[r] = []
            ops = self.ops[r]
            for i, e in enumerate(st.entries):
                group: list[_Op] = []
                for c in ((e,) if type(e) is Call else e):
                    if c.kind in OPS:
                        op = _Op(r, c, i, group=group)
                        group.append(op)
                        ops.append(op)
                    if c.comm is not None and c.comm not in self.members:
                        self.members[c.comm] = tuple(sorted(c.members))
                if group:
                    self.groups[(r, i)] = group

    def match(self) -> list[tuple[str, str]]:
        """Pair sends with receives and collectives with each other, by order (module docstring)."""
        sends, recvs, colls = defaultdict(list), defaultdict(list), defaultdict(list)
        for r, ops in self.ops.items():
            for op in ops:
                c = op.call
                if c.kind is Kind.SEND:
                    sends[(c.comm, r, c.peer)].append(op)
                elif c.kind is Kind.RECV:
                    recvs[(c.comm, c.peer, r)].append(op)
                else:
                    colls[(c.comm, r)].append(op)
        bad = []
        for k, ss in sends.items():
            for s, v in zip(ss, recvs.get(k, [])):
                s.meets, v.meets = [v], [s]
                if s.call.key != v.call.key:
                    bad.append((str(s), str(v)))
        by_comm = defaultdict(dict)
        for (comm, r), ops in colls.items():
            by_comm[comm][r] = ops
        for comm, per_rank in by_comm.items():
            if set(per_rank) != set(self.members[comm]):
                continue  # a member never issues one: none completes (reported as blocked)
            for nth in zip(*per_rank.values()):
                for op in nth:
                    op.meets = [o for o in nth if o is not op]
                keys = {op.call.key for op in nth}
                if len(keys) > 1:
                    bad.append((str(nth[0]), " / ".join(str(o) for o in nth[1:])))
        return bad

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        moved = True
        while moved:
            moved = False
            for st in self.ranks.values():
                moved |= self._host(st)
                moved |= self._device(st)

    def _host(self, st: _Rank) -> bool:
        """Issue as many of ``st``'s entries as its host can; whether anything moved."""
        moved = False
        entries = st.entries
        while st.host < len(entries):
            e = entries[st.host]
            calls = (e,) if type(e) is Call else e
            c = calls[0]
            if c.kind is Kind.CREATE:
                if not self._created(st, c.comm):
                    break
            elif c.kind is Kind.HOST_WAIT:
                if not st.last[c.key].done(self.eager):
                    break
            elif c.kind is Kind.SYNC:
                if st.cptr < len(st.queue if self.rules.one_queue else st.compute):
                    break
            elif c.kind in OPS:
                if self.rules.lazy_init and not all(self._created(st, x.comm) for x in calls):
                    break
                self._issue_ops(st)
            else:
                self._issue_compute(st, c)
            st.host += 1
            moved = True
        return moved

    def _created(self, st: _Rank, comm: Hashable) -> bool:
        """Whether ``comm`` exists; ``st``'s host arrives at its creation if not (a rendezvous)."""
        if comm in self.created:
            return True
        self.arrivals[comm].add(st.rank)
        st.arrived.add(comm)
        if self.arrivals[comm] >= set(self.members[comm]):
            self.created.add(comm)
            return True
        return False

    def _issue_compute(self, st: _Rank, c: Call) -> None:
        item = c.label if c.kind is Kind.RUN else st.last[c.key]
        (st.queue if self.rules.one_queue else st.compute).append(item)

    def _issue_ops(self, st: _Rank) -> None:
        group = self.groups[(st.rank, st.host)]
        before = {op.call.comm: (st.streams.get(op.call.comm) or [None])[-1] for op in group}
        gate = len(st.compute)   # the compute items issued before the group
        for op in group:
            c = op.call
            op.gate = gate
            if c.comm not in st.heads:
                st.heads[c.comm] = 0
                st.streams[c.comm] = []
            op.prev = before[c.comm]   # the op before the group on its stream (a group starts as one)
            st.streams[c.comm].append(op)
            st.last[c.key if c.ref is None else c.ref] = op
        if self.rules.one_queue:
            st.queue.append(group)

    def _device(self, st: _Rank) -> bool:
        """Run what ``st``'s device can; whether anything moved."""
        if self.rules.one_queue:
            return self._one_queue(st)
        moved = False
        while st.cptr < len(st.compute):
            item = st.compute[st.cptr]
            if isinstance(item, _Op) and not item.done(self.eager):
                break
            st.cptr += 1
            moved = True
        for comm, ops in st.streams.items():
            while st.heads[comm] < len(ops):   # only the first op not started on a stream can start
                op = ops[st.heads[comm]]
                if not op.started:
                    if not all(self._can_start(o) for o in op.group):
                        break
                    for o in op.group:
                        o.started = True
                    moved = True
                st.heads[comm] += 1
        return moved

    def _can_start(self, op: _Op) -> bool:
        st = self.ranks[op.rank]
        if op.prev is not None and not op.prev.done(self.eager):
            return False
        return self.rules.one_queue or st.cptr >= op.gate

    def _one_queue(self, st: _Rank) -> bool:
        moved = False
        while st.cptr < len(st.queue):
            item = st.queue[st.cptr]
            if isinstance(item, list):           # a group of ops: dispatched together
                if not all(self._can_start(o) for o in item):
                    break
                for o in item:
                    o.started = True
            elif isinstance(item, _Op) and not item.done(self.eager):
                break
            st.cptr += 1
            moved = True
        return moved

    # ------------------------------------------------------------------ the verdict
    def finished(self, st: _Rank) -> bool:
        if st.host < len(st.entries):
            return False
        if st.cptr < len(st.queue if self.rules.one_queue else st.compute):
            return False
        return all(op.done(self.eager) for op in self.ops[st.rank])

    def held_back(self, st: _Rank) -> set:
        """The communicators of ``st``'s ops that could start but for their predecessor."""
        if self.rules.one_queue:
            head = st.queue[st.cptr] if st.cptr < len(st.queue) else None
            heads = [head] if isinstance(head, list) else []
        else:
            heads = [ops[st.heads[c]].group for c, ops in st.streams.items() if st.heads[c] < len(ops)]
            heads = [g for g in heads if all(st.cptr >= o.gate for o in g if o.rank == st.rank)]
        return {o.call.comm for g in heads for o in g if o.prev is not None and not o.prev.done(self.eager)}

    def describe(self, st: _Rank) -> str:
        """Where ``st``'s host and device stand, and which ranks they wait for."""
        if st.host < len(st.entries):
            e = st.entries[st.host]
            c = _group(e)[0]
            if c.kind is Kind.CREATE or (c.kind in OPS and self.rules.lazy_init):
                comm = next(x.comm for x in _group(e) if x.comm not in self.created)
                missing = sorted(set(self.members[comm]) - self.arrivals[comm])
                host = f"host in the creation of {comm} for {_entry(e)} (waits for rank(s) {missing})"
            elif c.kind is Kind.HOST_WAIT:
                host = f"host waits for {self._why(st.last[c.key])}"
            else:
                host = f"host waits at {_entry(e)} for the compute stream"
        else:
            host = "host issued everything"
        items = st.queue if self.rules.one_queue else st.compute
        head = items[st.cptr] if st.cptr < len(items) else None
        if head is None:
            dev = "device ran everything issued" if self.rules.one_queue else "compute ran"
        elif isinstance(head, list):
            prev = next(o.prev for o in head if o.prev is not None and not o.prev.done(self.eager))
            dev = f"queue head {_item(head)} waits for its predecessor {self._why(prev)}"
        elif isinstance(head, _Op):
            dev = f"{'queue head' if self.rules.one_queue else 'compute'} waits for {self._why(head)}"
        else:
            dev = f"at {head}"
        return f"{host}; {dev}"

    def _why(self, op: _Op) -> str:
        """``op`` and what it waits for: the op before it on its communicator, or the ranks whose
        matching op has not started."""
        if not op.started and op.prev is not None and not op.prev.done(self.eager):
            return f"{op} (behind {self._why(op.prev)} on its communicator)"
        if op.started and not op.meets and op.call.kind is not Kind.SEND:
            return f"{op} (never matched)"
        waiting = sorted({o.rank for g in op.group for o in g.meets if not o.started}
                         | ({op.rank} if not op.started else set()))
        return f"{op} (not started on rank(s) {waiting})"


def calls_of(e: Entry) -> tuple[Call, ...]:
    """The calls of an entry (a call is a named tuple too: tell them apart by type)."""
    return (e,) if isinstance(e, Call) else e


_group = calls_of


def _entry(e: Entry) -> str:
    return " + ".join(str(c) for c in _group(e))


def _item(x: object) -> str:
    if isinstance(x, list):
        return " + ".join(str(o) for o in x)
    return str(x)

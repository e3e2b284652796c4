"""Every schedule's programs replayed under the NCCL model before they run: the certificate and its slots.

:func:`certified_programs` builds every rank's :class:`~megatron_zb.runtime.comm_program.Program`
and replays all of them under :data:`~megatron_zb.runtime.nccl_model.ALL_RULES` -- lazy
communicator creation, one hardware queue per rank (``CUDA_DEVICE_MAX_CONNECTIONS=1``) and sends
that wait for their receive. Where the ranks stop with an op held back only by the op before it
on its communicator, that op's channel gets one more communicator *slot* (its ops rotate over
them, :func:`~megatron_zb.runtime.comm_program.assign_slots`), and the programs are replayed
again, until they complete -- so no program the runtime runs can hang on those rules (the model is
monotone: a program that completes under every rule completes under any subset) -- or a channel
would need more than :data:`MAX_SLOTS`, which refuses the schedule. What is replayed is what the
runtime issues (:func:`program_calls`):

* the **warm-up** (:func:`warmup_sequence`): every communicator the programs use, created before
  the first iteration by one tiny op in one global order (slot, then channel), which all ranks
  follow -- a creation is a host rendezvous of the members, and in one total order no two ranks
  can wait for each other's;
* the **iteration**: ``POST`` / ``SEND`` as unbatched p2p ops on the direction's slot
  communicator, ``WAIT`` and ``RELEASE`` as stream waits (NCCL's ``Work.wait()``), an all-reduce
  kind's ``COLL`` as a collective of every pipeline rank on the kind's slot communicator, a
  broadcast kind's ``COLL`` as a send from its source to every other rank (a receive on the
  others: :mod:`~megatron_zb.runtime.vocab_program`); ``RUN`` is left out (compute never blocks:
  nothing in the model waits for it);
* the **end**: the waits :meth:`PipeComm.finish <megatron_zb.runtime.p2p.PipeComm.finish>` and
  :meth:`VocabPasses.finish <megatron_zb.runtime.vocab_runtime.VocabPasses.finish>` make for every
  send and collective not waited for earlier.

Pure Python (no torch): the planner and the tests call it too.
"""

from __future__ import annotations

from typing import Callable, Hashable, Mapping, Sequence

from ..schedules import ScheduleError
from .comm_program import Channel, Issue, Program, Step, build_programs, channel_of, reslot, slotted_channel, transfer_key
from .nccl_model import ALL_RULES, Call, Entry, Kind, ReplayResult, replay
from .vocab_program import VOCAB_KINDS

__all__ = ["MAX_SLOTS", "certified_programs", "program_calls", "warmup_sequence"]

MAX_SLOTS = 8
"""The most communicators one channel may rotate over (each is an NCCL communicator and its
buffers). Every registered family at p = 2, 4, 8, m up to 4p and any look-ahead up to 8 needs at most 4
with the costs of ``tests/runtime/test_nccl_semantics.py`` (T_F : T_B : T_W = 1 : 1.2 : 0.7) and at most 6
with unit costs (``zb-2p-vocab-1/2`` at p = 8, m = 32: a direction of the pipeline), measured 2026-12-07."""

Comm = tuple  # ("p2p", src, dst, slot), ("coll", kind, slot) or ("bcast", kind, src, dst, slot)


def warmup_sequence(programs: Mapping[int, Program], sources: Mapping[str, int]) -> list[tuple[Comm, tuple[int, ...]]]:
    """Every communicator the programs use, with its members, in the one global order of their
    creation (:func:`_creation_order`): slot by slot; within a slot the pipeline's directions in
    ``(src, dst)`` order, then the vocabulary kinds in :data:`VOCAB_KINDS` order (a broadcast kind's
    pairs by receiver)."""
    convert = _Converter(sources, tuple(sorted(programs)))
    convert.calls(programs, warm=True)
    return convert.sequence


_KIND_ORDER = {k: i for i, k in enumerate(VOCAB_KINDS)}


def _creation_order(c: Comm) -> tuple:
    """The global creation order of :func:`warmup_sequence`."""
    return (c[-1], c[0] != "p2p", _KIND_ORDER.get(c[1], -1), c[1:-1] if c[0] == "p2p" else c[2:-1])


def program_calls(programs: Mapping[int, Program], *, sources: Mapping[str, int] | None = None,
                  warm: bool = True) -> dict[int, list[Entry]]:
    """What each rank issues for ``programs`` (module docstring), as the NCCL model's calls;
    ``sources``: the rank that sends each broadcast kind (:func:`~megatron_zb.runtime.vocab_program.broadcast_sources`);
    ``warm=False`` leaves out the warm-up (every communicator is then created at its first op)."""
    return _Converter(sources or {}, tuple(sorted(programs))).calls(programs, warm=warm)


class _Converter:
    """:func:`program_calls`, keeping each rank's converted issues between calls: the certificate's
    rounds change the slots of a few channels only."""

    def __init__(self, sources: Mapping[str, int], ranks: tuple[int, ...]) -> None:
        self.sources, self.ranks = sources, ranks
        self._done: dict[tuple[int, int], tuple[Issue, list[Call]]] = {}   # (rank, index) -> (issue, calls)
        self.sequence: list[tuple[Comm, tuple[int, ...]]] = []   # the warm-up's, of the last calls()

    def calls(self, programs: Mapping[int, Program], *, warm: bool) -> dict[int, list[Entry]]:
        out: dict[int, list[Entry]] = {}
        used: dict[Comm, tuple[int, ...]] = {}
        for rank, program in programs.items():
            calls: list[Entry] = []
            unwaited: dict[Hashable, None] = {}   # ops the end waits for (sends, collectives), in issue order
            for i, s in enumerate(program.issues):
                done = self._done.get((rank, i))
                if done is None or done[0] is not s:
                    done = (s, _calls(s, rank, self.ranks, self.sources))
                    self._done[(rank, i)] = done
                for call in done[1]:
                    calls.append(call)
                    if call.kind is Kind.SEND or call.kind is Kind.COLL:
                        unwaited[call.key] = None
                        used[call.comm] = call.members
                    elif call.kind is Kind.WAIT:
                        unwaited.pop(call.key, None)
            calls += [Call(Kind.WAIT, key=k) for k in unwaited]
            out[rank] = calls
        # every communicator a send or collective names (a receive's is its sender's)
        self.sequence = [(c, used[c]) for c in sorted(used, key=_creation_order)]
        if warm:
            out = {rank: _warmup_calls(self.sequence, rank) + calls for rank, calls in out.items()}
        return out


def certified_programs(orders: Callable[[], dict[int, list[Issue]]], *, sources: Mapping[str, int] | None = None,
                       name: str = "", max_slots: int = MAX_SLOTS
                       ) -> tuple[dict[int, Program], list[tuple[Comm, tuple[int, ...]]]]:
    """Every rank's program on the slots with which all of them replay to their end under every
    rule of the NCCL model (module docstring), and their :func:`warmup_sequence`; ``orders`` builds
    the ranks' issue orders. Raises
    :class:`~megatron_zb.schedules.ScheduleError` naming where the ranks stop when no rotation
    over up to ``max_slots`` communicators per channel does."""
    base = build_programs(orders())
    convert = _Converter(sources or {}, tuple(sorted(base)))
    channels = {r: [slotted_channel(s, r) for s in p.issues] for r, p in base.items()}
    slots: dict[Channel, int] = {}
    while True:
        programs = reslot(base, slots, channels)
        result = replay(convert.calls(programs, warm=True), ALL_RULES)
        if result.completed and not result.mismatches:
            return programs, convert.sequence
        more = {_channel(c) for c in result.held_back}
        if result.mismatches or not more or any(slots.get(ch, 1) >= max_slots for ch in more):
            raise ScheduleError(_refusal(name, result, max_slots))
        for ch in more:
            slots[ch] = slots.get(ch, 1) + 1


def _refusal(name: str, result: ReplayResult, max_slots: int) -> str:
    what = (f"transfers matched out of order: {result.mismatches[:2]}" if result.mismatches else
            f"with up to {max_slots} communicators per channel the ranks stop here: {result.describe()}")
    return (f"schedule {name or '(given)'}: no issue order of the runtime replays to its end under NCCL's rules "
            f"(lazy communicator creation, one hardware queue, unbuffered sends); {what}")


# ---------------------------------------------------------------------- the calls of one issue
def _channel(comm: Comm) -> Channel:
    return comm[:2] if comm[0] == "bcast" else comm[:-1]


def _members(comm: Comm, ranks: Sequence[int]) -> tuple[int, ...]:
    return tuple(ranks) if comm[0] == "coll" else tuple(comm[-3:-1])


def _comms(s: Issue, rank: int, ranks: Sequence[int], sources: Mapping[str, int]) -> list[tuple[Comm, int | None]]:
    """The communicators (and peers) of the op(s) of ``rank``'s issue ``s``: one, or for a
    broadcast kind's source one per receiver."""
    channel = channel_of(s, rank)
    if channel[0] == "p2p":
        return [(channel + (s.slot,), s.action.peer)]
    if channel[0] == "coll":
        return [(channel + (s.slot,), None)]
    src = sources[s.coll]
    if rank != src:
        return [(channel + (src, rank, s.slot), src)]
    return [(channel + (src, r, s.slot), r) for r in ranks if r != src]


def _calls(s: Issue, rank: int, ranks: Sequence[int], sources: Mapping[str, int]) -> list[Call]:
    """The model's calls of one issue of ``rank``'s program."""
    a = s.action
    if s.step is Step.RUN:   # compute never blocks: left out (the ops' gates count the waits only)
        return []
    if s.coll:
        if s.step is Step.WAIT:   # a receiver waits for its one op (a source's waits are the end's)
            return [Call(Kind.WAIT, key=(s.coll, a.mb, rank if s.coll in sources else None))]
        out = []
        for comm, peer in _comms(s, rank, ranks, sources):
            key = (s.coll, a.mb, None if peer is None else comm[-2])   # (kind, mb, receiver)
            kind = Kind.COLL if peer is None else Kind.SEND if rank == sources[s.coll] else Kind.RECV
            out.append(Call(kind, comm=comm, members=_members(comm, ranks), peer=peer, key=key))
        return out
    key = ("p2p", transfer_key(a))
    if s.step in (Step.WAIT, Step.RELEASE):
        return [Call(Kind.WAIT, key=key)]
    ((comm, peer),) = _comms(s, rank, ranks, sources)
    kind = Kind.SEND if s.step is Step.SEND else Kind.RECV
    return [Call(kind, comm=comm, members=_members(comm, ranks), peer=peer, key=key)]


def _warmup_calls(sequence: list[tuple[Comm, tuple[int, ...]]], rank: int) -> list[Entry]:
    """``rank``'s part of the warm-up: one tiny op per communicator it belongs to, in the global
    order, then a wait for each and one synchronisation (:func:`~megatron_zb.runtime.channels.warm_up`)."""
    calls: list[Entry] = []
    for comm, members in sequence:
        if rank not in members:
            continue
        key = ("warm", comm)
        if comm[0] == "coll":
            calls.append(Call(Kind.COLL, comm=comm, members=members, key=key))
        else:
            src, dst = members
            kind, peer = (Kind.SEND, dst) if rank == src else (Kind.RECV, src)
            calls.append(Call(kind, comm=comm, members=members, peer=peer, key=key))
    calls += [Call(Kind.WAIT, key=c.key) for c in list(calls)]
    return calls + ([Call(Kind.SYNC)] if calls else [])

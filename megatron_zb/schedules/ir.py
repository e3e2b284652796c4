"""The schedule IR: one representation for every pipeline schedule.

A schedule is data, not code. It says, for every pipeline rank, the ordered list of compute
actions that rank performs in one training iteration:

* ``F``  -- forward of one microbatch through one pipeline stage,
* ``B``  -- backward w.r.t. the stage *input* (on the critical path),
* ``W``  -- backward w.r.t. the stage *weights* (free to move later),
* ``BW`` -- fused backward (``B`` and ``W`` together, as plain 1F1B does),

and, with vocabulary parallelism (the embedding and the output layer split over every pipeline
rank; docs/vocab_parallel_schedules.md), one pass of each vocabulary layer per (microbatch, rank):

* ``IF`` -- input embedding forward of the rank's vocabulary slice (masked lookup); an all-reduce
  over the pipeline group sums the slices before ``F`` of the first stage,
* ``S``  -- output layer forward of the rank's slice (local logits, max, sum-exp), after the
  last stage's output is broadcast; an all-reduce (barrier ``C1``) combines the statistics,
* ``T``  -- output layer backward of the rank's slice (softmax gradient, partial input gradient,
  its weight gradient), after ``C1``,
* ``IB`` -- input embedding backward (weight gradient of the slice), after the first stage's
  input gradient is broadcast.

A vocabulary pass's ``stage`` field is the rank that runs it (its vocabulary slice).
``Schedule.vocab_barriers`` says which of the paper's algorithms the passes implement: ``2``
(Vocab-1, Algorithm 1: the last stage's backward waits for a second all-reduce ``C2`` of the
input gradient after every ``T``) or ``1`` (Vocab-2, Algorithm 2: ``S`` also computes the input
gradient, so the last stage's backward waits only for ``C1``); ``0`` (default): no vocabulary
parallelism and no vocabulary pass.

``stage_to_rank`` maps each pipeline stage to the rank that runs it, so the plain layout
(stage ``s`` on rank ``s``), the interleaved layout (stage ``s`` on rank ``s % p``) and the
V layout (rank ``r`` holds stages ``r`` and ``2p-1-r``) are the same IR with different maps.

Communication is never written by hand: :func:`lower` derives the send/recv actions from
the compute order (see :mod:`megatron_zb.schedules.lowering`). The same :class:`Schedule`
feeds the validator, the simulator, the plots, the JSON form and the runtime.

JSON form (see :meth:`Schedule.to_json` / :meth:`Schedule.from_json`)::

    {"num_microbatches": m,
     "stage_to_rank": [r0, r1, ...],
     "ranks": [[{"op": "F", "mb": 0, "stage": 0}, ...], ...],
     "vocab_barriers": 2}            # only with vocabulary parallelism (1 or 2)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

class _StrEnum(str, Enum):
    """A ``str`` enum that prints, formats, compares and hashes as its value (``Op.F == "F"``)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Op(_StrEnum):
    """What an action does. ``F``/``B``/``W``/``BW`` are compute; the rest come from lowering.

    ``SEND_F``/``RECV_F`` carry the activation of microbatch ``mb`` from stage ``stage`` to
    ``stage + 1``; ``SEND_B``/``RECV_B`` carry the input gradient of stage ``stage`` to
    ``stage - 1``. ``stage`` is always the *producing* stage, so a matching send/recv pair has
    identical ``(direction, mb, stage)``.
    """

    F = "F"
    B = "B"
    W = "W"
    BW = "BW"
    IF = "IF"
    S = "S"
    T = "T"
    IB = "IB"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE

    @property
    def is_vocab(self) -> bool:
        """A vocabulary-parallel pass (``IF``, ``S``, ``T``, ``IB``); its ``stage`` is its rank."""
        return self in _VOCAB

    @property
    def is_send(self) -> bool:
        return self is Op.SEND_F or self is Op.SEND_B

    @property
    def is_recv(self) -> bool:
        return self is Op.RECV_F or self is Op.RECV_B

    @property
    def direction(self) -> "Op":
        """For a transfer: ``Op.F`` (activation) or ``Op.B`` (input gradient)."""
        if self.is_compute:
            raise ScheduleError(f"{self} is not a transfer")
        return Op.F if self in (Op.SEND_F, Op.RECV_F) else Op.B

    @property
    def matching(self) -> "Op":
        """For a transfer: the other end (``SEND_F`` <-> ``RECV_F``, ``SEND_B`` <-> ``RECV_B``)."""
        return _MATCHING[self]


_VOCAB = frozenset({Op.IF, Op.S, Op.T, Op.IB})
_COMPUTE = frozenset({Op.F, Op.B, Op.W, Op.BW}) | _VOCAB
_MATCHING = {Op.SEND_F: Op.RECV_F, Op.RECV_F: Op.SEND_F, Op.SEND_B: Op.RECV_B, Op.RECV_B: Op.SEND_B}

COMPUTE_OPS: tuple[Op, ...] = (Op.F, Op.B, Op.W, Op.BW)
"""Compute action kinds, in the order they happen to one (microbatch, stage)."""

VOCAB_OPS: tuple[Op, ...] = (Op.IF, Op.S, Op.T, Op.IB)
"""Vocabulary-parallel passes, in the order they happen to one microbatch (see the module docstring)."""

def vocab_passes_unsupported(schedule: "Schedule | None" = None, *, name: str | None = None,
                             vocab_parallel: bool = False) -> str | None:
    """Why a consumer that executes schedules cannot take this one -- it holds vocabulary-parallel
    passes -- or ``None``: the PyTorch export never yet, megatron-zb's runtime and ``pretrain_gpt_zb.py
    --schedule`` unless given the model's vocabulary slices (the runtime's ``vocab_parallel`` option,
    ``--enable-vocab-parallel``). Give a
    built ``schedule``, or a registry ``name`` with its spec's ``vocab_parallel``. The one copy of the
    refusal's text."""
    holds = vocab_parallel if schedule is None else (
        schedule.vocab_barriers > 0 or any(a.op in VOCAB_OPS for _, _, a in schedule.actions()))
    if not holds:
        return None
    what = repr(name if name is not None else schedule.name)  # type: ignore[union-attr]
    return (f"schedule {what} holds vocabulary-parallel passes (IF/S/T/IB), which megatron-zb's runtime runs "
            f"only given the model's vocabulary slices (pretrain_gpt_zb.py: add --enable-vocab-parallel; Python: "
            f"vocab_parallel=VocabParallelModel(...); docs/vocab_parallel.md) and the PyTorch export does not take; "
            f"choose a schedule without them")


VOCAB_BARRIERS: tuple[int, ...] = (1, 2)
"""Allowed non-zero :attr:`Schedule.vocab_barriers`: all-reduce barriers between ``S`` and the last
stage's backward (``2``: the paper's Vocab-1 / Algorithm 1; ``1``: Vocab-2 / Algorithm 2)."""

COMM_OPS: tuple[Op, ...] = (Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B)
"""Communication action kinds produced by lowering (never by a generator); see :class:`Op`."""


class Placement(_StrEnum):
    """How stages map to ranks (the JSON form keeps only ``stage_to_rank``; this names its shape).

    ``PLAIN``: stage ``s`` on rank ``s``; ``INTERLEAVED``: stage ``s`` on rank ``s % p`` (``v``
    chunks per rank, Megatron's virtual pipeline); ``V``: rank ``r`` holds stages ``r`` and
    ``2p-1-r``.
    """

    PLAIN = "plain"
    INTERLEAVED = "interleaved"
    V = "v"

    def chunks_per_rank(self, num_chunks: int) -> int:
        """Model chunks per rank; ``num_chunks`` matters only for ``INTERLEAVED``."""
        return {Placement.PLAIN: 1, Placement.INTERLEAVED: num_chunks, Placement.V: V_CHUNKS_PER_RANK}[self]

    def stage_to_rank(self, num_ranks: int, num_chunks: int = 2) -> list[int]:
        """The placement's ``stage_to_rank`` for ``num_ranks`` ranks."""
        if self is Placement.PLAIN:
            return plain_placement(num_ranks)
        if self is Placement.INTERLEAVED:
            return interleaved_placement(num_ranks, num_chunks)
        return v_placement(num_ranks)


class ScheduleError(ValueError):
    """A schedule (or a request for one) is malformed; the message names the first bad item."""


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one rank: ``op`` applied to microbatch ``mb`` on pipeline stage ``stage``.

    ``peer`` is set only on communication actions (the other rank of the transfer).
    """

    op: Op
    mb: int
    stage: int
    peer: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.op, Op):  # a plain string from JSON or a caller: normalise
            try:
                object.__setattr__(self, "op", Op(self.op))
            except ValueError:
                raise ScheduleError(f"unknown action op {self.op!r}; expected one of "
                                    f"{tuple(o.value for o in Op)}") from None
        if not self.op.is_compute and self.peer is None:
            raise ScheduleError(f"communication action {self.op} needs a peer rank")

    @property
    def is_compute(self) -> bool:
        return self.op.is_compute

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"op": self.op.value, "mb": self.mb, "stage": self.stage}
        if self.peer is not None:
            d["peer"] = self.peer
        return d

    def __str__(self) -> str:
        s = f"{self.op}(mb={self.mb}, stage={self.stage})"
        return s if self.peer is None else s[:-1] + f", peer={self.peer})"


def F(mb: int, stage: int) -> Action:
    """Forward of microbatch ``mb`` on ``stage``."""
    return Action(Op.F, mb, stage)


def B(mb: int, stage: int) -> Action:
    """Input-gradient backward of microbatch ``mb`` on ``stage``."""
    return Action(Op.B, mb, stage)


def W(mb: int, stage: int) -> Action:
    """Weight-gradient backward of microbatch ``mb`` on ``stage``."""
    return Action(Op.W, mb, stage)


def BW(mb: int, stage: int) -> Action:
    """Fused backward (input and weight gradients) of microbatch ``mb`` on ``stage``."""
    return Action(Op.BW, mb, stage)


def vocab_pass(op: Op, mb: int, rank: int) -> Action:
    """Vocabulary pass ``op`` (``IF``, ``S``, ``T`` or ``IB``) of microbatch ``mb`` on ``rank``'s slice."""
    if not op.is_vocab:
        raise ScheduleError(f"{op} is not a vocabulary pass; expected one of {tuple(o.value for o in VOCAB_OPS)}")
    return Action(op, mb, rank)


@dataclass(slots=True)
class Schedule:
    """A pipeline schedule for one iteration.

    Attributes:
        num_microbatches: microbatches per iteration (``m``).
        stage_to_rank: rank that runs each pipeline stage; ``len(stage_to_rank)`` is the number
            of stages. Stage 0 holds the embedding, the last stage the loss.
        ranks: per-rank ordered action lists (compute actions; lowered schedules also carry
            communication actions).
        name: free-form label (e.g. ``"zb-h1"``); not part of the JSON contract.
        vocab_barriers: ``0`` (no vocabulary parallelism), or the all-reduce barriers between the
            vocabulary passes ``S`` and the last stage's backward: ``2`` (Vocab-1) or ``1``
            (Vocab-2); see the module docstring. In the JSON form only when non-zero.
    """

    num_microbatches: int
    stage_to_rank: list[int]
    ranks: list[list[Action]]
    name: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    vocab_barriers: int = 0

    # ------------------------------------------------------------------ shape
    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    def stages_of(self, rank: int) -> list[int]:
        """Stages owned by ``rank``, ascending."""
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    def actions(self) -> Iterator[tuple[int, int, Action]]:
        """Yield ``(rank, position, action)`` for every action."""
        for r, acts in enumerate(self.ranks):
            for i, a in enumerate(acts):
                yield r, i, a

    def compute_only(self) -> "Schedule":
        """The schedule with communication actions removed (undoes :func:`lower`)."""
        return Schedule(self.num_microbatches, list(self.stage_to_rank),
                        [[a for a in acts if a.is_compute] for acts in self.ranks], self.name, dict(self.meta),
                        self.vocab_barriers)

    @property
    def splits_backward(self) -> bool:
        """True when any backward is split into B and W."""
        return any(a.op is Op.W for _, _, a in self.actions())

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "num_microbatches": self.num_microbatches,
            "stage_to_rank": list(self.stage_to_rank),
            "ranks": [[a.to_dict() for a in acts] for acts in self.ranks],
        }
        if self.vocab_barriers:
            d["vocab_barriers"] = self.vocab_barriers
        return d

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict[str, Any], name: str = "") -> "Schedule":
        for key in ("num_microbatches", "stage_to_rank", "ranks"):
            if key not in d:
                raise ScheduleError(f"schedule JSON lacks the key {key!r}")
        ranks: list[list[Action]] = []
        for r, acts in enumerate(d["ranks"]):
            row = []
            for i, a in enumerate(acts):
                try:
                    row.append(Action(a["op"], int(a["mb"]), int(a["stage"]), a.get("peer")))
                except (KeyError, TypeError) as e:
                    raise ScheduleError(f"rank {r} action #{i} {a!r} is not an action: {e}") from None
            ranks.append(row)
        return cls(int(d["num_microbatches"]), [int(x) for x in d["stage_to_rank"]], ranks, name=name,
                   vocab_barriers=int(d.get("vocab_barriers", 0)))

    @classmethod
    def from_json(cls, text: str, name: str = "") -> "Schedule":
        return cls.from_dict(json.loads(text), name=name)


def dump(schedule: Schedule, path: str | Path) -> None:
    """Write ``schedule`` to ``path`` in the documented JSON form."""
    Path(path).write_text(schedule.to_json(indent=None) + "\n")


def load(path: str | Path) -> Schedule:
    """Read a schedule written by :func:`dump` (or by any tool following the JSON form)."""
    p = Path(path)
    return Schedule.from_json(p.read_text(), name=p.stem)


# ---------------------------------------------------------------------- placements
def plain_placement(num_ranks: int) -> list[int]:
    """Stage ``s`` on rank ``s``: one chunk per rank."""
    return list(range(num_ranks))


def interleaved_placement(num_ranks: int, num_chunks: int) -> list[int]:
    """Megatron's virtual pipeline: stage ``s`` on rank ``s % p``, ``v`` chunks per rank."""
    return [s % num_ranks for s in range(num_ranks * num_chunks)]


V_CHUNKS_PER_RANK = 2
"""Model chunks (stages) per rank of the V placement: :func:`v_stages`."""


def v_stages(num_ranks: int, rank: int) -> tuple[int, int]:
    """The V rule: rank ``r`` of ``p`` holds stage ``r`` (its chunk 0, down the V) and stage ``2p-1-r``
    (its chunk 1, back up), so rank 0 holds the first and the last stage."""
    return rank, V_CHUNKS_PER_RANK * num_ranks - 1 - rank


def v_placement(num_ranks: int) -> list[int]:
    """V layout (:func:`v_stages`): rank ``r`` holds stage ``r`` and stage ``2p-1-r``."""
    s2r = [0] * (V_CHUNKS_PER_RANK * num_ranks)
    for r in range(num_ranks):
        for s in v_stages(num_ranks, r):
            s2r[s] = r
    return s2r


# ---------------------------------------------------------------------- validation
def validate(schedule: Schedule) -> None:
    """Check that ``schedule`` is a complete, well-ordered iteration; raise :class:`ScheduleError`.

    Rules: ``m >= 1``; every stage maps to an existing rank; every (microbatch, stage) has exactly
    one ``F`` and either one ``BW`` or one ``B`` and one ``W``, each on the rank owning the stage;
    on that rank ``F`` precedes ``B``/``BW`` and ``B`` precedes ``W``. Communication actions, if
    present, are checked by :func:`megatron_zb.schedules.lowering.check_lowered`.
    The error names the first offending action as ``rank R action #i: OP(mb, stage)``.
    """
    m, s2r, p = schedule.num_microbatches, schedule.stage_to_rank, schedule.num_ranks
    if m < 1:
        raise ScheduleError(f"num_microbatches must be >= 1, got {m}")
    if p < 1:
        raise ScheduleError("a schedule needs at least one rank")
    if not s2r:
        raise ScheduleError("stage_to_rank is empty")
    for s, r in enumerate(s2r):
        if not 0 <= r < p:
            raise ScheduleError(f"stage {s} is placed on rank {r}, but the schedule has ranks 0..{p - 1}")
    seen: dict[tuple[Op, int, int], tuple[int, int]] = {}
    validate_vocab(schedule)
    for r, i, a in schedule.actions():
        if not a.is_compute or a.op.is_vocab:
            continue
        op, mb, stage = a.op, a.mb, a.stage
        if not 0 <= stage < len(s2r):
            raise ScheduleError(f"{_where(r, i, a)} names stage {stage}, but there are {len(s2r)} stages")
        if not 0 <= mb < m:
            raise ScheduleError(f"{_where(r, i, a)} names microbatch {mb}, but there are {m} microbatches")
        if s2r[stage] != r:
            raise ScheduleError(f"{_where(r, i, a)} runs on rank {r}, but stage {stage} belongs to rank {s2r[stage]}")
        key = (op, mb, stage)
        if key in seen:
            r0, i0 = seen[key]
            raise ScheduleError(f"{_where(r, i, a)} duplicates rank {r0} action #{i0}")
        if op is not Op.F and (Op.F, mb, stage) not in seen:
            raise ScheduleError(f"{_where(r, i, a)} comes before its forward F(mb={mb}, stage={stage})")
        if op is Op.W and (Op.B, mb, stage) not in seen:
            raise ScheduleError(f"{_where(r, i, a)} comes before its input-gradient backward B(mb={mb}, stage={stage})")
        if op is Op.BW and (Op.B, mb, stage) in seen or op is Op.B and (Op.BW, mb, stage) in seen:
            raise ScheduleError(f"{_where(r, i, a)}: a (microbatch, stage) takes either BW or B+W, not both")
        seen[key] = (r, i)
    for s in range(len(s2r)):
        for mb in range(m):
            if (Op.F, mb, s) not in seen:
                raise ScheduleError(f"rank {s2r[s]} lacks F(mb={mb}, stage={s})")
            has_bw = (Op.BW, mb, s) in seen
            has_b, has_w = (Op.B, mb, s) in seen, (Op.W, mb, s) in seen
            if not has_bw and not (has_b and has_w):
                missing = "W" if has_b else ("B" if has_w else "BW (or B and W)")
                raise ScheduleError(f"rank {s2r[s]} lacks {missing}(mb={mb}, stage={s})")


def validate_vocab(schedule: Schedule) -> None:
    """The rules of vocabulary passes; raise :class:`ScheduleError` naming the first offence.

    With ``vocab_barriers == 0`` there is none. With ``1`` or ``2``: every rank runs exactly one
    ``IF``, ``S``, ``T`` and ``IB`` of every microbatch, with ``stage`` equal to its rank; on each
    rank ``IF`` precedes ``IB`` and ``S`` precedes ``T``, and each kind runs in ascending
    microbatch order (its collectives over the pipeline group are matched by order, so every rank
    must issue them in the same order).
    """
    vb, m = schedule.vocab_barriers, schedule.num_microbatches
    if vb == 0:
        for r, i, a in schedule.actions():
            if a.op.is_vocab:
                raise ScheduleError(f"{_where(r, i, a)} is a vocabulary pass, but the schedule's vocab_barriers is 0; "
                                    f"set it to one of {VOCAB_BARRIERS}")
        return
    if vb not in VOCAB_BARRIERS:
        raise ScheduleError(f"vocab_barriers is {vb!r}; it must be 0 or one of {VOCAB_BARRIERS}")
    for r, acts in enumerate(schedule.ranks):
        nxt = {op: 0 for op in VOCAB_OPS}   # next microbatch expected of each kind
        for i, a in enumerate(acts):
            if not a.op.is_vocab:
                continue
            if a.stage != r:
                raise ScheduleError(f"{_where(r, i, a)}: a vocabulary pass names its rank as stage; expected {r}")
            if a.mb != nxt[a.op]:
                raise ScheduleError(f"{_where(r, i, a)}: expected {a.op}(mb={nxt[a.op]}) next (each vocabulary "
                                    f"pass runs once per microbatch, in ascending microbatch order)")
            before = {Op.IB: Op.IF, Op.T: Op.S}.get(a.op)
            if before is not None and nxt[before] <= a.mb:
                raise ScheduleError(f"{_where(r, i, a)} comes before {before}(mb={a.mb}) on its rank")
            nxt[a.op] += 1
        for op, k in nxt.items():
            if k != m:
                raise ScheduleError(f"rank {r} lacks {op}(mb={k}, stage={r})" if k < m else
                                    f"rank {r} runs {k} {op} passes for {m} microbatches")


def _where(rank: int, position: int, a: Action) -> str:
    """How errors name an action: ``rank R action #i: OP(mb, stage)``."""
    return f"rank {rank} action #{position}: {a}"


def backward_kinds(schedule: Schedule) -> set[Op]:
    """The backward kinds a schedule uses (``{Op.BW}``, ``{Op.B, Op.W}`` or both)."""
    return {a.op for _, _, a in schedule.actions() if a.op in (Op.B, Op.W, Op.BW)}


def make_schedule(
    *, num_microbatches: int, stage_to_rank: Sequence[int], ranks: Iterable[Iterable[Action]], name: str = "",
    vocab_barriers: int = 0, **meta: Any,
) -> Schedule:
    """Build and validate a schedule (the common tail of every generator)."""
    sched = Schedule(num_microbatches, list(stage_to_rank), [list(r) for r in ranks], name, dict(meta),
                     vocab_barriers)
    validate(sched)
    return sched

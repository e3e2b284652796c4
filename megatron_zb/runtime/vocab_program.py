"""Where the vocabulary-parallel passes issue their collectives in a rank's program, and where they wait.

With vocabulary parallelism (docs/vocab_parallel.md) every rank holds a slice of the embedding and
the output layer, and the passes meet in collectives over the model-parallel group. Those
collectives are steps of the rank's issue order (:mod:`~megatron_zb.runtime.comm_program`), at
fixed points around the compute actions, issued by the main thread -- so the program that the
NCCL model certifies (:mod:`~megatron_zb.runtime.comm_certify`) is the one the runtime runs
(:class:`~megatron_zb.runtime.vocab_runtime.VocabPasses` executes each step). One kind of
collective per communicator (:data:`VOCAB_KINDS`); within a kind every rank issues them in
microbatch order.

The all-reduces (:data:`ALL_REDUCE_KINDS`) are NCCL collectives over every rank. What one stage
hands to every other rank (:data:`BROADCAST_KINDS`: ``X``, the loss gradient, the embedding's
gradient) travels as point-to-point sends from the stage's rank to each other rank, not as
NCCL broadcasts: a broadcast completes on no rank before every receiver joined it, which ties the
receivers to each other where the schedule (and its timing kernel) has each wait for the source
only -- replayed under the NCCL model, ``zb-h1-vocab-1`` at p = 4 and ``zb-vocab-2`` at p = 8 hang
with broadcasts and complete with sends (``tests/runtime/test_nccl_semantics.py``).

Around each compute action of microbatch ``i`` (``first``: the rank of stage 0, ``last``: the rank
of the last stage):

* ``IF(i)``: then ``COLL if`` (the all-reduce of the embedding's partial sums).
* ``F(i)`` of stage 0: ``WAIT if`` before it (its input is the sum).
* ``F(i)`` of the last stage: then ``COLL x`` (the broadcast of its output ``X``).
* ``S(i)``: before it, on every rank but ``last``, ``COLL x`` and ``WAIT x``; after it the forward
  barrier: ``COLL c0`` and ``WAIT c0`` (C0's all-reduces, issued and waited one after another:
  each needs the one before), then, when training, ``COLL grad`` (``last`` computes the loss and
  the gradient of the loss with respect to the per-token losses, and sends it to every rank).
* ``T(i)``: ``WAIT grad`` before it (not on ``last``, which holds its own); with two barriers
  (``vocab_barriers == 2``) ``COLL c1`` after it (the all-reduce of the input gradient's parts).
* ``B(i)`` / ``BW(i)`` of the last stage: with two barriers ``WAIT c1`` before it.
* ``B(i)`` / ``BW(i)`` of stage 0: then ``COLL ib`` (the broadcast of the embedding's gradient).
* ``IB(i)``: before it, on every rank but ``first``, ``COLL ib`` and ``WAIT ib``.

What is not waited for in the program (a broadcast's source, the sums other ranks do not need) is
waited for at the end of the iteration.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schedules import Action, Op, Schedule

__all__ = ["VOCAB_KINDS", "VocabRoles"]

VOCAB_KINDS = ("if", "x", "c0", "grad", "c1", "ib")
"""The vocabulary collectives, in their communicators' creation order: IF's all-reduce, ``X`` to every
rank, the forward barrier C0's all-reduces, the loss gradient to every rank, the backward barrier C1,
the embedding's gradient to every rank."""

ALL_REDUCE_KINDS = frozenset({"if", "c0", "c1"})
"""Kinds that are NCCL all-reduces over every rank (one communicator per kind and slot)."""

BROADCAST_KINDS = frozenset({"x", "grad", "ib"})
"""Kinds sent point to point by one stage's rank to every other rank (module docstring)."""


def broadcast_sources(schedule: Schedule) -> dict[str, int]:
    """Kind -> the pipeline rank that sends it: ``X`` and the loss gradient from the last stage's,
    the embedding's gradient from the first stage's."""
    last, first = schedule.stage_to_rank[-1], schedule.stage_to_rank[0]
    return {"x": last, "grad": last, "ib": first}


@dataclass(frozen=True)
class VocabRoles:
    """What one pipeline rank does in the vocabulary collectives (module docstring).

    Attributes:
        first: the rank holds stage 0 (IF's sum feeds its ``F``; it sends the embedding's gradient).
        last: the rank holds the last stage (it sends ``X`` and the loss gradient).
        last_stage: the last stage's index.
        exact: two barriers (``vocab_barriers == 2``: C1 after ``T``).
        forward_only: evaluation (no ``grad``, ``T``, ``C1``, ``IB``).
    """

    first: bool
    last: bool
    last_stage: int
    exact: bool
    forward_only: bool

    @classmethod
    def of(cls, schedule: Schedule, rank: int, *, forward_only: bool) -> "VocabRoles | None":
        """``rank``'s roles in ``schedule`` (``None`` without vocabulary passes)."""
        if not schedule.vocab_barriers:
            return None
        return cls(first=schedule.stage_to_rank[0] == rank, last=schedule.stage_to_rank[-1] == rank,
                   last_stage=schedule.num_stages - 1, exact=schedule.vocab_barriers == 2,
                   forward_only=forward_only)

    def around(self, a: Action) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """The collective steps before and after the compute action ``a``, as ``(step, kind)`` with
        ``step`` ``"coll"`` or ``"wait"`` (module docstring)."""
        op, before, after = a.op, [], []
        backward = op in (Op.B, Op.BW)
        if op is Op.IF:
            after.append(("coll", "if"))
        elif op is Op.F and a.stage == 0:
            before.append(("wait", "if"))
        if op is Op.F and a.stage == self.last_stage:
            after.append(("coll", "x"))
        elif op is Op.S:
            if not self.last:
                before += [("coll", "x"), ("wait", "x")]
            after += [("coll", "c0"), ("wait", "c0")] + ([] if self.forward_only else [("coll", "grad")])
        elif op is Op.T:
            if not self.last:
                before.append(("wait", "grad"))
            if self.exact:
                after.append(("coll", "c1"))
        elif op is Op.IB and not self.first:
            before += [("coll", "ib"), ("wait", "ib")]
        if backward and a.stage == self.last_stage and self.exact:
            before.append(("wait", "c1"))
        if backward and a.stage == 0:
            after.append(("coll", "ib"))
        return before, after

"""Interleaved 1F1B and interleaved ZB with vocabulary parallelism (Yeung et al., MLSys 2025):
``interleaved-1f1b-vocab-1/2`` and ``interleaved-zb-vocab-1/2``, Megatron's virtual-pipeline placement
(``v`` chunks per rank, stage ``s = c*p + r`` on rank ``s % p``) with the passes ``IF``/``S``/``T``/``IB``
of every rank placed in it (docs/vocab_parallel_schedules.md).

**Where the barriers bite.** The first stage is chunk 0 of rank 0 and the last stage chunk ``v-1``
of rank ``p-1`` (:func:`~..ir.interleaved_placement`): the embedding's all-reduce feeds rank 0's
chunk 0, the last stage's output ``X`` is broadcast from rank ``p-1``, and the last stage's backward
of microbatch ``i`` -- on rank ``p-1`` -- waits for ``S(i)`` on every rank and ``C1`` (Vocab-2), or
also for ``T(i)`` everywhere and ``C2`` (Vocab-1). Megatron's interleaved warm-up gives rank ``p-1``
only ``(v-1)p`` forwards before its first backward, the last stage's ``B(0)``, so each barrier stalls
it and, through the chain of backwards, every rank (simulated, p=4, m=16, v=2, docs/vocab_parallel_schedules.md's
costs: Megatron's warm-up with the passes placed is 14% (Vocab-2) to 28% (Vocab-1) longer than the
generator's choice; tested: more than 10%).

**The warm-up.** The cure is the plain and the V generators' (:mod:`.vocab`, :mod:`.vocab_v`): more
forwards in flight. Every rank's warm-up gets ``extra`` more chunk forwards
(:func:`~.baselines.interleaved_1f1b_order`; each holds one chunk's ``M_B`` more until the end of the
warm-up), so between the last stage's ``F(i)`` and its ``B(i)`` rank ``p-1`` runs ``extra`` more
forwards' work. The rule is every vocabulary family's (:func:`~.vocab.least_extra`): ``extra = e0 ..
e0 + barriers`` are tried (``e0``: the extra forwards Megatron's order itself needs when ``m % p != 0``,
:func:`~.baselines.interleaved_warmup_extra`), the passes placed by :func:`~.vocab.place_vocab_passes`
under the given costs, and the smallest ``extra`` within :data:`~.vocab.EXTRA_GAIN` of the fastest
is kept (``meta['extra_warmup']``, counted from ``e0``).

==============================  =========================================================================
schedule                        base orders tried for each ``extra``
==============================  =========================================================================
``interleaved-1f1b-vocab-1/2``  Megatron's interleaved 1F1B (fused ``BW``)
``interleaved-zb-vocab-1/2``    the same with every ``BW`` split into ``B`` and its ``W``, rank ``r``
                                deferring up to ``d_r`` W's, ``d_r`` in ``0``, ``r``, ``2r``, ``vr``
                                (``interleaved-zb``'s *pattern* candidates,
                                :func:`~.interleaved_zb.split_with_delay`); the fastest (least peak on a
                                tie) that fits ``memory_limit``
==============================  =========================================================================

(``interleaved-zb``'s list-scheduler candidate is not tried yet: it reorders forwards and backwards by
its own timing, which knows no vocabulary barrier.)

**Peak activation memory per rank**: interleaved 1F1B's peak plus ``extra`` chunk ``M_B`` (1F1B), plus at
most ``M_W`` per W a rank defers (ZB; tested at p=4, m=16, v=2), plus ``mem_s`` for each ``S`` whose ``T``
has not run. With ``memory_limit`` (the unit of ``costs.mem_b``; ``None``: ``costs.memory_limit``, else
none) only the candidates whose simulated peak fits are kept.
"""

from __future__ import annotations

import math

from ..catalog import register
from ..costs import CostModel
from ..ir import Action, Placement, Schedule, interleaved_placement, make_schedule
from ..limits import resolve_limit
from .baselines import check_shape, interleaved_1f1b_order, interleaved_warmup_extra
from .common import check_cost_model
from .interleaved_zb import split_with_delay
from .vocab import VARIANT_BARRIERS, check_variant, least_extra

__all__ = ["vocab_interleaved"]


def vocab_interleaved(*, num_ranks: int, num_microbatches: int, num_chunks: int = 2, variant: int = 1,
                      split_backward: bool = False, costs: CostModel | None = None,
                      memory_limit: float | None = None) -> Schedule:
    """Interleaved 1F1B (``split_backward=False``) or interleaved ZB (``True``) with vocabulary
    parallelism (module docstring).

    Args:
        num_ranks: ``p`` (>= 1); the model has ``p * v`` stages.
        num_microbatches: ``m`` (>= 1).
        num_chunks: ``v`` (>= 1), chunks per rank.
        variant: the paper's ``1`` (Vocab-1: two all-reduce barriers) or ``2`` (Vocab-2: one).
        costs: per-stage (per-chunk, ``p * v`` stages) costs and ``costs.vocab``; default ``CostModel()``.
        memory_limit: per-rank peak activation limit, in the unit of ``costs.mem_b``
            (:func:`~..limits.resolve_limit`: ``None``: ``costs.memory_limit``, else no limit).

    Raises:
        ScheduleError: bad sizes, costs or variant, or no candidate fits ``memory_limit``.
    """
    check_shape(num_ranks, num_microbatches, num_chunks)
    vb = check_variant(variant)
    costs = check_cost_model(costs or CostModel())
    p, m, v = num_ranks, num_microbatches, num_chunks
    s2r = interleaved_placement(p, v)
    name = f"interleaved-{'zb' if split_backward else '1f1b'}-vocab-{variant}"
    e0 = interleaved_warmup_extra(p, m, v)
    delays = [[0] * p, list(range(p)), [2 * r for r in range(p)], [v * r for r in range(p)]]

    def bases(extra: int) -> list[list[list[Action]]]:
        order = interleaved_1f1b_order(p, m, v, e0 + extra)
        if not split_backward:
            return [order]
        fused = Schedule(m, s2r, order, name)
        return [split_with_delay(fused, d) for d in delays]

    limit = resolve_limit(memory_limit, costs, math.inf)
    extra, ranks, makespan = least_extra(bases, s2r, m, costs, vb, name=name, memory_limit=limit,
                                         what="Megatron's interleaved warm-up")
    return make_schedule(num_microbatches=m, stage_to_rank=s2r, ranks=ranks, name=name, vocab_barriers=vb,
                         num_chunks=v, variant=variant, extra_warmup=extra, makespan=makespan)


# ---------------------------------------------------------------------------- registration
def _register(variant: int, split_backward: bool) -> None:
    base = "interleaved-zb" if split_backward else "interleaved-1f1b"
    what = "two all-reduce barriers (C1, C2)" if variant == 1 else "one all-reduce barrier (C1)"
    label = "interleaved ZB (B/W split)" if split_backward else "Megatron's interleaved 1F1B"

    @register(f"{base}-vocab-{variant}",
              f"{label} with vocabulary parallelism, Vocab-{variant}: {what}, v chunks per rank (--chunks), "
              f"up to {VARIANT_BARRIERS[variant]} more warm-up forward{'s' * (variant == 1)} per rank",
              placement=Placement.INTERLEAVED,
              split_backward=split_backward, cost_aware=True, vocab_parallel=True)
    def build(*, num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: float | None,
              num_chunks: int) -> Schedule:
        return vocab_interleaved(num_ranks=num_ranks, num_microbatches=num_microbatches, num_chunks=num_chunks,
                                 variant=variant, split_backward=split_backward, costs=costs,
                                 memory_limit=memory_limit)


for _sb in (False, True):
    for _v in (1, 2):
        _register(_v, _sb)

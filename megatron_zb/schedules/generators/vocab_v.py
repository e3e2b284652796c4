"""ZB-V with vocabulary parallelism (Yeung et al., MLSys 2025): ``zbv-vocab-1`` and ``zbv-vocab-2``,
the V placement's order with the passes ``IF``/``S``/``T``/``IB`` of every rank placed in it
(docs/vocab_parallel_schedules.md).

**Where the barriers bite on the V.** Rank 0 holds stage 0 and the last stage ``2p-1``
(:func:`~..ir.v_placement`): the last stage's output ``X`` is broadcast from rank 0, and the last
stage's backward of microbatch ``i`` -- on rank 0 -- waits for ``S(i)`` on every rank and the
all-reduce ``C1`` (Vocab-2), or also for ``T(i)`` everywhere and ``C2`` (Vocab-1). The hand-made
ZB-V order (:func:`~.handcrafted.zbv_handcrafted_order`, the one ``zbv`` keeps as a candidate and
PyTorch's ``ScheduleZBVZeroBubble`` builds) runs the last stage's ``B(i)`` right after its ``F(i)``
(steady state ``F0, B0, W0, F1, B1, W1`` per rank), so each barrier would stall rank 0 and, through
the V's chain of backwards, every rank (simulated, p=4, m=16, the costs of
docs/vocab_parallel_schedules.md's table: 13% (Vocab-2) and 24% (Vocab-1) longer than with ``extra``
below; tested: more than 10%).

**The warm-up.** As on the plain placement (:mod:`.vocab`: ``barriers`` more warm-up forwards), the
cure is more microbatches in flight: rank ``r``'s warm-up gets ``extra`` more ``(F1, F0)`` pairs --
``2(p-r)-1`` x ``F0``, ``(r + extra)`` x ``(F1, F0)``, ``(p-r)`` x ``(F1, B1, W1)`` -- then ZB-V's
steady state ``F0, B0, W0, F1, B1, W1`` and a cool-down of ``(B0, B1)`` pairs, then the remaining
``W``. Each chunk's forwards now run ``extra`` microbatches ahead of its backwards, so between the
last stage's ``F(i)`` and its ``B(i)`` rank 0 runs ``extra`` more microbatches' work: one steady-state
period (every rank's ``F0, B0, W0, F1, B1, W1`` and its passes) is longer than a barrier's delay
(broadcast, ``S``, ``C1``, for Vocab-1 ``T`` and ``C2``, each pass waiting at most one action), so
``extra = 1`` suffices for both variants under those costs. The generator tries ``extra = 0 ..
barriers`` (:func:`~.vocab.least_extra`, the rule :mod:`.vocab_family` uses too:
:func:`~.vocab.place_vocab_passes` inserting the passes under the given costs) and keeps the smallest
``extra`` whose simulated makespan is within :data:`~.vocab.EXTRA_GAIN` of the best one's
(``meta['extra_warmup']``): one more microbatch of memory only for a real gain.

**Peak activation memory per rank** (any ``M_W <= M_B``, any ``m``; tested): at most ``2(p + extra)``
chunk ``M_B``, i.e. ``p + extra`` whole microbatches (``zbv``: ``2p``), ``extra <= barriers`` -- the
paper's ``p + 1`` (Vocab-2) and at most ``p + 2`` (Vocab-1), here on every rank; exactly that on every
rank when ``M_W = 0`` and ``m >= 2p`` (``extra <= 1``); plus ``mem_s`` for each ``S`` whose ``T`` has
not run. With ``memory_limit`` only the ``extra`` whose peak fits are tried.
"""

from __future__ import annotations

from ..catalog import register
from ..costs import CostModel
from ..ir import Action, Op, Placement, Schedule, make_schedule, v_placement
from .common import check_cost_model, check_count
from .handcrafted import VOrder
from .vocab import VARIANT_BARRIERS, check_variant, least_extra
from .vshape import check_v_chunks

__all__ = ["vocab_zbv", "zbv_vocab_order"]


def zbv_vocab_order(num_ranks: int, num_microbatches: int, extra: int) -> list[list[Action]]:
    """The hand-made ZB-V order with ``extra`` more ``(F1, F0)`` pairs in each rank's warm-up (module
    docstring); ``extra = 0`` gives :func:`~.handcrafted.zbv_handcrafted_order`'s warm-up and steady state.

    Like it, the pattern is built for ``n = max(m, 2p - 1)`` microbatches and the actions of
    microbatches ``>= m`` are then left out; a step whose chunk has no forward left (or no forward
    without its backward) is skipped.
    """
    p, m = num_ranks, num_microbatches
    n = max(m, 2 * p - 1)
    ranks = []
    for r in range(p):
        order = VOrder(p, r, limit=n)
        run, done, acts = order.run, order.done, order.acts
        f0, f1, b0, b1, w0, w1 = (Op.F, 0), (Op.F, 1), (Op.B, 0), (Op.B, 1), (Op.W, 0), (Op.W, 1)
        run(*[f0] * (2 * (p - r) - 1), *[f1, f0] * (r + extra), *[f1, b1, w1] * (p - r))   # 1. warm-up
        while (done[f1] < done[f0] or done[f0] < n) and done[b0] < n:                      # 2. steady state
            run(f0, b0, w0, f1, b1, w1)
        while done[b0] < n or done[b1] < n:                                                # 3. cool-down
            run(b0, b1)
        run(*[w1] * (done[b1] - done[w1]), *[w0] * (done[b0] - done[w0]))
        ranks.append([a for a in acts if a.mb < m])
    return ranks


def vocab_zbv(*, num_ranks: int, num_microbatches: int, variant: int = 1, costs: CostModel | None = None,
              memory_limit: float | None = None) -> Schedule:
    """ZB-V with vocabulary parallelism (module docstring).

    Args:
        variant: the paper's ``1`` (Vocab-1: two all-reduce barriers) or ``2`` (Vocab-2: one).
        costs: per-stage (per-chunk, ``2p`` stages) costs and ``costs.vocab``; default ``CostModel()``.
        memory_limit: per-rank activation limit in chunk ``mem_b`` units (``None``: none beyond the
            docstring's ``2(p + barriers)``); only the warm-ups whose simulated peak fits are tried.

    Raises:
        ScheduleError: bad sizes, costs or variant, or no warm-up fits ``memory_limit``.
    """
    p = check_count("num_ranks", num_ranks)
    m = check_count("num_microbatches", num_microbatches)
    vb = check_variant(variant)
    costs = check_cost_model(costs or CostModel())
    s2r, name = v_placement(p), f"zbv-vocab-{variant}"
    extra, ranks, makespan = least_extra(lambda e: [zbv_vocab_order(p, m, e)], s2r, m, costs, vb, name=name,
                                         memory_limit=memory_limit, what="the hand-made ZB-V warm-up")
    return make_schedule(num_microbatches=m, stage_to_rank=s2r, ranks=ranks, name=name, vocab_barriers=vb,
                         variant=variant, extra_warmup=extra, makespan=makespan)


# ---------------------------------------------------------------------------- registration
def _register(variant: int) -> None:
    vb = VARIANT_BARRIERS[variant]
    what = "two all-reduce barriers (C1, C2)" if variant == 1 else "one all-reduce barrier (C1)"

    @register(f"zbv-vocab-{variant}",
              f"ZB-V with vocabulary parallelism, Vocab-{variant}: {what}, peak at most p+{vb} microbatches "
              f"per rank", placement=Placement.V, split_backward=True, cost_aware=True, vocab_parallel=True)
    def build(*, num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: float | None,
              num_chunks: int) -> Schedule:
        check_v_chunks(num_chunks)
        return vocab_zbv(num_ranks=num_ranks, num_microbatches=num_microbatches, variant=variant, costs=costs,
                         memory_limit=memory_limit)


for _v in (1, 2):
    _register(_v)

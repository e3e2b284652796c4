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
barriers`` (:func:`~.vocab.place_vocab_passes` inserting the passes under the given costs) and keeps
the smallest ``extra`` whose simulated makespan is within :data:`EXTRA_GAIN` of the best one's
(``meta['extra_warmup']``): one more microbatch of memory only for a real gain.

**Peak activation memory per rank** (any ``M_W <= M_B``, any ``m``; tested): at most ``2(p + extra)``
chunk ``M_B``, i.e. ``p + extra`` whole microbatches (``zbv``: ``2p``), ``extra <= barriers`` -- the
paper's ``p + 1`` (Vocab-2) and at most ``p + 2`` (Vocab-1), here on every rank; exactly that on every
rank when ``M_W = 0`` and ``m >= 2p`` (``extra <= 1``); plus ``mem_s`` for each ``S`` whose ``T`` has
not run. With ``memory_limit`` only the ``extra`` whose peak fits are tried.
"""

from __future__ import annotations

from typing import Callable, Iterable

from ..catalog import register
from ..costs import CostModel
from ..ir import Action, Op, Placement, Schedule, ScheduleError, make_schedule, v_placement
from ..limits import fits
from ..simulator import simulate
from .common import check_cost_model, check_count
from .handcrafted import VOrder
from .vocab import VARIANT_BARRIERS, place_vocab_passes
from .vshape import check_v_chunks

__all__ = ["EXTRA_GAIN", "fewest_extra_warmup", "vocab_zbv", "zbv_vocab_order"]

EXTRA_GAIN = 0.01
"""A larger warm-up (one more microbatch in flight per rank) is kept only if its simulated makespan is
shorter than the smaller one's by more than this fraction."""


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
    if variant not in VARIANT_BARRIERS:
        raise ScheduleError(f"vocabulary-parallel variant must be 1 (Vocab-1) or 2 (Vocab-2), got {variant!r}")
    costs = check_cost_model(costs or CostModel())
    vb, s2r, name = VARIANT_BARRIERS[variant], v_placement(p), f"zbv-vocab-{variant}"
    makespan, extra, ranks = fewest_extra_warmup(lambda extra: [zbv_vocab_order(p, m, extra)], range(vb + 1),
                                                 stage_to_rank=s2r, num_microbatches=m, costs=costs, barriers=vb,
                                                 name=name, memory_limit=memory_limit,
                                                 least_is="the hand-made ZB-V warm-up")
    return make_schedule(num_microbatches=m, stage_to_rank=s2r, ranks=ranks, name=name, vocab_barriers=vb,
                         variant=variant, extra_warmup=extra, makespan=makespan)


def fewest_extra_warmup(bases: Callable[[int], list[list[list[Action]]]], extras: Iterable[int], *,
                        stage_to_rank: list[int], num_microbatches: int, costs: CostModel, barriers: int, name: str,
                        memory_limit: float | None, least_is: str) -> tuple[float, int, list[list[Action]]]:
    """The module docstring's rule, for any placement: for each ``extra`` of ``extras`` (more warm-up in
    flight), the base orders ``bases(extra)`` with the vocabulary passes placed
    (:func:`~.vocab.place_vocab_passes`), each simulated; per ``extra`` the fastest that fits
    ``memory_limit`` (least peak on a tie); then the smallest ``extra`` whose makespan is within
    :data:`EXTRA_GAIN` of the fastest one's. Returns ``(makespan, extra, ranks)`` (makespan in ``costs``'
    time unit).

    Raises:
        ScheduleError: no candidate fits ``memory_limit`` (naming the least peak, ``least_is``).
    """
    m, s2r = num_microbatches, stage_to_rank
    best: dict[int, tuple[tuple[float, float], float, list[list[Action]]]] = {}  # extra -> (score, makespan, ranks)
    least = float("inf")
    for extra in extras:
        for base in bases(extra):
            ranks = place_vocab_passes(base, s2r, m, costs, barriers)
            res = simulate(make_schedule(num_microbatches=m, stage_to_rank=s2r, ranks=ranks, name=name,
                                         vocab_barriers=barriers), costs, enforce_memory=False)
            least = min(least, res.max_peak_memory)
            score = (round(res.makespan, 9), round(res.max_peak_memory, 9))
            if (memory_limit is None or fits(res.max_peak_memory, memory_limit)) and (
                    extra not in best or score < best[extra][0]):
                best[extra] = (score, res.makespan, ranks)
    if not best:
        raise ScheduleError(f"memory_limit {memory_limit:g} is below the least peak of {name} ({least:g}, "
                            f"{least_is}) for p={len(set(s2r))}, m={m}")
    fastest = min(t for _, t, _ in best.values())
    extra = min(e for e, (_, t, _) in best.items() if t <= fastest * (1 + EXTRA_GAIN))
    return best[extra][1], extra, best[extra][2]


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

"""1F1B and ZB-H1 with vocabulary parallelism (Yeung et al., MLSys 2025): the embedding and the
output layer split over every pipeline rank, their passes ``IF``/``S``/``T``/``IB`` placed in the
pipeline (docs/vocab_parallel_schedules.md).

The last stage's backward of microbatch ``i`` waits for the output layer: ``S(i)`` on every rank,
the all-reduce ``C1``, and with two barriers (the paper's Vocab-1, Algorithm 1) also ``T(i)`` on
every rank and the all-reduce ``C2``; with one barrier (Vocab-2, Algorithm 2) only ``C1``. Each
barrier can wait up to one backward on the slowest rank, so the last stage keeps that many more
forwards in flight to stay busy: the warm-up of rank ``r`` is ``p - r + barriers`` forwards
instead of 1F1B's ``p - r``, and the peak activation memory of rank 0 is ``p + 2`` (Vocab-1) or
``p + 1`` (Vocab-2) microbatches instead of ``p`` (the paper's Table, "p+2 vs p+1").

=====================  ===========  ============================  ==============================
schedule               barriers     warm-up forwards, rank ``r``  peak, rank ``r`` (``m`` large)
=====================  ===========  ============================  ==============================
``1f1b-vocab-1``       2 (C1, C2)   ``p - r + 2``                 ``(p - r + 2) M_B``
``1f1b-vocab-2``       1 (C1)       ``p - r + 1``                 ``(p - r + 1) M_B``
``zb-h1-vocab-1/2``    2 / 1        as above, ``W`` delayed by    as above, plus ``r M_W``
                                    ``r`` as ZB-H1                (the delayed W's)
=====================  ===========  ============================  ==============================

(plus ``mem_s`` on each rank for each ``S`` whose ``T`` has not run.) The vocabulary passes are
placed by the one timing kernel: each rank keeps its base order and runs a vocabulary pass, in
microbatch order per kind, whenever one is ready no later than its next base action (a cheap
pass first on a tie). ``IF(i)`` becomes eligible once the first stage has started ``F(i - 2)``,
so the embedding's all-reduce is two microbatches ahead of its use without running all of them
at the start.

Shared with the other vocabulary generators (:mod:`.vocab_v`, :mod:`.vocab_family`): :func:`deepen`
(an order with ``extra`` more microbatches in flight per stage) and :func:`least_extra` (the one rule
choosing ``extra``).
"""

from __future__ import annotations

import math
from typing import Callable

from ..catalog import register
from ..costs import CostModel
from ..ir import VOCAB_OPS, Action, Op, Placement, Schedule, ScheduleError, make_schedule, plain_placement
from ..limits import fits
from ..simulator import simulate
from ..timing import IF_CODE, Timeline, decode, encode
from .baselines import check_shape, one_f_one_b_order

__all__ = ["EXTRA_GAIN", "VARIANT_BARRIERS", "check_variant", "deepen", "least_extra", "place_vocab_passes",
           "vocab_1f1b"]

VARIANT_BARRIERS = {1: 2, 2: 1}
"""The paper's variant -> all-reduce barriers before the last stage's backward (Vocab-1: C1 and C2
of Algorithm 1; Vocab-2: C1 of Algorithm 2)."""

IF_LOOKAHEAD = 2
"""``IF(i)`` is eligible once the first stage has started ``F(i - IF_LOOKAHEAD)``."""

EXTRA_GAIN = 0.01
"""A larger warm-up (one more microbatch in flight per rank) is kept only if its simulated makespan is
shorter than the smaller one's by more than this fraction (:func:`least_extra`)."""


def check_variant(variant: object) -> int:
    """The all-reduce barriers of the paper's ``variant`` (1 or 2); else a :class:`ScheduleError`."""
    if variant not in VARIANT_BARRIERS:
        raise ScheduleError(f"vocabulary-parallel variant must be 1 (Vocab-1) or 2 (Vocab-2), got {variant!r}")
    return VARIANT_BARRIERS[variant]


def place_vocab_passes(base: list[list[Action]], stage_to_rank: list[int], num_microbatches: int,
                       costs: CostModel, barriers: int) -> list[list[Action]]:
    """Per rank, ``base`` (transformer actions only) with every vocabulary pass inserted.

    A list schedule over :class:`~.timing.Timeline`: repeatedly, the rank whose next action can
    start earliest runs it; a rank's next action is its next base action or its next pass of a
    kind (``IF``, ``S``, ``T``, ``IB``, each kind in microbatch order), whichever is ready first
    (a vocabulary pass on a tie). Raises :class:`ScheduleError` if the base order deadlocks.
    """
    p, m, n = len(base), num_microbatches, len(stage_to_rank)
    tl = Timeline(stage_to_rank, m, costs.resolve(n), num_ranks=p, vocab_barriers=barriers)
    orders = [[encode(a) for a in acts] for acts in base]
    ptr = [0] * p
    nxt = [[0] * len(VOCAB_OPS) for _ in range(p)]      # [rank][op code - IF]: next microbatch
    f0_start = [math.inf] * m                           # start of F(i) on the first stage
    out: list[list[Action]] = [[] for _ in range(p)]

    def candidates(r: int) -> list[tuple[float, int, tuple[int, int, int]]]:
        cands = []
        for k, mb in enumerate(nxt[r]):
            if mb < m and (k != 0 or mb < IF_LOOKAHEAD or f0_start[mb - IF_LOOKAHEAD] < math.inf):
                ready = tl.ready(IF_CODE + k, mb, r)
                if k == 0 and mb >= IF_LOOKAHEAD:
                    ready = max(ready, f0_start[mb - IF_LOOKAHEAD])
                cands.append((ready, 0, (IF_CODE + k, mb, r)))
        if ptr[r] < len(orders[r]):
            op, mb, stage = orders[r][ptr[r]]
            cands.append((tl.ready(op, mb, stage), 1, (op, mb, stage)))
        return cands

    while True:
        best = None
        for r in range(p):
            for ready, tie, code in candidates(r):
                if ready == math.inf:
                    continue
                key = (max(ready, tl.clock[r]), tie, r)
                if best is None or key < best[0]:
                    best = (key, ready, r, code)
        if best is None:
            break
        _, ready, r, (op, mb, stage) = best
        start = tl.run(r, op, mb, stage, ready)
        out[r].append(decode((op, mb, stage)))
        if op >= IF_CODE:
            nxt[r][op - IF_CODE] += 1
        else:
            ptr[r] += 1
            if op == 0 and stage == 0:
                f0_start[mb] = start
    if any(ptr[r] < len(orders[r]) for r in range(p)) or any(k < m for row in nxt for k in row):
        raise ScheduleError("the base order deadlocks with the vocabulary passes' barriers")
    return out


def deepen(base: list[list[Action]], extra: int) -> list[list[Action]]:
    """Per rank, ``base`` with each stage's forwards ``extra`` microbatches earlier: every other action
    of the rank (``B``, ``W``, ``BW``) keeps its place among the others, and before it the rank has run
    ``extra`` more forwards of each of its stages than in ``base`` (all of them at most); the forwards
    keep their order.

    On 1F1B's order this is 1F1B with ``extra`` more warm-up forwards (:func:`vocab_1f1b`'s base). Per
    stage, so each stage's forwards move by the same number of microbatches on every rank (a uniform
    shift of the rank's forward sequence can deadlock the V, whose ranks interleave their two chunks'
    forwards differently). Memory (any order, any costs): a state of the new order -- ``q`` other
    actions done -- holds, per stage, at most ``extra`` more forwards than ``base`` holds just before
    its ``(q+1)``-th other action, so at most ``base``'s peak plus ``extra`` x the ``mem_b`` of the
    rank's stages.
    """
    out = []
    for acts in base:
        pending: list[tuple[int, Action]] = []          # (ordinal among its stage's forwards, forward)
        total: dict[int, int] = {}
        for a in acts:
            if a.op is Op.F:
                pending.append((total.get(a.stage, 0), a))
                total[a.stage] = total.get(a.stage, 0) + 1
        seen = dict.fromkeys(total, 0)                  # forwards of each stage before it in base
        row: list[Action] = []
        for a in acts:
            if a.op is Op.F:
                seen[a.stage] += 1
                continue
            need = {s: seen[s] + extra for s in total}
            row.extend(f for k, f in pending if k < need[f.stage])
            pending = [(k, f) for k, f in pending if k >= need[f.stage]]
            row.append(a)
        out.append(row + [f for _, f in pending])
    return out


def least_extra(bases: Callable[[int], list[list[list[Action]]]], stage_to_rank: list[int],
                num_microbatches: int, costs: CostModel, barriers: int, *, name: str,
                memory_limit: float | None, what: str) -> tuple[int, list[list[Action]], float]:
    """The warm-up rule of every vocabulary family with a searched warm-up: for ``extra = 0 .. barriers``
    each candidate order of ``bases(extra)`` (none: no order for that ``extra``) with the passes placed
    (:func:`place_vocab_passes`) and simulated; per ``extra`` the fastest whose peak fits ``memory_limit``
    (``None``: all; the lesser peak on a tie); then the smallest ``extra`` whose makespan is within
    :data:`EXTRA_GAIN` of the fastest's.

    Returns:
        ``(extra, ranks, makespan)`` (makespan in ``costs``' time unit).

    Raises:
        ScheduleError: no ``extra`` fits ``memory_limit`` (the message gives the least peak, of ``what``).
    """
    m, s2r = num_microbatches, stage_to_rank
    best: dict[int, tuple[tuple[float, float], float, list[list[Action]]]] = {}  # extra -> (score, makespan, ranks)
    least = math.inf
    for extra in range(barriers + 1):
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
                            f"{what}) for p={max(s2r) + 1}, m={m}")
    fastest = min(t for _, t, _ in best.values())
    extra = min(e for e, (_, t, _) in best.items() if t <= fastest * (1 + EXTRA_GAIN))
    return extra, best[extra][2], best[extra][1]


def vocab_1f1b(*, num_ranks: int, num_microbatches: int, variant: int = 1, split_backward: bool = False,
               costs: CostModel | None = None) -> Schedule:
    """1F1B (``split_backward=False``) or ZB-H1 (``True``) with vocabulary parallelism.

    Args:
        variant: the paper's ``1`` (Vocab-1: two all-reduce barriers, peak ``p + 2``
            microbatches) or ``2`` (Vocab-2: one barrier, peak ``p + 1``).
        costs: placement of the vocabulary passes is timed with these (defaults: ``CostModel()``).
    """
    check_shape(num_ranks, num_microbatches)
    p, m, vb = num_ranks, num_microbatches, check_variant(variant)
    warmup = [p - r + vb for r in range(p)]                        # 1. warm-up: `barriers` more than 1F1B
    delay = list(range(p)) if split_backward else None             # 2. ZB-H1: W delayed by r
    base = one_f_one_b_order(p, m, warmup=warmup, delay=delay)     # 3. the 1F1B order of F, B/BW, W
    s2r = plain_placement(p)
    ranks = place_vocab_passes(base, s2r, m, costs or CostModel(), vb)  # 4. IF/S/T/IB where ready
    name = f"{'zb-h1' if split_backward else '1f1b'}-vocab-{variant}"
    return make_schedule(num_microbatches=m, stage_to_rank=s2r, ranks=ranks, name=name, vocab_barriers=vb,
                         variant=variant)


# ---------------------------------------------------------------------------- registration
def _register(variant: int, split_backward: bool) -> None:
    base = "zb-h1" if split_backward else "1f1b"
    peak = f"p+{VARIANT_BARRIERS[variant]}"
    what = "two all-reduce barriers (C1, C2)" if variant == 1 else "one all-reduce barrier (C1)"

    @register(f"{base}-vocab-{variant}",
              f"{'ZB-H1' if split_backward else '1F1B'} with vocabulary parallelism, Vocab-{variant}: {what}, "
              f"peak {peak} microbatches", placement=Placement.PLAIN, split_backward=split_backward, cost_aware=True,
              vocab_parallel=True)
    def build(*, num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: float | None,
              num_chunks: int) -> Schedule:
        return vocab_1f1b(num_ranks=num_ranks, num_microbatches=num_microbatches, variant=variant,
                          split_backward=split_backward, costs=costs)


for _sb in (False, True):
    for _v in (1, 2):
        _register(_v, _sb)

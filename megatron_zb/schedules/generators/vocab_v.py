"""ZB-V with vocabulary parallelism (Yeung et al., MLSys 2025): ``zbv-vocab-1`` and ``zbv-vocab-2``,
the V placement's order with the passes ``IF``/``S``/``T``/``IB`` of every rank placed in it
(docs/vocab_parallel_schedules.md).

**Where the barriers bite on the V.** Rank 0 holds stage 0 and the last stage ``2p-1``
(:func:`~..ir.v_placement`): the last stage's forward output ``X`` is broadcast from rank 0, and the
last stage's backward of microbatch ``i`` -- on rank 0 -- waits for ``S(i)`` on every rank and the
all-reduce ``C1`` (Vocab-2), or also for ``T(i)`` everywhere and ``C2`` (Vocab-1). ZB-V's own order
runs the last stage's ``B(i)`` right after its ``F(i)`` (its steady state is ``F0, B0, W0, F1, B1,
W1``), so every barrier would stall rank 0 and, through the V's chain of backwards, every rank. As
on the plain placement (:mod:`.vocab`: ``barriers`` more warm-up forwards), the cure is more
microbatches in flight: each barrier can hold the last stage's backward for about one action of the
busiest rank, so the order gets room for ``barriers`` more microbatches between a forward of the
last stage and its backward.

**The order.** ZB-V's knob search (:func:`~.search.search`, the one ``zbv`` runs) builds V orders
under the per-rank activation limit

    ``L = R + barriers * M``   (uniform chunks: ``2(p + barriers)`` chunk ``M_B``, i.e. ``p + barriers``
    whole microbatches: the paper's ``p + 2`` / ``p + 1``, here on every rank)

where ``R`` is 1F1B's peak (:func:`~.vshape.one_f_one_b_memory`; ``zbv``'s default limit) and ``M``
one microbatch's share of a rank (:func:`~.vshape.v_full_memory`), and at the grid limits ``R + j M``
for ``j < barriers``, each built under *proxy* costs that show the search the passes: the last
stage's forward longer by the barrier delay (broadcast, ``S``, ``C1``; Vocab-1 also ``T``, ``C2``)
and each rank's chunk-0 ``W`` longer by the rank's vocabulary work per microbatch (``IF + S + T +
IB``). The paper's hand-made ZB-V order (:func:`~.handcrafted.zbv_handcrafted_order`) is one more
candidate. :func:`~.vocab.place_vocab_passes` then inserts the passes into each candidate under the
real costs, and the candidate with the smallest simulated ``(makespan, peak)`` is kept.

**Peak activation memory per rank**: at most ``L`` (the transformer chunks' activations; every
candidate's order is checked against it without the passes, which hold no transformer activation),
plus ``mem_s`` for each ``S`` whose ``T`` has not run -- for uniform chunks ``2(p + barriers)`` chunk
``M_B`` on every rank, against ``zbv``'s ``2p`` (tested: ``tests/schedules/test_vocab_v.py``). An
explicit ``memory_limit`` replaces ``L`` (from :func:`~.vshape.v_min_memory` upwards).
"""

from __future__ import annotations

from dataclasses import replace

from ..catalog import register
from ..costs import CostModel, StageCosts
from ..ir import Action, Placement, Schedule, ScheduleError, make_schedule, v_placement
from ..limits import check_minimum, fits
from ..simulator import simulate
from .common import check_cost_model, check_count
from .handcrafted import zbv_handcrafted_order
from .search import search
from .vocab import VARIANT_BARRIERS, place_vocab_passes
from .vshape import check_v_chunks, one_f_one_b_memory, v_full_memory, v_min_memory

__all__ = ["vocab_proxy_costs", "vocab_zbv", "vocab_zbv_limit"]


def vocab_zbv_limit(num_ranks: int, costs: CostModel | StageCosts, barriers: int) -> float:
    """``L = R + barriers * M`` (unit: one chunk's ``mem_b``; module docstring)."""
    return one_f_one_b_memory(num_ranks, costs) + barriers * v_full_memory(num_ranks, costs)


def vocab_proxy_costs(sc: StageCosts, num_ranks: int, barriers: int) -> StageCosts:
    """The transformer costs the search builds orders under (module docstring): the last stage's ``F``
    longer by the barrier delay, stage ``r``'s ``W`` longer by rank ``r``'s vocabulary work."""
    vc = sc.vocab_for(num_ranks)
    c = vc.t_collective
    delay = c + max(vc.t_s) + c + ((max(vc.t_t) + c) if barriers == 2 else 0.0)
    t_f, t_w = list(sc.t_f), list(sc.t_w)
    t_f[-1] += delay
    for r in range(num_ranks):
        t_w[r] += vc.t_if[r] + vc.t_s[r] + vc.t_t[r] + vc.t_ib[r]
    return replace(sc, t_f=tuple(t_f), t_w=tuple(t_w))


def vocab_zbv(*, num_ranks: int, num_microbatches: int, variant: int = 1, costs: CostModel | None = None,
              memory_limit: float | None = None) -> Schedule:
    """ZB-V with vocabulary parallelism (module docstring).

    Args:
        variant: the paper's ``1`` (Vocab-1: two all-reduce barriers) or ``2`` (Vocab-2: one).
        costs: per-stage (per-chunk, ``2p`` stages) costs and ``costs.vocab``; default ``CostModel()``.
        memory_limit: per-rank transformer activation limit in chunk ``mem_b`` units; ``None``:
            :func:`vocab_zbv_limit`.

    Raises:
        ScheduleError: bad sizes or costs, a limit below :func:`~.vshape.v_min_memory`, or no order fits.
    """
    p = check_count("num_ranks", num_ranks)
    m = check_count("num_microbatches", num_microbatches)
    if variant not in VARIANT_BARRIERS:
        raise ScheduleError(f"vocabulary-parallel variant must be 1 (Vocab-1) or 2 (Vocab-2), got {variant!r}")
    costs = check_cost_model(costs or CostModel())
    vb, s2r = VARIANT_BARRIERS[variant], v_placement(p)
    sc = costs.resolve(len(s2r))
    limit = vocab_zbv_limit(p, sc, vb) if memory_limit is None else float(memory_limit)
    check_minimum(limit, v_min_memory(p, sc), "a rank must hold both chunks of one microbatch at once",
                  placement="V")
    name = f"zbv-vocab-{variant}"
    best: tuple[tuple[float, float], list[list[Action]]] | None = None
    for base in _candidates(s2r, m, sc, vb, limit):
        if not fits(simulate(Schedule(m, s2r, base, name), sc, enforce_memory=False).max_peak_memory, limit):
            continue
        try:
            ranks = place_vocab_passes(base, s2r, m, costs, vb)
        except ScheduleError:   # pragma: no cover - the passes wait for nothing a base order holds back
            continue
        res = simulate(make_schedule(num_microbatches=m, stage_to_rank=s2r, ranks=ranks, name=name,
                                     vocab_barriers=vb), costs, enforce_memory=False)
        score = (round(res.makespan, 9), round(res.max_peak_memory, 9))
        if best is None or score < best[0]:
            best = (score, ranks)
    if best is None:  # pragma: no cover - the hand-made order fits any limit from zbv's default up
        raise ScheduleError(f"no ZB-V order with vocabulary passes fits the limit {limit:g} (p={p}, m={m})")
    return make_schedule(num_microbatches=m, stage_to_rank=s2r, ranks=best[1], name=name, vocab_barriers=vb,
                         variant=variant, memory_limit=limit, makespan=best[0][0])


def _candidates(s2r: list[int], m: int, sc: StageCosts, barriers: int, limit: float) -> list[list[list[Action]]]:
    """The base (transformer) orders tried: the search's under the proxy costs at ``limit`` and at the
    grid limits ``R + j M`` below it, and the hand-made ZB-V order."""
    p = len(s2r) // 2
    proxy = vocab_proxy_costs(sc, p, barriers)
    ref, full = one_f_one_b_memory(p, sc), v_full_memory(p, sc)
    limits = [limit] + [ref + j * full for j in range(barriers) if ref + j * full < limit]
    out = []
    for lim in limits:
        if fits(v_min_memory(p, sc), lim):
            got = search(s2r, m, proxy, lim)
            if got is not None:
                out.append([list(r) for r in got[0]])
    out.append(zbv_handcrafted_order(p, m))
    return out


# ---------------------------------------------------------------------------- registration
def _register(variant: int) -> None:
    vb = VARIANT_BARRIERS[variant]
    what = "two all-reduce barriers (C1, C2)" if variant == 1 else "one all-reduce barrier (C1)"

    @register(f"zbv-vocab-{variant}",
              f"ZB-V with vocabulary parallelism, Vocab-{variant}: {what}, peak p+{vb} microbatches per rank",
              placement=Placement.V, split_backward=True, cost_aware=True, vocab_parallel=True)
    def build(*, num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: float | None,
              num_chunks: int) -> Schedule:
        check_v_chunks(num_chunks)
        return vocab_zbv(num_ranks=num_ranks, num_microbatches=num_microbatches, variant=variant, costs=costs,
                         memory_limit=memory_limit)


for _v in (1, 2):
    _register(_v)

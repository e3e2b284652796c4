"""V-shaped zero-bubble schedules: ZB-V, V-Half, V-Min, and any memory limit in between; and
``1f1b-v``, the V placement with every backward fused (:func:`v_fused`).

Placement (:func:`~megatron_zb.schedules.ir.v_placement`): ``p`` ranks, ``2p`` stages; rank ``r``
holds stage ``r`` (its *chunk 0*) and stage ``2p-1-r`` (its *chunk 1*), so rank 0 holds the first
and the last stage and the middle of the V (stages ``p-1`` and ``p``) sits on rank ``p-1``.
Costs are per stage, i.e. per chunk (``t_f[s]``, ``mem_b[s]``, ... for ``s`` in ``0..2p-1``);
one rank's share of a whole microbatch is ``M = mem_b[r] + mem_b[2p-1-r]``.

Units: times in any one unit; memory limits in the unit of ``costs.mem_b`` -- one *chunk's*
``M_B``. For uniform chunks 1F1B's peak is ``p`` full rank-shares, ``p * M = 2p`` chunk units.

The families differ only in the default per-rank activation-memory limit. The reference is
``R``, 1F1B's peak for the same model (:func:`one_f_one_b_memory`): chunks ``2r`` and ``2r+1``
form 1F1B's stage ``r`` and rank ``r`` of 1F1B holds ``p - r`` microbatches, so
``R = max_r (p - r) * (mem_b[2r] + mem_b[2r+1])`` (``= p * M = 2p`` chunk units for uniform
chunks). Measured on a real GPT the chunks are not uniform -- the last one carries the output
layer and the logits -- and rank 0 of the V holds both the first and the last chunk, so a
limit of ``p * M`` would let ZB-V exceed 1F1B's peak; ``R`` does not. A default is never below
the feasible minimum (:func:`v_min_memory`: ``M``, or more when a ``B`` allocates):

==========  ==============================  ========================================================
name        default limit                   what it gives (unit costs, ``m >= 2p``)
==========  ==============================  ========================================================
``zbv``     ``R`` (1F1B's peak)              near-zero bubble
``v-half``  ``(p/2 + 1) / p * R``            about half of 1F1B's memory (published V-Half:
                                            ``(p+2)//2`` microbatches of 1F1B's ``p``), < 0.6x
                                            its bubble
``v-min``   ``(p/3 + 1.5) / p * R``          about a third of 1F1B's memory, bubble <= 1F1B's
``1f1b-v``  ``R``                           fused backward (``BW``): for runtimes whose split
                                            backward costs more than the fused one; at least
                                            ``(p-1)(T_F + T_BW)`` of a chunk (half of 1F1B's)
==========  ==============================  ========================================================

Any explicit ``memory_limit`` from the feasible minimum (one microbatch in flight per rank:
``M``, or, when ``B`` allocates -- ``mem_w > mem_b`` --, what the rank holds right after that
``B``) upwards gives a valid schedule; below it :class:`ScheduleError` states the minimum.

The algorithm: the event-driven list scheduler of :mod:`.list_scheduler` (any placement;
:mod:`.interleaved_zb` uses it too) whose knobs are tuned per problem by the coordinate-descent
search of :mod:`.search`, every candidate scored by its simulated makespan (ties: lower peak
memory); small problems (<= 200 actions) then get a local search that moves single actions while
the simulated makespan improves (:func:`~.list_scheduler.improve`). With an overlapped
data-parallel reduce in the costs (``costs.dp_reduce``), the result's trailing W's are then regrouped chunk by chunk when
that ends the predicted iteration sooner (:func:`~..dp_reduce.reduce_aware_tail`; a V rank's two
chunks reduce separately, so finishing one chunk's W's first lets its buckets reduce under the
other's). The knobs that matter on the V:
the warm-up depth (how many microbatches may be between the rank's first chunk and its last chunk:
as many first-chunk forwards as fit before microbatch 0 comes back to the rank's second chunk), a
cap on microbatches in flight (for tight limits), and *pacing*: microbatch ``i`` enters stage 0 no
earlier than ``(i - burst) * period`` with ``period`` the busiest rank's work per microbatch -- with
little memory this keeps microbatches from travelling in convoys that leave every rank idle
between the waves.

The search also builds orders under simplified costs (no ``T_comm``; equal times) and times them
under the real costs (:func:`~.search.proxy_costs`): on long pipelines the scheduler's reaction to small
communication delays can drift into an irregular steady state, while the order built without them
stays regular and is better under the real costs too.

Monotonicity in the limit: the search also runs at the grid limit ``k*M/2`` just below the
requested one (a schedule that fits a smaller limit fits a larger one), so the bubble does not
grow when the limit rises, up to the heuristic noise between grid points.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

from ..catalog import register
from ..costs import CostModel, StageCosts
from ..dp_reduce import overlapped_reduce_tail
from ..fusion import fuse_all
from ..ir import V_CHUNKS_PER_RANK, Action, Op, Placement, Schedule, ScheduleError, make_schedule, v_placement, v_stages
from ..limits import check_minimum, fits, resolve_limit
from ..simulator import simulate
from .common import check_cost_model, check_count
from .handcrafted import zbv_handcrafted_order
from .list_scheduler import asap_times, improve
from .search import proxy_costs, search

__all__ = ["one_f_one_b_memory", "v_default_limit", "v_full_memory", "v_fused", "v_half", "v_min", "v_min_memory",
           "v_schedule", "zbv"]

_IMPROVE_MAX_ACTIONS = 200
"""Problems with at most this many actions get a local-search pass after the knob search."""


# ---------------------------------------------------------------------------- the V family
def check_v_chunks(num_chunks: object) -> None:
    """The V placement has exactly two chunks per rank; anything else is a :class:`ScheduleError`."""
    if num_chunks != V_CHUNKS_PER_RANK:
        kind = "an odd" if isinstance(num_chunks, int) and num_chunks % 2 else "a"
        raise ScheduleError(f"the V placement has exactly 2 chunks per rank (stage r and stage 2p-1-r); "
                            f"got {kind} chunk count {num_chunks!r}")


def v_full_memory(num_ranks: int, costs: CostModel | StageCosts) -> float:
    """``M``: the largest per-rank share of one microbatch's activations, ``mem_b[r] + mem_b[2p-1-r]``."""
    sc = costs.resolve(V_CHUNKS_PER_RANK * num_ranks) if isinstance(costs, CostModel) else costs
    return max(_rank_share(sc, num_ranks, r) for r in range(num_ranks))


def _rank_share(sc: StageCosts, num_ranks: int, rank: int) -> float:
    """Rank ``rank``'s share of one microbatch's activations: the ``mem_b`` of both its V stages."""
    first, second = v_stages(num_ranks, rank)
    return sc.mem_b[first] + sc.mem_b[second]


def one_f_one_b_memory(num_ranks: int, costs: CostModel | StageCosts) -> float:
    """``R``: 1F1B's peak activation memory for the model whose ``2p`` chunks these costs describe.

    1F1B places chunks ``2r`` and ``2r+1`` (the same layers, in order) on rank ``r``, which holds
    ``p - r`` microbatches in flight at its peak (``m >= p``), so
    ``R = max_r (p - r) * (mem_b[2r] + mem_b[2r+1])`` in units of ``mem_b``.
    """
    sc = costs.resolve(V_CHUNKS_PER_RANK * num_ranks) if isinstance(costs, CostModel) else costs
    p = num_ranks
    return max((p - r) * (sc.mem_b[2 * r] + sc.mem_b[2 * r + 1]) for r in range(p))


def v_default_limit(num_ranks: int, costs: CostModel | StageCosts, fraction: float) -> float:
    """``max(M, min(fraction, p) / p * R)``: a family's default limit (see the module docstring);
    :func:`v_schedule` raises it to :func:`v_min_memory` when that is larger."""
    p = num_ranks
    return max(v_full_memory(p, costs), min(fraction, p) / p * one_f_one_b_memory(p, costs))


def v_min_memory(num_ranks: int, costs: CostModel | StageCosts) -> float:
    """The smallest feasible per-rank limit on the V placement (unit of ``mem_b``).

    Rank ``r`` must hold microbatch ``i``'s chunk-0 activation until ``B(i, r)``, which needs
    ``B(i, 2p-1-r)``, which needs ``F(i, 2p-1-r)``: both chunks at once, ``mem_b[r] + mem_b[2p-1-r]``
    (= :func:`v_full_memory`); when a ``B`` allocates (``mem_w > mem_b``), also ``mem_b[r] +
    mem_w[2p-1-r]`` right after ``B(i, 2p-1-r)`` and ``mem_w[r]`` right after ``B(i, r)``
    (:meth:`~..costs.StageCosts.microbatch_peak`). Running one microbatch at a time needs no more,
    so this is the minimum.
    """
    sc = costs.resolve(V_CHUNKS_PER_RANK * num_ranks) if isinstance(costs, CostModel) else costs
    return max(sc.microbatch_peak(v_stages(num_ranks, r)) for r in range(num_ranks))


def v_schedule(*, num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: float | None = None,
               name: str = "v", default_fraction: Callable[[int], float] | None = None) -> Schedule:
    """A V-placement zero-bubble schedule under a per-rank activation-memory limit.

    Args:
        num_ranks: ``p`` (>= 1); the model has ``2p`` stages.
        num_microbatches: ``m`` (>= 1).
        costs: per-stage (per-chunk) costs for ``2p`` stages; times in any unit.
        memory_limit: per-rank peak activation limit in units of ``costs.mem_b`` (one chunk's
            ``M_B``), resolved by :func:`~..limits.resolve_limit`: ``None``: ``costs.memory_limit``,
            else :func:`v_default_limit` with ``default_fraction(p)`` (1F1B's peak ``R`` when no
            fraction is given); no activation memory at all means no limit.
        name: the schedule's name.

    Raises:
        ScheduleError: bad sizes or costs, or a limit below :func:`v_min_memory`.
    """
    p = check_count("num_ranks", num_ranks)
    m = check_count("num_microbatches", num_microbatches)
    s2r = v_placement(p)
    base = check_cost_model(costs).resolve(len(s2r))
    full = v_full_memory(p, base)
    least = v_min_memory(p, base)
    frac = default_fraction(p) if default_fraction is not None else float(p)
    limit = resolve_limit(memory_limit, costs, v_default_limit(p, base, frac), minimum=least)
    worst = max(range(p), key=lambda r: base.microbatch_peak(v_stages(p, r)))
    held = ("both of its chunks' activations of one microbatch (mem_b[{}] + mem_b[{}]) at once" if least == full else
            "one microbatch's activations until its B and then what its W keeps (mem_w > mem_b: B allocates; "
            "stages {} and {})")
    check_minimum(limit, least, "rank {} must hold {}, so no schedule fits".format(
        worst, held.format(*v_stages(p, worst))), placement="V")
    sc = costs.with_limit(limit).resolve(len(s2r))
    ranks, variant = _best_order(s2r, m, sc, limit, full, name)
    res = simulate(Schedule(m, s2r, ranks, name), sc)    # validates; checks memory and deadlock
    return make_schedule(num_microbatches=m, stage_to_rank=s2r, ranks=ranks, name=name,
                         memory_limit=limit, variant=variant, makespan=res.makespan)


def _best_order(s2r: list[int], m: int, sc: StageCosts, limit: float, full: float,
                name: str) -> tuple[list[list[Action]], str]:
    """The V order with the best ``(makespan, peak, total)`` under ``sc`` among the knob search's,
    its proxies' and the paper's hand-made ZB-V order, then locally improved (small problems); its
    variant description.

    With ``sc.dp_reduce`` (overlapped) every finalist, and the result, has its tail's W's regrouped
    chunk by chunk when the simulator says that ends the reduce sooner (:func:`~..dp_reduce.reduce_aware_tail`),
    and an order built without the reduce is one more finalist: the search sees only untouched
    tails, so a finalist that loses before the regrouping may win after it.
    """
    p = len(s2r) // 2
    best: tuple[list[list[Action]], tuple[float, ...], str] | None = None

    def tail(ranks: list[list[Action]]) -> list[list[Action]]:
        return overlapped_reduce_tail(Schedule(m, s2r, ranks, name), sc).ranks

    def offer(ranks: list[list[Action]], variant: str, score: tuple[float, ...] | None = None) -> None:
        nonlocal best
        regrouped = tail(ranks)
        if regrouped != ranks:
            ranks, variant, score = regrouped, variant + " + reduce-aware tail", None
        if score is None:
            ms, pk, tot = asap_times(s2r, m, sc, ranks)
            score = (round(ms, 9), round(pk, 9), round(tot, 9))
        if best is None or score < best[1]:
            best = (ranks, score, variant)

    got = search(s2r, m, sc, limit)
    if got is not None:
        offer(got[0], got[2], got[1])
    if math.isfinite(limit) and full > 0:
        # also the grid limit k*M/2 just below: a schedule that fits it fits this limit too, which
        # keeps the bubble from rising with the limit (up to the noise between grid points)
        g = math.ceil(limit / (full / 2) - 1e-9) - 1
        if g >= 2 and fits(v_min_memory(p, sc), g * full / 2):   # (below the minimum when B allocates)
            lower = search(s2r, m, sc, g * full / 2, max_sweeps=1)
            if lower is not None:
                offer(lower[0], lower[2] + f" (limit {g * full / 2:g})", lower[1])
    proxies = proxy_costs(sc) + ([("no DP reduce", replace(sc, dp_reduce=None))] if sc.dp_reduce is not None else [])
    for tag, proxy in proxies:
        # orders built under simplified costs, timed under the real ones: on large pipelines the
        # scheduler's reaction to T_comm or uneven T's can drift into irregular steady states
        got = search(s2r, m, proxy, limit, max_sweeps=1)
        if got is not None:
            offer(got[0], f"built with {tag}: {got[2]}")
    # the paper's hand-made ZB-V order, re-timed under these costs: kept when it fits the limit and
    # beats the search (so the result is never worse than it)
    hand = zbv_handcrafted_order(p, m)
    res = simulate(Schedule(m, s2r, hand, name), sc, enforce_memory=False)
    if fits(res.max_peak_memory, limit):
        offer(hand, "hand-made ZB-V order (paper Sec. 6)",
              (round(res.makespan, 9), round(res.max_peak_memory, 9), round(res.total_time, 9)))
    if best is None:  # pragma: no cover - the memory-only knobs cannot get stuck on the V
        raise ScheduleError(f"no V schedule found for p={p}, m={m}, memory_limit={limit:g}")
    ranks, _, variant = best
    if 6 * p * m <= _IMPROVE_MAX_ACTIONS:
        better = improve(s2r, m, sc, limit, ranks)
        if better != ranks:
            ranks, variant = better, variant + " + local search"
        regrouped = tail(ranks)   # the local search may have moved W's of the tail
        if regrouped != ranks:
            ranks, variant = regrouped, variant + " + reduce-aware tail"
    return ranks, variant


def zbv(*, num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: float | None = None) -> Schedule:
    """ZB-V: near-zero bubble at 1F1B's peak activation memory (default limit ``R``).

    Memory in units of ``costs.mem_b`` (one chunk's ``M_B``); ``R`` is 1F1B's peak for the same
    model (:func:`one_f_one_b_memory`, ``2p`` chunk units for uniform chunks). See
    :func:`v_schedule` for the arguments.
    """
    return v_schedule(num_ranks=num_ranks, num_microbatches=num_microbatches, costs=costs,
                      memory_limit=memory_limit, name="zbv", default_fraction=float)


def v_half(*, num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: float | None = None) -> Schedule:
    """V-Half: about half of 1F1B's activation memory (default limit ``(p/2 + 1) / p * R``).

    Memory in units of ``costs.mem_b`` (one chunk's ``M_B``); see :func:`v_schedule`.
    """
    return v_schedule(num_ranks=num_ranks, num_microbatches=num_microbatches, costs=costs,
                      memory_limit=memory_limit, name="v-half", default_fraction=lambda p: p / 2 + 1)


def v_min(*, num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: float | None = None) -> Schedule:
    """V-Min: about a third of 1F1B's activation memory (default limit ``(p/3 + 1.5) / p * R``).

    Memory in units of ``costs.mem_b`` (one chunk's ``M_B``); see :func:`v_schedule`.
    """
    return v_schedule(num_ranks=num_ranks, num_microbatches=num_microbatches, costs=costs,
                      memory_limit=memory_limit, name="v-min", default_fraction=lambda p: p / 3 + 1.5)


def v_fused(*, num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: float | None = None) -> Schedule:
    """1F1B on the V: every backward fused (``BW``), at 1F1B's peak memory by default (limit ``R``).

    For a runtime whose split backward costs more than its fused one (``costs.t_bw < t_b + t_w``,
    PyTorch's): the V placement cuts 1F1B's bubble (to half of it at best) at the same per-rank memory without
    splitting. Built as the V family's search under the fused costs (``t_b := T_BW``, ``t_w := 0``,
    ``mem_w := 0``: a ``W`` then costs and holds nothing), every ``B`` then made a ``BW`` in place
    (:func:`~..fusion.fuse_all`), timed under ``costs``. Memory in units of ``costs.mem_b``; see
    :func:`v_schedule` for the arguments.
    """
    n = V_CHUNKS_PER_RANK * check_count("num_ranks", num_ranks)
    sc = check_cost_model(costs).resolve(n)
    fused_costs = replace(costs, t_b=[sc.duration(Op.BW, s) for s in range(n)], t_w=0.0, mem_w=0.0, t_bw=None)
    split = v_schedule(num_ranks=num_ranks, num_microbatches=num_microbatches, costs=fused_costs,  # 1. search
                       memory_limit=memory_limit, name="1f1b-v", default_fraction=float)
    sched = fuse_all(split)                                                                         # 2. fuse
    res = simulate(sched, costs.with_limit(split.meta["memory_limit"]))                            # 3. time
    return make_schedule(num_microbatches=sched.num_microbatches, stage_to_rank=sched.stage_to_rank,
                         ranks=sched.ranks, name="1f1b-v", memory_limit=split.meta["memory_limit"],
                         variant=split.meta.get("variant", ""), makespan=res.makespan)


# ---------------------------------------------------------------------------- registration
def _v_builder(fn: Callable[..., Schedule]) -> Callable[..., Schedule]:
    def build(*, num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: float | None,
              num_chunks: int) -> Schedule:
        check_count("num_ranks", num_ranks)
        check_count("num_microbatches", num_microbatches)
        check_cost_model(costs)
        check_v_chunks(num_chunks)
        return fn(num_ranks=num_ranks, num_microbatches=num_microbatches, costs=costs, memory_limit=memory_limit)
    return build


_SPECS = (  # name, description, generator, --zero-bubble-v-schedule-mem-setup value, a PyTorch ``auto`` candidate
    ("zbv", "ZB-V: V placement, near-zero bubble at 1F1B's peak memory (p full stages)", zbv, "zb", True),
    ("v-half", "V-Half: V placement, about 1/2 of 1F1B's activation memory", v_half, "half", False),
    ("v-min", "V-Min: V placement, about 1/3 of 1F1B's activation memory", v_min, "min", False),
)
for _name, _description, _fn, _mem_setup, _auto in _SPECS:
    register(_name, _description, placement=Placement.V, split_backward=True, cost_aware=True, v_mem_setup=_mem_setup,
             torch_auto_candidate=_auto)(_v_builder(_fn))
register("1f1b-v", "1F1B on the V placement, fused backward (no B/W split): less bubble than 1F1B at its peak memory",
         placement=Placement.V, split_backward=False, cost_aware=True, torch_auto_candidate=True)(_v_builder(v_fused))

"""Automatic zero-bubble schedules: a greedy, memory-aware list scheduler (ZB paper, Sec. 3.2).

:func:`zb_greedy` builds a schedule for the plain placement (stage ``s`` on rank ``s``) under a
per-rank activation-memory limit. It runs an event-driven list scheduler with several settings of
its knobs, scores every result by the simulator's makespan and keeps the best one.

The list scheduler (:func:`run_variant`)
---------------------------------
Time advances event by event: the rank that can start something earliest decides next, so each
decision sees the exact finish time of everything that could enable it (an ``F`` or ``B`` not yet
placed takes positive time, so it cannot finish by the current instant). At its turn a rank
chooses among its next ``F`` (microbatch order), its next ``B`` and its oldest pending ``W``:

* ``F`` is allowed while the rank holds fewer than ``cap[r]`` forwards in flight (the warm-up
  count of the paper) and the memory limit -- after running pending ``W`` to free memory -- leaves
  room for it and for what its ``B`` will allocate (``max(0, mem_w - mem_b)``, zero unless ``B``
  allocates); optionally also only while fewer than ``ahead`` of its F's wait on the next rank;
* ``B`` that allocates (``mem_w > mem_b``) first runs pending ``W`` while it would not fit;
* when ``F`` and ``B`` are both ready, ``B`` (critical path) or ``F`` (feeds the next rank) goes
  first, a knob;
* ``W`` is deferred: it fills idle gaps it fits in exactly (placed afterwards, once the start of
  the next ``F``/``B`` is known, so it delays nothing), runs when the memory limit blocks an ``F``,
  may overrun a gap shorter than ``T_W`` (never / half of ``T_W`` / any gap / "balance": when the
  gap would make this rank the most idle one so far, the paper's rule), or runs right after its
  ``B`` ("eager"); leftovers run at the end.

It never stalls: a rank with no forward in flight can always run its next ``F`` once the previous
rank has (all its ``W`` can run, leaving ``0 + max(mem_b, mem_w) <= limit``), a ``B`` always fits
once the rank's ``W`` have run (the ``F`` admitted last reserved its allocation with at least as
many forwards in flight), and the last rank runs ``B`` right after its own ``F``, so backwards
always come back (an ``ahead`` limit holds an ``F`` back only while the next rank has forwards of
its own to run).

Search (:func:`_search`)
------------------------
Warm-up counts ``cap[r]``: ``fit`` (as many F's as fit between the rank's first ``F`` and the
earliest possible arrival of its first ``B``), ``fit+`` (one more, overlapping that arrival),
``mem`` (as many as the memory limit allows), 1F1B's ``p - r`` and ``2 (p - r) - 1``, all clipped to
the memory limit. Crossed with the ``B``/``F`` preference, the four ``W`` gap policies, eager ``W``
and ``ahead`` in {any, 2}, that is up to 85 variants; when ``3 p m`` steps times that exceeds a
budget only the usual winners run (13, or for large problems the first few of 6). Plain 1F1B
(``B`` immediately followed by ``W``: it times and holds memory exactly like fused ``BW``) is
always a candidate when it fits the limit, so the result is never slower than 1F1B.

The scheduler places every action through the timing kernel (:class:`~..timing.Timeline`, the
simulator's own rules), so each candidate's makespan is the simulator's by construction; the winner
is simulated once more (validation, memory limit, deadlock) for its :class:`~..simulator.SimResult`.

Objective: ``SimResult.makespan``, the longest per-rank span from its first start to its last end
(the paper's "cost"), then the time to the last end overall. With ``costs.dp_reduce`` (the
data-parallel reduce, see :mod:`~..timing`) a rank's end is the end of its reduce when that is
later, so the search keeps the variant whose iteration *with* the exposed reduce is shortest (a
reduce-aware choice of the tail: e.g. deferring another rank's W's so that the stage with the
largest reduce finishes its last W earlier).

Units: times (``t_f``, ``t_b``, ``t_w``, ``t_comm``) in any one unit; memory (``mem_b``,
``mem_w``, ``memory_limit``) in any one unit. See :class:`~megatron_zb.schedules.costs.CostModel`.
"""

from __future__ import annotations

import gc
import heapq
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

from ..catalog import register
from ..costs import CostModel, StageCosts
from ..ir import Placement, Schedule, ScheduleError, plain_placement
from ..limits import check_minimum, count_that_fit, fits, resolve_limit, slack_ceiling
from ..simulator import SimResult, simulate
from ..timing import B_CODE, F_CODE, W_CODE, Code, Timeline, decode, encode
from .baselines import one_f_one_b_order
from .common import check_cost_model, check_count, first_b_caps

__all__ = ["DEFAULT_LIMIT_IN_P", "Variant", "min_memory_limit", "run_variant", "to_schedule", "variants", "zb_greedy"]

DEFAULT_LIMIT_IN_P = {"zb": 1.0, "zb-1p": 1.0, "zb-2p": 2.0}
"""Each registered name's default limit, in units of ``p * max(mem_b)`` (``zb``: 1F1B's peak);
:func:`zb_greedy` called directly defaults to ``zb-2p``'s."""


def min_memory_limit(*, num_ranks: int, costs: CostModel | StageCosts) -> float:
    """Smallest per-rank memory limit any plain-placement schedule can meet: ``max_s max(mem_b[s], mem_w[s])``.

    Every rank runs an ``F`` and holds its ``mem_b`` until the matching ``B``, then ``mem_w`` until
    the ``W``, so no limit below either works; running ``F, B, W`` one microbatch at a time on every
    rank peaks at exactly that (:meth:`~..costs.StageCosts.microbatch_peak`; ``max(mem_b)`` when no
    ``B`` allocates). Same unit as ``mem_b``.
    """
    sc = costs.resolve(num_ranks) if isinstance(costs, CostModel) else costs
    return max(sc.microbatch_peak([s]) for s in range(num_ranks))


# ---------------------------------------------------------------------------- the list scheduler
@dataclass(frozen=True)
class Variant:
    name: str
    caps: tuple[int, ...]           # max forwards in flight (F done, B not yet) per rank
    prefer_f: bool = False          # when F and B are both ready, run F first
    w_gap: float = 1.0              # W may fill an idle gap >= w_gap * T_W (1.0: only exact fits)
    eager_w: bool = False           # run W right after its B (no deferral beyond memory needs)
    ahead: int = 0                  # if > 0: F only while fewer than `ahead` F's wait on the next rank
    balance: bool = False           # W may overrun a short gap that would make this rank the most idle


def run_variant(sc: StageCosts, m: int, limit: float, v: Variant) -> tuple[list[list[Code]], float, float]:
    """One greedy pass: the per-rank orders (:data:`~..timing.Code`) and their ``(makespan, total_time)``
    (longest per-rank span; last end overall), the simulator's times (every action is placed through
    the timing kernel). Longer than a screen: the event loop shares its state with four closures."""
    p = len(sc.t_f)
    tl = Timeline(plain_placement(p), m, sc)
    ready_f, ready_b, ready_w = tl.ready_of[F_CODE], tl.ready_of[B_CODE], tl.ready_of[W_CODE]
    run, free, mem = tl.run, tl.clock, tl.mem
    d_f, d_b, d_w, tw = tl.delta[F_CODE], tl.delta[B_CODE], tl.delta[W_CODE], tl.duration[W_CODE]
    extra = [sc.backward_alloc(s) for s in range(p)]          # what a B allocates (0.0: B frees)
    need_f = [d + e for d, e in zip(d_f, extra)]              # an F and, later, its B
    lim = slack_ceiling(limit)
    inf = math.inf
    caps, prefer_f, w_gap, eager_w, balance = v.caps, v.prefer_f, v.w_gap, v.eager_w, v.balance
    ahead = v.ahead if v.ahead > 0 else m + 1
    last = p - 1

    nf, nb, nw = [0] * p, [0] * p, [0] * p
    order: list[list[Code]] = [[] for _ in range(p)]
    bubble = [0.0] * p      # idle time since the rank's first op (for the "balance" W policy)
    max_bubble = 0.0

    def f_fits(r: int) -> bool:
        """F (and what its B will allocate) fits now, or once pending W's ran (the simulator's float sums)."""
        cur, need = mem[r], need_f[r]
        if cur + need <= lim:
            return True
        k, d = nb[r] - nw[r], d_w[r]
        if k == 0 or d == 0.0 or cur + k * d + need > lim + 1e-9 * (abs(lim) + abs(cur)):
            return False   # quick reject; the margin covers k * d against k additions (float), no more
        while cur + need > lim and k:
            cur += d
            k -= 1
        return cur + need <= lim

    def ready(r: int) -> tuple[float, float]:
        """Earliest start of rank r's next F and next B as far as already placed ops tell (inf: not yet)."""
        i, j = nf[r], nb[r]
        t_f = inf
        if i < m and i - j < caps[r] and (r == last or i - nf[r + 1] < ahead) and f_fits(r):
            t_f = ready_f[r](i)
        return t_f, (ready_b[r](j) if j < i else inf)

    def put_w(r: int) -> None:
        i = nw[r]
        order[r].append((W_CODE, i, r))
        run(r, W_CODE, i, r, ready_w[r](i))
        nw[r] = i + 1

    # A rank's ready times change only through events that replan it (its own step, an F of the
    # previous rank, a B of the next one, an F of the next one under an `ahead` limit), so the
    # times computed when it was last (re)planned are current when its heap entry comes up.
    stamp = [0] * p
    ready_now = [(inf, inf)] * p
    heap: list[tuple[float, int, int]] = []
    push, pop = heapq.heappush, heapq.heappop

    def replan(r: int) -> None:
        stamp[r] += 1
        t_f, t_b = ready_now[r] = ready(r)
        t = t_f if t_f < t_b else t_b
        if t == inf:
            if nb[r] == m and nw[r] < m:
                push(heap, (free[r], r, stamp[r]))
        else:
            push(heap, (t if t > free[r] else free[r], r, stamp[r]))

    replan(0)                                  # only rank 0 can start at first
    while heap:
        t, r, st = pop(heap)
        if st != stamp[r]:
            continue
        t_f, t_b = ready_now[r]
        if t_b <= t and (t_f > t or not prefer_f):
            op, rd = B_CODE, t_b
        elif t_f <= t:
            op, rd = F_CODE, t_f
        else:                                  # all B's done: flush the remaining W's
            put_w(r)
            replan(r)
            continue
        if op == F_CODE:
            while mem[r] + need_f[r] > lim and nw[r] < nb[r]:   # W's the memory limit forces
                put_w(r)
        elif extra[r] > 0:
            while mem[r] + d_b[r] > lim and nw[r] < nb[r]:      # an allocating B: the same
                put_w(r)
        while nw[r] < nb[r] and free[r] + tw[r] <= rd:     # W's that fit the idle gap exactly
            put_w(r)
        fr = free[r]
        if nw[r] < nb[r] and fr < rd and (rd - fr >= w_gap * tw[r] or (
                balance and nf[r] and bubble[r] + rd - fr > max_bubble)):
            put_w(r)                           # a W that overruns a short gap
            fr = free[r]
        had_f = nf[r] > 0
        i = nf[r] if op == F_CODE else nb[r]
        order[r].append((op, i, r))
        start = run(r, op, i, r, rd)
        if had_f:
            bubble[r] += start - fr
            if bubble[r] > max_bubble:
                max_bubble = bubble[r]
        if op == F_CODE:
            nf[r] = i + 1
            if r < last:
                replan(r + 1)
            if r > 0 and ahead <= m:
                replan(r - 1)
        else:
            nb[r] = i + 1
            if eager_w:
                put_w(r)
            if r > 0:
                replan(r - 1)
        replan(r)

    _check_finished(nf, nb, nw, m)
    return order, tl.makespan(), tl.total_time()


def _check_finished(nf: list[int], nb: list[int], nw: list[int], m: int) -> None:
    """Every rank ran its ``m`` W's (cannot fail: some rank can always progress, see the module docstring)."""
    for r, w in enumerate(nw):
        if w != m:
            raise RuntimeError(f"greedy scheduler stalled on rank {r} (F {nf[r]}, B {nb[r]}, W {w} of {m})")


# ---------------------------------------------------------------------------- candidates
_PRIORITY: tuple[tuple[str, bool, str, int], ...] = (
    # (warm-up counts, F first?, W policy, ahead) -- in the order they most often win on a mixed
    # benchmark (paper costs at p = 8..32 and random uneven / heavy-communication / large-W cases)
    ("fit", True, "balance", 0), ("mem", False, "any", 0), ("fit+", True, "balance", 0),
    ("mem", False, "balance", 0), ("1f1b", True, "half", 0), ("mem", True, "balance", 0),
    ("fit+", False, "any", 0), ("fit", True, "any", 0), ("mem", False, "half", 0), ("2x", False, "half", 0),
    ("mem", True, "half", 2), ("fit", True, "balance", 2), ("1f1b", False, "half", 0),
)
_LARGE: tuple[tuple[str, bool, str, int], ...] = (
    # the usual winners when m >= 4p and p >= 16 (where the steady state dominates)
    ("fit", True, "balance", 0), ("mem", False, "any", 0), ("1f1b", False, "half", 0),
    ("fit+", False, "balance", 0), ("1f1b", True, "any", 0), ("fit", True, "any", 0),
)
_POLICIES = {"balance": (1.0, True), "any": (0.0, False), "half": (0.5, False), "exact": (1.0, False)}


def _variant_name(cname: str, prefer_f: bool, pol: str, ahead: int) -> str:
    return f"{cname}/{'F' if prefer_f else 'B'}-first/W-{pol}/ahead-{ahead or 'any'}"


def _all_specs() -> list[tuple[str, bool, str, int]]:
    return list(_PRIORITY) + list(_LARGE) + [
        (c, pf, pol, ah) for c in ("fit", "fit+", "mem", "1f1b", "2x") for pf in (False, True)
        for pol in _POLICIES for ah in (0, 2)]


def variants(sc: StageCosts, m: int, limit: float,
              specs: list[tuple[str, bool, str, int]] | None = None) -> list[Variant]:
    """The variants of ``specs`` (default: every knob combination, usual winners first), deduplicated.

    Warm-up count families: ``fit`` = as many F's as fit before the first B can arrive, ``fit+`` =
    one more (it overlaps that arrival), ``mem`` = as many as memory allows, ``1f1b`` = ``p - r``,
    ``2x`` = ``2 (p - r) - 1``; all clipped to what the memory limit allows and to ``m``.
    """
    p = len(sc.t_f)
    mem_caps = [m if b == 0 or not math.isfinite(limit)
                else max(1, min(m, count_that_fit(limit - sc.backward_alloc(s), b))) for s, b in enumerate(sc.mem_b)]

    def clamp(caps: tuple[int, ...] | list[int]) -> tuple[int, ...]:
        return tuple(max(1, min(k, mc)) for k, mc in zip(caps, mem_caps))

    cap_sets = {
        "fit": clamp(first_b_caps(plain_placement(p), sc, m, rounding="floor")),
        "fit+": clamp(first_b_caps(plain_placement(p), sc, m, rounding="ceil")),
        "mem": tuple(mem_caps),
        "1f1b": clamp([p - r for r in range(p)]),
        "2x": clamp([2 * (p - r) - 1 for r in range(p)]),
    }
    full = specs is None
    out: list[Variant] = []
    seen: set[tuple] = set()
    for cname, prefer_f, pol, ahead in (_all_specs() if specs is None else specs):
        w_gap, bal = _POLICIES[pol]
        v = Variant(_variant_name(cname, prefer_f, pol, ahead), cap_sets[cname], prefer_f, w_gap,
                     False, ahead, bal)
        key = (v.caps, v.prefer_f, v.w_gap, v.eager_w, v.ahead if v.ahead < m else 0, v.balance)
        if key not in seen:
            seen.add(key)
            out.append(v)
    if full:
        for cname, caps in cap_sets.items():
            key = (caps, False, 1.0, True, 0, False)
            if key not in seen:
                seen.add(key)
                out.append(Variant(f"{cname}/eager-W", caps, False, 1.0, True))
    return out


def _one_f_one_b(p: int, m: int) -> list[list[Code]]:
    """Plain 1F1B with the backward split as ``B`` immediately followed by ``W``."""
    ranks = one_f_one_b_order(p, m, warmup=[p - r for r in range(p)], delay=[0] * p)
    return [[encode(a) for a in row] for row in ranks]


def to_schedule(m: int, order: list[list[Code]], variant: str) -> Schedule:
    ranks = [[decode(code) for code in seq] for seq in order]
    return Schedule(m, plain_placement(len(order)), ranks, "zb-greedy", {"variant": variant})


# ---------------------------------------------------------------------------- entry point
def zb_greedy(
    *, num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: float | None = None,
    stage_to_rank: list[int] | None = None,
) -> Schedule:
    """Automatic zero-bubble schedule for the plain placement under a per-rank memory limit.

    Args:
        num_ranks: pipeline ranks ``p`` (>= 1); one stage per rank.
        num_microbatches: microbatches per iteration ``m`` (>= 1).
        costs: per-stage times ``t_f``, ``t_b``, ``t_w``, ``t_comm`` (any one time unit) and
            activation memory ``mem_b``, ``mem_w`` (any one memory unit; ``mem_w`` defaults to
            ``mem_b / 2``).
        memory_limit: peak activation memory allowed on each rank, in the unit of ``mem_b``
            (resolved by :func:`~..limits.resolve_limit`): ``None`` uses ``costs.memory_limit``, and
            if that is ``None`` too, ``2 * p * max(mem_b)`` (ZB-2p; the registered ``zb`` and
            ``zb-1p`` names default to ``p * max(mem_b)``, see :data:`DEFAULT_LIMIT_IN_P`; a default
            is raised to the minimum below); no activation memory at all means no limit. It must
            be at least :func:`min_memory_limit` (one microbatch held from its ``F`` to its ``B``,
            and from its ``B`` to its ``W``), the smallest limit any schedule can meet.
        stage_to_rank: must be ``None`` or the plain placement ``[0, 1, ..., p-1]``.

    Returns:
        A validated :class:`Schedule` (``B``/``W`` split) whose simulated peak memory is within the
        limit on every rank; ``meta`` holds the limit, the winning variant and the simulated makespan.

    Raises:
        ScheduleError: bad sizes or costs, a non-plain placement, or a limit below the minimum.
    """
    p = check_count("num_ranks", num_ranks)
    m = check_count("num_microbatches", num_microbatches)
    if stage_to_rank is not None and list(stage_to_rank) != plain_placement(p):
        raise ScheduleError(f"zb_greedy supports only the plain placement {plain_placement(p)} "
                            f"(one stage per rank), got {list(stage_to_rank)}")
    base = check_cost_model(costs).resolve(p)           # validates the per-stage values
    need = min_memory_limit(num_ranks=p, costs=base)
    limit = resolve_limit(memory_limit, costs, DEFAULT_LIMIT_IN_P["zb-2p"] * p * max(base.mem_b), minimum=need)
    sc = costs.with_limit(limit).resolve(p)
    worst = max(range(p), key=lambda s: sc.microbatch_peak([s]))
    what = ("activations (mem_b = {:g}) from its F until its B" if sc.mem_w[worst] <= sc.mem_b[worst] else
            "weight-gradient tensors (mem_w = {:g}, more than mem_b: B allocates) from its B until its W")
    check_minimum(limit, need, f"rank {worst} must hold one microbatch's {what.format(need)}, so no schedule fits")

    sched, res = _search(sc, m, limit)
    sched.meta.update(memory_limit=limit, makespan=res.makespan, total_time=res.total_time,
                      bubble_rate=res.bubble_rate, peak_memory=max(res.peak_memory))
    return sched


# ---------------------------------------------------------------------------- search
_BUDGET = 160_000
"""Scheduling steps (one per placed op; one pass costs ``3 p m``) to spend on variants: all of them
if they fit, else the :data:`_PRIORITY` ones, else as many of :data:`_LARGE` as fit (at least two)."""


@contextmanager
def _gc_paused():
    """Building tens of thousands of small objects (actions, orders) triggers full GC passes over the
    (large) heap; none of them forms a reference cycle."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _search(sc: StageCosts, m: int, limit: float) -> tuple[Schedule, SimResult]:
    """Run the variants and 1F1B; return the best schedule (``meta["variant"]`` names it) and its
    simulation."""
    p = len(sc.t_f)
    steps = 3 * p * m
    tried = variants(sc, m, limit)
    if steps * len(tried) > _BUDGET:
        tried = variants(sc, m, limit, list(_PRIORITY))
        if steps * len(tried) > _BUDGET:
            tried = variants(sc, m, limit, list(_LARGE))[:max(2, _BUDGET // steps)]
    with _gc_paused():
        cands: list[tuple[tuple[float, float], int, str, list[list[Code]]]] = []
        for v in tried:
            order, makespan, total = run_variant(sc, m, limit, v)
            cands.append(((makespan, total), len(cands), v.name, order))
        if all(fits(min(p - r, m) * sc.mem_b[r] + sc.backward_alloc(r), limit) for r in range(p)):
            order = _one_f_one_b(p, m)
            tl = Timeline(plain_placement(p), m, sc)
            tl.play(order)
            cands.append(((tl.makespan(), tl.total_time()), len(cands), "1f1b", order))
        # the lowest (makespan, total time), then the earliest: equal orders score equally, so the
        # first of several equal candidates wins, as the variant names in meta say
        _, _, name, order = min(cands)
        sched = to_schedule(m, order, name)
        return sched, simulate(sched, sc)  # validates, enforces the memory limit, detects deadlock


# ---------------------------------------------------------------------------- registration
def _greedy_builder(limit_in_p: float) -> Callable[..., Schedule]:
    """A registered builder whose default limit is ``limit_in_p * p * max(mem_b)``."""
    def build(*, num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: float | None,
              num_chunks: int) -> Schedule:
        p = check_count("num_ranks", num_ranks)
        sc = check_cost_model(costs).resolve(p)
        limit = resolve_limit(memory_limit, costs, limit_in_p * p * max(sc.mem_b),
                              minimum=min_memory_limit(num_ranks=p, costs=sc))
        return zb_greedy(num_ranks=p, num_microbatches=num_microbatches, costs=costs, memory_limit=limit)
    return build


_SPECS = (  # name, description, one of the PyTorch export's ``auto`` candidates
    ("zb", "greedy zero-bubble scheduler under --memory-limit (default p*M_B, as 1F1B)", False),
    ("zb-1p", "greedy zero-bubble scheduler with memory limit p*M_B (ZB-1p)", True),
    ("zb-2p", "greedy zero-bubble scheduler with memory limit 2p*M_B (ZB-2p)", False),
)
for _name, _description, _auto in _SPECS:
    register(_name, _description, placement=Placement.PLAIN, split_backward=True,
             cost_aware=True, torch_auto_candidate=_auto)(_greedy_builder(DEFAULT_LIMIT_IN_P[_name]))

"""Automatic zero-bubble schedules: a greedy, memory-aware list scheduler (ZB paper, Sec. 3.2).

:func:`zb_greedy` builds a schedule for the plain placement (stage ``s`` on rank ``s``) under a
per-rank activation-memory limit. It runs an event-driven list scheduler with several settings of
its knobs, scores every result by the simulator's makespan and keeps the best one.

The list scheduler (:func:`_run`)
---------------------------------
Time advances event by event: the rank that can start something earliest decides next, so each
decision sees the exact finish time of everything that could enable it (an ``F`` or ``B`` not yet
placed takes positive time, so it cannot finish by the current instant). At its turn a rank
chooses among its next ``F`` (microbatch order), its next ``B`` and its oldest pending ``W``:

* ``F`` is allowed while the rank holds fewer than ``cap[r]`` forwards in flight (the warm-up
  count of the paper) and the memory limit -- after running pending ``W`` to free memory -- leaves
  room for it; optionally also only while fewer than ``ahead`` of its F's wait on the next rank;
* when ``F`` and ``B`` are both ready, ``B`` (critical path) or ``F`` (feeds the next rank) goes
  first, a knob;
* ``W`` is deferred: it fills idle gaps it fits in exactly (placed afterwards, once the start of
  the next ``F``/``B`` is known, so it delays nothing), runs when the memory limit blocks an ``F``,
  may overrun a gap shorter than ``T_W`` (never / half of ``T_W`` / any gap / "balance": when the
  gap would make this rank the most idle one so far, the paper's rule), or runs right after its
  ``B`` ("eager"); leftovers run at the end.

It never stalls: a rank with no forward in flight can always run its next ``F`` once the previous
rank has (all its ``W`` can run, leaving ``0 + mem_b <= limit``), and the last rank runs ``B``
right after its own ``F``, so backwards always come back (an ``ahead`` limit holds an ``F`` back
only while the next rank has forwards of its own to run).

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

The scheduler computes each candidate's times with the simulator's rules and the same float
operations. Small problems are scored by :func:`~megatron_zb.schedules.simulator.simulate` on every
distinct candidate; larger ones by those exact times, and the winner is always simulated
(validation, memory limit, deadlock) -- should the two ever disagree, every candidate is simulated.

Objective: ``SimResult.makespan``, the longest per-rank span from its first start to its last end
(the paper's "cost"), then the time to the last end overall.

Units: times (``t_f``, ``t_b``, ``t_w``, ``t_comm``) in any one unit; memory (``mem_b``,
``mem_w``, ``memory_limit``) in any one unit. See :class:`~megatron_zb.schedules.costs.CostModel`.
"""

from __future__ import annotations

import gc
import heapq
import math
import operator
from contextlib import contextmanager
from dataclasses import dataclass

from .costs import CostModel, StageCosts
from .ir import Action, Schedule, ScheduleError, plain_placement
from .simulator import SimResult, simulate

__all__ = ["min_memory_limit", "zb_greedy"]

_REL_TOL = 1e-12
"""Relative slack when comparing accumulated memory with the limit (float summation noise)."""


def min_memory_limit(*, num_ranks: int, costs: CostModel | StageCosts) -> float:
    """Smallest per-rank memory limit any plain-placement schedule can meet: ``max_s mem_b[s]``.

    Every rank runs an ``F`` and holds its ``mem_b`` until the matching ``B``, so no limit below
    ``mem_b`` of its stage works; running ``F, B, W`` one microbatch at a time on every rank peaks at
    exactly ``mem_b``. Same unit as ``mem_b``.
    """
    sc = costs.resolve(num_ranks) if isinstance(costs, CostModel) else costs
    return max(sc.mem_b)


# ---------------------------------------------------------------------------- the list scheduler
@dataclass(frozen=True)
class _Variant:
    name: str
    caps: tuple[int, ...]           # max forwards in flight (F done, B not yet) per rank
    prefer_f: bool = False          # when F and B are both ready, run F first
    w_gap: float = 1.0              # W may fill an idle gap >= w_gap * T_W (1.0: only exact fits)
    eager_w: bool = False           # run W right after its B (no deferral beyond memory needs)
    ahead: int = 0                  # if > 0: F only while fewer than `ahead` F's wait on the next rank
    balance: bool = False           # W may overrun a short gap that would make this rank the most idle


_F, _B, _W = 0, 1, 2
"""Op codes of the compact orders the scheduler works on: ``code = 3 * microbatch + op``."""


def _run(sc: StageCosts, m: int, limit: float, v: _Variant) -> tuple[list[list[int]], float, float]:
    """One greedy pass.

    Returns the per-rank compact orders (``3 * mb + op``) and the ``(makespan, total_time)`` they
    simulate to: the longest per-rank span (first start to last end) and the last end overall.
    The times are computed with the simulator's rules and float operations, so they are exact.
    """
    p = len(sc.t_f)
    tf, tb, tw, c = sc.t_f, sc.t_b, sc.t_w, sc.t_comm
    d_f = sc.mem_b
    d_b = [sc.mem_w[s] - sc.mem_b[s] for s in range(p)]
    d_w = [-sc.mem_w[s] for s in range(p)]
    lim = limit + _REL_TOL * limit if math.isfinite(limit) else math.inf
    inf = math.inf
    caps, prefer_f, w_gap, eager_w, balance = v.caps, v.prefer_f, v.w_gap, v.eager_w, v.balance
    ahead = v.ahead if v.ahead > 0 else m + 1
    last = p - 1

    fend = [[inf] * m for _ in range(p)]
    bend = [[inf] * m for _ in range(p)]
    nf, nb, nw = [0] * p, [0] * p, [0] * p
    free = [0.0] * p
    first = [0.0] * p
    mem = [0.0] * p
    order: list[list[int]] = [[] for _ in range(p)]
    bubble = [0.0] * p      # idle time since the rank's first op (for the "balance" W policy)
    max_bubble = 0.0

    def f_fits(r: int) -> bool:
        """F fits in memory now, or once pending W's have run (same float sums as the simulator)."""
        cur, need = mem[r], d_f[r]
        if cur + need <= lim:
            return True
        k, d = nb[r] - nw[r], d_w[r]
        if k == 0 or d == 0.0 or cur + k * d + need > lim + 1e-9 * (abs(lim) + abs(cur)):
            return False
        while cur + need > lim and k:
            cur += d
            k -= 1
        return cur + need <= lim

    def ready(r: int) -> tuple[float, float]:
        """Earliest start of rank r's next F and next B as far as already placed ops tell (inf: not yet)."""
        i, j = nf[r], nb[r]
        t_f = inf
        if i < m and i - j < caps[r] and (r == last or i - nf[r + 1] < ahead) and f_fits(r):
            if r == 0:
                t_f = 0.0
            else:
                e = fend[r - 1][i]
                if e < inf:
                    t_f = e + c
        t_b = inf
        if j < i:
            if r == last:
                t_b = fend[r][j]
            else:
                e = bend[r + 1][j]
                if e < inf:
                    e += c
                    fe = fend[r][j]
                    t_b = fe if fe > e else e
        return t_f, t_b

    def when(r: int) -> float:
        t_f, t_b = ready(r)
        t = t_f if t_f < t_b else t_b
        if t == inf:
            return free[r] if nb[r] == m and nw[r] < m else inf
        return t if t > free[r] else free[r]

    def put_w(r: int) -> None:
        order[r].append(3 * nw[r] + _W)
        nw[r] += 1
        free[r] += tw[r]
        mem[r] += d_w[r]

    stamp = [0] * p
    heap = [(0.0, 0, 0)]                      # only rank 0 can start at first
    push, pop = heapq.heappush, heapq.heappop

    def replan(r: int) -> None:
        stamp[r] += 1
        t = when(r)
        if t < inf:
            push(heap, (t, r, stamp[r]))

    while heap:
        t, r, st = pop(heap)
        if st != stamp[r]:
            continue
        t_f, t_b = ready(r)
        if t_b <= t and (t_f > t or not prefer_f):
            op, rd = _B, t_b
        elif t_f <= t:
            op, rd = _F, t_f
        else:                                  # all B's done: flush the remaining W's
            put_w(r)
            replan(r)
            continue
        if op == _F:
            while mem[r] + d_f[r] > lim and nw[r] < nb[r]:   # W's the memory limit forces
                put_w(r)
        while nw[r] < nb[r] and free[r] + tw[r] <= rd:     # W's that fit the idle gap exactly
            put_w(r)
        fr = free[r]
        if nw[r] < nb[r] and fr < rd and (rd - fr >= w_gap * tw[r] or (
                balance and nf[r] and bubble[r] + rd - fr > max_bubble)):
            put_w(r)                           # a W that overruns a short gap
            fr = free[r]
        start = rd if rd > fr else fr
        if nf[r]:
            bubble[r] += start - fr
            if bubble[r] > max_bubble:
                max_bubble = bubble[r]
        else:
            first[r] = start
        if op == _F:
            i = nf[r]
            end = start + tf[r]
            order[r].append(3 * i + _F)
            fend[r][i] = end
            free[r] = end
            nf[r] = i + 1
            mem[r] += d_f[r]
            if r < last:
                replan(r + 1)
            if r > 0 and ahead <= m:
                replan(r - 1)
        else:
            j = nb[r]
            end = start + tb[r]
            order[r].append(3 * j + _B)
            bend[r][j] = end
            free[r] = end
            nb[r] = j + 1
            mem[r] += d_b[r]
            if eager_w:
                put_w(r)
            if r > 0:
                replan(r - 1)
        replan(r)

    for r in range(p):
        if nw[r] != m:   # cannot happen: some rank can always progress (see module docstring)
            raise RuntimeError(f"greedy scheduler stalled on rank {r} "
                               f"(F {nf[r]}, B {nb[r]}, W {nw[r]} of {m})")
    return order, max(free[r] - first[r] for r in range(p)), max(free)


def _asap(sc: StageCosts, m: int, order: list[list[int]]) -> tuple[float, float]:
    """``(makespan, total_time)`` of a compact order under the simulator's rules (plain placement)."""
    p = len(order)
    tf, tb, tw, c = sc.t_f, sc.t_b, sc.t_w, sc.t_comm
    inf = math.inf
    fend = [[inf] * m for _ in range(p)]
    bend = [[inf] * m for _ in range(p)]
    ptr, clock, first = [0] * p, [0.0] * p, [0.0] * p
    remaining = sum(len(o) for o in order)
    while remaining:
        progressed = False
        for r in range(p):
            seq, i, clk = order[r], ptr[r], clock[r]
            while i < len(seq):
                code = seq[i]
                mbi, op = divmod(code, 3)
                if op == _F:
                    rd = clk
                    if r > 0:
                        e = fend[r - 1][mbi]
                        if e == inf:
                            break
                        e += c
                        rd = e if e > clk else clk
                    end = rd + tf[r]
                    fend[r][mbi] = end
                elif op == _B:
                    e = fend[r][mbi]
                    if e == inf:
                        break
                    rd = e if e > clk else clk
                    if r < p - 1:
                        e = bend[r + 1][mbi]
                        if e == inf:
                            break
                        e += c
                        rd = e if e > rd else rd
                    end = rd + tb[r]
                    bend[r][mbi] = end
                else:
                    e = bend[r][mbi]
                    if e == inf:
                        break
                    rd = e if e > clk else clk
                    end = rd + tw[r]
                if i == 0:
                    first[r] = rd
                clk = end
                i += 1
            if i != ptr[r]:
                remaining -= i - ptr[r]
                ptr[r], clock[r] = i, clk
                progressed = True
        if not progressed:
            raise RuntimeError("compact order deadlocks")
    return max(clock[r] - first[r] for r in range(p)), max(clock)


# ---------------------------------------------------------------------------- candidates
def _first_b_caps(sc: StageCosts, m: int, *, overlap: bool) -> list[int]:
    """Per rank, how many F's fit between its first F and the earliest arrival of its first B."""
    p = len(sc.t_f)
    c = sc.t_comm
    caps = []
    for r in range(p):
        # first F on r starts at S; F(0) reaches the last stage, B(0) comes back to r
        span = sc.t_f[r]
        for s in range(r + 1, p):
            span += c + sc.t_f[s]
        span += sc.t_b[p - 1] if r < p - 1 else 0.0
        for s in range(r + 1, p - 1):
            span += c + sc.t_b[s]
        if r < p - 1:
            span += c
        n = span / sc.t_f[r]
        k = math.ceil(n - 1e-9) if overlap else math.floor(n + 1e-9)
        caps.append(max(1, min(m, k)))
    return caps


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


def _variants(sc: StageCosts, m: int, limit: float,
              specs: list[tuple[str, bool, str, int]] | None = None) -> list[_Variant]:
    """The variants of ``specs`` (default: every knob combination, usual winners first), deduplicated.

    Warm-up count families: ``fit`` = as many F's as fit before the first B can arrive, ``fit+`` =
    one more (it overlaps that arrival), ``mem`` = as many as memory allows, ``1f1b`` = ``p - r``,
    ``2x`` = ``2 (p - r) - 1``; all clipped to what the memory limit allows and to ``m``.
    """
    p = len(sc.t_f)
    mem_caps = [m if b == 0 or not math.isfinite(limit)
                else max(1, min(m, math.floor(limit * (1 + _REL_TOL) / b))) for b in sc.mem_b]

    def clamp(caps: list[int]) -> tuple[int, ...]:
        return tuple(max(1, min(k, mc)) for k, mc in zip(caps, mem_caps))

    cap_sets = {
        "fit": clamp(_first_b_caps(sc, m, overlap=False)),
        "fit+": clamp(_first_b_caps(sc, m, overlap=True)),
        "mem": tuple(mem_caps),
        "1f1b": clamp([p - r for r in range(p)]),
        "2x": clamp([2 * (p - r) - 1 for r in range(p)]),
    }
    full = specs is None
    out: list[_Variant] = []
    seen: set[tuple] = set()
    for cname, prefer_f, pol, ahead in (_all_specs() if specs is None else specs):
        w_gap, bal = _POLICIES[pol]
        v = _Variant(_variant_name(cname, prefer_f, pol, ahead), cap_sets[cname], prefer_f, w_gap,
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
                out.append(_Variant(f"{cname}/eager-W", caps, False, 1.0, True))
    return out


def _one_f_one_b(p: int, m: int) -> list[list[int]]:
    """Plain 1F1B (compact order) with the backward split as ``B`` immediately followed by ``W``."""
    order = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        seq = [3 * i + _F for i in range(warm)]
        nf = warm
        for i in range(m):
            if nf < m:
                seq.append(3 * nf + _F)
                nf += 1
            seq += [3 * i + _B, 3 * i + _W]
        order.append(seq)
    return order


def _to_schedule(m: int, order: list[list[int]], variant: str) -> Schedule:
    ops = ("F", "B", "W")
    ranks = [[Action(ops[code % 3], code // 3, r) for code in seq] for r, seq in enumerate(order)]
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
        memory_limit: peak activation memory allowed on each rank, in the unit of ``mem_b``.
            ``None`` uses ``costs.memory_limit``, and if that is ``None`` too, ``2 * p * max(mem_b)``
            (ZB-2p). ``p * M_B`` gives ZB-1p. It must be at least ``max(mem_b)`` (one microbatch held
            from its ``F`` to its ``B``), the smallest limit any schedule can meet.
        stage_to_rank: must be ``None`` or the plain placement ``[0, 1, ..., p-1]``.

    Returns:
        A validated :class:`Schedule` (``B``/``W`` split) whose simulated peak memory is within the
        limit on every rank; ``meta`` holds the limit, the winning variant and the simulated makespan.

    Raises:
        ScheduleError: bad sizes or costs, a non-plain placement, or a limit below the minimum.
    """
    p = _count("num_ranks", num_ranks)
    m = _count("num_microbatches", num_microbatches)
    if stage_to_rank is not None and list(stage_to_rank) != plain_placement(p):
        raise ScheduleError(f"zb_greedy supports only the plain placement {plain_placement(p)} "
                            f"(one stage per rank), got {list(stage_to_rank)}")
    if not isinstance(costs, CostModel):
        raise ScheduleError(f"costs must be a CostModel, got {type(costs).__name__}")
    base = costs.resolve(p)           # validates the per-stage values
    if memory_limit is None:
        memory_limit = costs.memory_limit
    if memory_limit is None:
        biggest = max(base.mem_b)
        memory_limit = 2 * p * biggest if biggest > 0 else math.inf
    try:
        limit = float(memory_limit)
    except (TypeError, ValueError):
        raise ScheduleError(f"memory_limit must be a number, got {memory_limit!r}") from None
    if math.isnan(limit) or limit <= 0:
        raise ScheduleError(f"memory_limit is {memory_limit}; it must be > 0")
    sc = costs.with_limit(limit).resolve(p)
    need = min_memory_limit(num_ranks=p, costs=sc)
    if need > limit * (1 + _REL_TOL):
        worst = max(range(p), key=lambda s: sc.mem_b[s])
        raise ScheduleError(
            f"memory_limit {limit:g} is below the minimum {need:g}: rank {worst} must hold one "
            f"microbatch's activations (mem_b = {need:g}) from its F until its B, so no schedule fits")

    sched, res = _search(sc, m, limit)
    sched.meta.update(memory_limit=limit, makespan=res.makespan, total_time=_total_time(res),
                      bubble_rate=res.bubble_rate, peak_memory=max(res.peak_memory))
    return sched


def _count(what: str, value: object) -> int:
    if isinstance(value, bool):
        raise ScheduleError(f"{what} must be an integer >= 1, got {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise ScheduleError(f"{what} must be an integer >= 1, got {value!r}") from None
    if n < 1:
        raise ScheduleError(f"{what} must be >= 1, got {n}")
    return n


def _total_time(res: SimResult) -> float:
    """Time from 0 to the last end on any rank."""
    return max((e[-1] for e in res.end if e), default=0.0)


# ---------------------------------------------------------------------------- search
_BUDGET = 160_000
"""Scheduling steps (one per placed op; one pass costs ``3 p m``) to spend on variants: all of them
if they fit, else the :data:`_PRIORITY` ones, else as many of :data:`_LARGE` as fit (at least two)."""

_SIMULATE_ALL = 60_000
"""Below this many steps in total, every distinct candidate is scored by :func:`simulate` itself."""


@contextmanager
def _gc_paused():
    """Building tens of thousands of small objects triggers full GC passes over the (large) heap."""
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
    variants = _variants(sc, m, limit)
    if steps * len(variants) > _BUDGET:
        variants = _variants(sc, m, limit, list(_PRIORITY))
        if steps * len(variants) > _BUDGET:
            variants = _variants(sc, m, limit, list(_LARGE))[:max(2, _BUDGET // steps)]
    cands: list[tuple[tuple[float, float], int, str, list[list[int]]]] = []
    seen: set[tuple[tuple[int, ...], ...]] = set()

    def add(name: str, order: list[list[int]], score: tuple[float, float]) -> None:
        key = tuple(map(tuple, order))
        if key not in seen:
            seen.add(key)
            cands.append((score, len(cands), name, order))

    for v in variants:
        order, makespan, total = _run(sc, m, limit, v)
        add(v.name, order, (makespan, total))
    if all(min(p - r, m) * sc.mem_b[r] <= limit * (1 + _REL_TOL) for r in range(p)):
        order = _one_f_one_b(p, m)
        add("1f1b", order, _asap(sc, m, order))

    with _gc_paused():
        if steps * len(cands) <= _SIMULATE_ALL:
            return _pick_by_simulation(sc, m, cands)
        score, _, name, order = min(cands)
        sched = _to_schedule(m, order, name)
        res = simulate(sched, sc)        # validates, enforces the memory limit, detects deadlock
        if _same(res.makespan, score[0]) and _same(_total_time(res), score[1]):
            return sched, res
        # The simulator disagrees with the scheduler's own timing (were its rules changed?): trust it.
        return _pick_by_simulation(sc, m, cands)


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


def _pick_by_simulation(sc: StageCosts, m: int, cands: list) -> tuple[Schedule, SimResult]:
    best = None
    for _, idx, name, order in cands:
        sched = _to_schedule(m, order, name)
        res = simulate(sched, sc)
        key = (res.makespan, _total_time(res), idx)
        if best is None or key < best[0]:
            best = (key, sched, res)
    assert best is not None
    return best[1], best[2]

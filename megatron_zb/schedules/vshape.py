"""V-shaped zero-bubble schedules: ZB-V, V-Half, V-Min, and any memory limit in between.

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
the feasible minimum ``M``:

==========  ==============================  ========================================================
name        default limit                   what it gives (unit costs, ``m >= 2p``)
==========  ==============================  ========================================================
``zbv``     ``R`` (1F1B's peak)              near-zero bubble
``v-half``  ``(p/2 + 1) / p * R``            about half of 1F1B's memory (published V-Half:
                                            ``(p+2)//2`` microbatches of 1F1B's ``p``), < 0.6x
                                            its bubble
``v-min``   ``(p/3 + 1.5) / p * R``          about a third of 1F1B's memory, bubble <= 1F1B's
==========  ==============================  ========================================================

Any explicit ``memory_limit`` from the feasible minimum ``M`` (one microbatch in flight per
rank) upwards gives a valid schedule; below it :class:`ScheduleError` states the minimum.

The algorithm: an event-driven list scheduler (:func:`_list_schedule`) whose knobs are tuned per
problem by a coordinate-descent search (:func:`search`), every candidate scored by its simulated
makespan (ties: lower peak memory); small problems (<= 200 actions) then get a local search that
moves single actions while the simulated makespan improves (:func:`improve`). The scheduler works
for any placement (:mod:`.interleaved_zb` uses it too). At each instant the rank that becomes free
earliest decides, seeing the exact finish time of everything already placed:

* per stage, ``F`` and ``B`` go in microbatch order; among the ready ``B`` and ``F`` of the rank's
  chunks it picks by the knobs (``B`` before ``F`` or the reverse; deepest chunk, shallowest
  chunk or oldest microbatch first);
* memory: an ``F`` on a chunk runs only if the activation it allocates *plus* that of the rank's
  later chunks fits the limit (so the microbatch can always finish its forward on this rank).
  With ``F`` and ``B`` in microbatch order this makes the scheduler deadlock-free down to the
  minimum limit ``M`` on the V: the oldest unfinished microbatch can always advance;
* ``W`` is deferred: it runs when the memory limit blocks a ready ``F`` (to free memory), fills an
  idle gap once the start of the next ``F``/``B`` is known (placed retroactively, so it delays
  nothing), optionally overruns a gap of at least a fraction of ``T_W``, optionally runs right
  after its ``B``, and the rest run at the end;
* warm-up (knobs): how many microbatches may be between the rank's first chunk and its last chunk
  (ZB-V's warm-up depth: as many first-chunk forwards as fit before microbatch 0 comes back to the
  rank's second chunk), a cap on microbatches in flight (for tight limits), and *pacing*: microbatch
  ``i`` enters stage 0 no earlier than ``(i - burst) * period`` with ``period`` the busiest rank's
  work per microbatch -- with little memory this keeps microbatches from travelling in convoys
  that leave every rank idle between the waves.

The search also builds orders under simplified costs (no ``T_comm``; equal times) and times them
under the real costs (:func:`proxy_costs`): on long pipelines the scheduler's reaction to small
communication delays can drift into an irregular steady state, while the order built without them
stays regular and is better under the real costs too.

Monotonicity in the limit: the search also runs at the grid limit ``k*M/2`` just below the
requested one (a schedule that fits a smaller limit fits a larger one), so the bubble does not
grow when the limit rises, up to the heuristic noise between grid points.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from .costs import CostModel, StageCosts
from .ir import Action, Schedule, ScheduleError, make_schedule, v_placement
from .registry import ScheduleSpec, register
from .simulator import simulate

__all__ = ["Knobs", "list_schedule", "search", "knob_space", "asap_times", "improve", "proxy_costs", "v_min_memory", "v_full_memory", "zbv", "v_half", "v_min",
           "v_schedule"]

_TOL = 1e-9
_IMPROVE_MAX_ACTIONS = 200
"""Problems with at most this many actions get a local-search pass after the knob search."""


# ---------------------------------------------------------------------------- the list scheduler
@dataclass(frozen=True)
class Knobs:
    """One configuration of :func:`list_schedule`.

    Attributes:
        name: label (kept in the schedule's ``meta['variant']``).
        b_pick / f_pick: which of several ready ``B`` / ``F`` runs first: ``"late"`` (the rank's
            deepest stage), ``"early"`` (its shallowest) or ``"old"`` (smallest microbatch, then
            deepest stage).
        f_first: run a ready ``F`` before a ready ``B``.
        w_gap: a pending ``W`` may start in an idle gap of at least ``w_gap * T_W`` (1.0: only
            where it fits entirely; 0.0: any gap, delaying the next ``F``/``B`` a little).
        caps: per rank, the most microbatches in flight (forward started on the rank's first
            chunk, backward of that chunk not done); ``None`` leaves it to the memory limit.
        eager_w: run ``W`` right after its ``B`` once more than this many are pending (``None``:
            never).
        open_caps: per rank, the most microbatches whose forward has started on the rank's first
            chunk but not yet reached its last chunk (the warm-up depth of the V); ``None``: no cap.
        pace: ``(period, burst)``: microbatch ``i >= burst`` enters stage 0 no earlier than
            ``(i - burst) * period`` (smooths the injection so microbatches do not travel in convoys).
            This is a construction device only: the order is then timed by the simulator, which
            starts every action as soon as possible.
    """

    name: str = "default"
    b_pick: str = "late"
    f_pick: str = "late"
    f_first: bool = False
    w_gap: float = 1.0
    caps: tuple[int, ...] | None = None
    eager_w: int | None = None
    pace: tuple[float, int] | None = None
    open_caps: tuple[int, ...] | None = None


def list_schedule(stage_to_rank: Sequence[int], num_microbatches: int, sc: StageCosts,
                  limit: float | None, knobs: Knobs) -> list[list[Action]] | None:
    """One pass of the list scheduler: per-rank action lists, or ``None`` (see :func:`_list_schedule`)."""
    out = _list_schedule(stage_to_rank, num_microbatches, sc, limit, knobs)
    return None if out is None else out[0]


def _list_schedule(stage_to_rank: Sequence[int], num_microbatches: int, sc: StageCosts,
                   limit: float | None, knobs: Knobs) -> tuple[list[list[Action]], float, float, float] | None:
    """One pass of the event-driven list scheduler for split-backward schedules.

    Args:
        stage_to_rank: any placement (stage ``s`` on rank ``stage_to_rank[s]``).
        num_microbatches: ``m``.
        sc: costs resolved for ``len(stage_to_rank)`` stages.
        limit: per-rank activation-memory limit (unit of ``sc.mem_b``), ``None`` for none.
        knobs: the configuration.

    Returns:
        ``(per-rank action lists, makespan, peak memory, total time)`` -- without ``pace`` the
        times are the simulator's (every action starts as soon as its rank and inputs allow) -- or ``None`` if
        this configuration got stuck (possible only with more than two chunks per rank).
    """
    s2r = list(stage_to_rank)
    n, m = len(s2r), num_microbatches
    p = max(s2r) + 1
    local = [[s for s in range(n) if s2r[s] == r] for r in range(p)]
    tf, tb, tw, comm = sc.t_f, sc.t_b, sc.t_w, sc.t_comm
    mb, mw = sc.mem_b, sc.mem_w
    lim = math.inf if limit is None else limit * (1 + 1e-12) + 1e-12
    # memory an F on stage s needs: its own activation plus the rank's later chunks (for the same mb)
    need = [mb[s] + sum(mb[q] for q in local[s2r[s]] if q > s) for s in range(n)]
    first_local = [ls[0] for ls in local]
    caps, pace, open_caps = knobs.caps, knobs.pace, knobs.open_caps
    last_local = [ls[-1] for ls in local]
    b_pick, f_pick, f_first, w_gap, eager_w = knobs.b_pick, knobs.f_pick, knobs.f_first, knobs.w_gap, knobs.eager_w

    f_end: list[list[float | None]] = [[None] * m for _ in range(n)]
    b_end: list[list[float | None]] = [[None] * m for _ in range(n)]
    nf, nb = [0] * n, [0] * n
    wq: list[list[tuple[int, int]]] = [[] for _ in range(p)]   # pending W (mb, stage), FIFO
    wq_head = [0] * p
    wq_mem = [0.0] * p                                          # memory freed by all pending W
    mem = [0.0] * p
    clock = [0.0] * p
    left = [3 * m * len(local[r]) for r in range(p)]
    nbdone = [0] * p                                            # B's done on the rank
    orders: list[list[Action]] = [[] for _ in range(p)]
    first = [-1.0] * p
    peak = [0.0] * p
    heap: list[tuple[float, int]] = [(0.0, r) for r in range(p) if left[r]]
    heapq.heapify(heap)

    def run_w(r: int) -> None:
        i, s = wq[r][wq_head[r]]
        wq_head[r] += 1
        orders[r].append(Action("W", i, s))
        clock[r] += tw[s]
        mem[r] -= mw[s]
        wq_mem[r] -= mw[s]
        left[r] -= 1

    def pick(cands: list[tuple[float, int, int]], how: str) -> tuple[float, int, int]:
        if how == "late":
            return max(cands, key=lambda c: c[1])
        if how == "early":
            return min(cands, key=lambda c: c[1])
        return min(cands, key=lambda c: (c[2], -c[1]))

    while heap:
        t, r = heapq.heappop(heap)
        if left[r] == 0 or clock[r] > t + _TOL:
            continue
        bs: list[tuple[float, int, int]] = []      # (ready time, stage, mb), ready time known
        fs: list[tuple[float, int, int]] = []
        for s in local[r]:
            i = nb[s]
            if i < nf[s]:
                rt = f_end[s][i]
                if s < n - 1:
                    e = b_end[s + 1][i]
                    if e is None:
                        rt = None
                    else:
                        e += comm if s2r[s + 1] != r else 0.0
                        rt = e if e > rt else rt
                if rt is not None:
                    bs.append((rt, s, i))
            i = nf[s]
            if i < m:
                if s == 0:
                    rt = 0.0 if pace is None or i < pace[1] else (i - pace[1]) * pace[0]
                else:
                    e = f_end[s - 1][i]
                    rt = None if e is None else e + (comm if s2r[s - 1] != r else 0.0)
                if rt is None:
                    continue
                if mem[r] - wq_mem[r] + need[s] > lim:
                    continue                        # cannot fit even after every pending W
                if s == first_local[r]:
                    if caps is not None and i - nb[s] >= caps[r]:
                        continue
                    if open_caps is not None and i - nf[last_local[r]] >= open_caps[r]:
                        continue
                fs.append((rt, s, i))
        now = t + _TOL
        b_now = [c for c in bs if c[0] <= now]
        f_now = [c for c in fs if c[0] <= now]
        if b_now and not (f_first and f_now):
            op, (rt, s, i) = "B", pick(b_now, b_pick)
        elif f_now:
            op, (rt, s, i) = "F", pick(f_now, f_pick)
        elif not bs and not fs and wq_head[r] < len(wq[r]) and all(nb[q] == m for q in local[r]):
            while wq_head[r] < len(wq[r]):          # cool-down: only W's are left
                run_w(r)
            continue
        else:
            future = [c[0] for c in bs + fs if c[0] > now]
            if future:
                heapq.heappush(heap, (max(min(future), clock[r]), r))
            continue                                 # otherwise a notification wakes the rank
        # W's before the chosen action: those the memory needs, those that fit the idle gap, and
        # (knob) one that overruns a gap of at least w_gap * T_W
        if op == "F":
            while mem[r] + need[s] > lim:
                run_w(r)
        while wq_head[r] < len(wq[r]) and clock[r] + tw[wq[r][wq_head[r]][1]] <= rt + _TOL:
            run_w(r)
        if wq_head[r] < len(wq[r]) and clock[r] < rt - _TOL and rt - clock[r] >= w_gap * tw[wq[r][wq_head[r]][1]]:
            run_w(r)
        start = rt if rt > clock[r] else clock[r]
        if first[r] < 0:
            first[r] = start
        if op == "F":
            end = start + tf[s]
            f_end[s][i] = end
            nf[s] = i + 1
            mem[r] += mb[s]
            if mem[r] > peak[r]:
                peak[r] = mem[r]
            orders[r].append(Action("F", i, s))
            nxt = s + 1
        else:
            end = start + tb[s]
            b_end[s][i] = end
            nb[s] = i + 1
            mem[r] += mw[s] - mb[s]
            wq[r].append((i, s))
            wq_mem[r] += mw[s]
            nbdone[r] += 1
            orders[r].append(Action("B", i, s))
            nxt = s - 1
        clock[r] = end
        left[r] -= 1
        if eager_w is not None:
            while len(wq[r]) - wq_head[r] > eager_w:
                run_w(r)
        if left[r]:
            heapq.heappush(heap, (clock[r], r))
        if 0 <= nxt < n:
            q = s2r[nxt]
            if q != r and left[q]:
                heapq.heappush(heap, (max(end + comm, clock[q]), q))
    if any(left):
        return None
    return orders, max(clock[r] - first[r] for r in range(p) if first[r] >= 0), max(peak), max(clock)


def asap_times(s2r: Sequence[int], m: int, sc: StageCosts, orders: list[list[Action]],
               spans: list[float] | None = None) -> tuple[float, float, float]:
    """``(makespan, peak memory, total time)`` of a deadlock-free split-backward order, timed as the
    simulator does (every action as soon as its rank is free and its inputs have arrived).

    A lean version of :func:`~megatron_zb.schedules.simulator.simulate` for the search loop (no
    validation, no per-action records); the chosen schedule is always checked by the simulator.
    """
    n, p = len(s2r), len(orders)
    comm = sc.t_comm
    f_end = [[-1.0] * m for _ in range(n)]
    b_end = [[-1.0] * m for _ in range(n)]
    clock, first, ptr = [0.0] * p, [-1.0] * p, [0] * p
    peak = 0.0
    for r in range(p):
        cur = 0.0
        for a in orders[r]:
            cur += sc.memory_delta(a.op, a.stage)
            if cur > peak:
                peak = cur
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            acts, k, t = orders[r], ptr[r], clock[r]
            while k < len(acts):
                a = acts[k]
                op, i, s = a.op, a.mb, a.stage
                if op == "F":
                    if s > 0:
                        e = f_end[s - 1][i]
                        if e < 0:
                            break
                        if s2r[s - 1] != r:
                            e += comm
                        if e > t:
                            t = e
                elif op == "B":
                    e = f_end[s][i]
                    if e > t:
                        t = e
                    if s < n - 1:
                        e = b_end[s + 1][i]
                        if e < 0:
                            break
                        if s2r[s + 1] != r:
                            e += comm
                        if e > t:
                            t = e
                if first[r] < 0:
                    first[r] = t
                t += sc.t_f[s] if op == "F" else sc.t_b[s] if op == "B" else sc.t_w[s]
                if op == "F":
                    f_end[s][i] = t
                elif op == "B":
                    b_end[s][i] = t
                k += 1
                remaining -= 1
                progressed = True
            ptr[r], clock[r] = k, t
        if not progressed:
            raise ScheduleError("the order deadlocks")
    if spans is not None:
        spans[:] = [clock[r] - first[r] if first[r] >= 0 else 0.0 for r in range(p)]
    return max(clock[r] - first[r] for r in range(p) if first[r] >= 0), peak, max(clock)


def improve(s2r: Sequence[int], m: int, sc: StageCosts, limit: float | None, orders: list[list[Action]],
            *, max_evals: int = 4000) -> list[list[Action]]:
    """Local search on a schedule: swap neighbouring actions of a rank while that helps.

    A swap is kept when the simulated ``(makespan, sum of per-rank spans, total time)`` gets
    strictly smaller and the order stays valid, deadlock-free and within the memory limit.
    Stops after a pass without improvement or ``max_evals`` evaluations. Used for small problems.
    """
    lim = math.inf if limit is None else limit * (1 + 1e-12) + 1e-12
    orders = [list(o) for o in orders]

    def score() -> tuple | None:
        spans: list[float] = []
        try:
            ms, pk, tot = asap_times(s2r, m, sc, orders, spans)
        except ScheduleError:
            return None
        if pk > lim:
            return None
        return (round(ms, 9), round(sum(spans), 9), round(tot, 9))

    best = score()
    if best is None:
        return orders
    evals = 0
    improved = True
    while improved and evals < max_evals:
        improved = False
        for r in range(len(orders)):
            for k in range(len(orders[r])):
                for d in (1, -1, 2, -2, 3, -3, 4, -4, 6, -6):
                    j = k + d
                    row = orders[r]
                    if not 0 <= j < len(row):
                        continue
                    a = row[k]
                    lo, hi = (k + 1, j + 1) if j > k else (j, k)
                    if any(x.mb == a.mb and x.stage == a.stage for x in row[lo:hi]):
                        continue                   # F before B before W of one (mb, stage)
                    new_row = row[:k] + row[k + 1:]
                    new_row.insert(j, a)
                    orders[r] = new_row
                    got = score()
                    evals += 1
                    if got is not None and got < best:
                        best, improved = got, True
                        break
                    orders[r] = row
                    if evals >= max_evals:
                        return orders
    return orders


def proxy_costs(sc: StageCosts) -> list[tuple[str, StageCosts]]:
    """Simplified cost models to build extra candidate orders with: no ``T_comm``; equal times."""
    out = []
    if sc.t_comm > 0:
        out.append(("T_comm = 0", replace(sc, t_comm=0.0)))
    n = len(sc.t_f)
    if len(set(sc.t_f) | set(sc.t_b) | set(sc.t_w)) > 1:
        out.append(("unit times", replace(sc, t_f=(1.0,) * n, t_b=(1.0,) * n, t_w=(1.0,) * n, t_comm=0.0)))
    return out


def _first_b_caps(s2r: Sequence[int], sc: StageCosts, m: int) -> tuple[int, ...]:
    """Per rank: forwards of its first chunk that fit before its first ``B`` can arrive (+1)."""
    n = len(s2r)
    p = max(s2r) + 1
    caps = []
    for r in range(p):
        s0 = min(s for s in range(n) if s2r[s] == r)
        t = 0.0
        for s in range(s0, n):                 # microbatch 0's forward from s0 to the end ...
            t += sc.t_f[s] + (sc.t_comm if s + 1 < n and s2r[s + 1] != s2r[s] else 0.0)
        last_local = max(s for s in range(n) if s2r[s] == r)
        for s in range(n - 1, last_local, -1):  # ... and its backward back to this rank
            t += sc.t_b[s] + (sc.t_comm if s2r[s - 1] != s2r[s] else 0.0)
        caps.append(max(1, min(m, int(math.floor(t / sc.t_f[s0] + 1e-9)) + 1)))
    return tuple(caps)


def _first_turn_caps(s2r: Sequence[int], sc: StageCosts, m: int, extra: float) -> tuple[int, ...]:
    """Per rank: forwards of its first chunk that fit before microbatch 0 reaches its last chunk."""
    n = len(s2r)
    p = max(s2r) + 1
    caps = []
    for r in range(p):
        ls = [s for s in range(n) if s2r[s] == r]
        s0, s1 = ls[0], ls[-1]
        t = 0.0
        for s in range(s0 + 1, s1):
            t += sc.t_f[s]
        t += sc.t_comm * sum(1 for s in range(s0, s1) if s2r[s] != s2r[s + 1])
        caps.append(max(1, min(m, int(math.floor(t / sc.t_f[s0] + extra + 1e-9)) + 1)))
    return tuple(caps)


def knob_space(s2r: Sequence[int], sc: StageCosts, m: int, limit: float | None) -> dict[str, list]:
    """The values :func:`search` tries for each knob (see :class:`Knobs`)."""
    p = max(s2r) + 1
    n = len(s2r)
    period = max(sum(sc.t_f[s] + sc.t_b[s] + sc.t_w[s] for s in range(n) if s2r[s] == r) for r in range(p))
    full = max(sum(sc.mem_b[s] for s in range(n) if s2r[s] == r) for r in range(p))
    caps: list = [None]
    if limit is not None and math.isfinite(limit) and full > 0:
        k = int(math.floor(limit / full + 1e-9))
        caps += [(c,) * p for c in (k - 1, k, k + 1) if 1 <= c < m]
    caps.append(_first_b_caps(s2r, sc, m))
    return {
        "open_caps": [_first_turn_caps(s2r, sc, m, 0.0), _first_turn_caps(s2r, sc, m, 0.5), None],
        "caps": caps,
        "pace": [None] + [(period * f, k) for f in (1.0, 1.05) for k in (1, 2, 4)],
        "b_pick": ["late", "early", "old"],
        "f_pick": ["late", "old"],
        "f_first": [False, True],
        "w_gap": [1.0, 0.5, 0.0],
        "eager_w": [None, 0],
    }


def _knob_name(cfg: dict) -> str:
    parts = []
    for k, v in cfg.items():
        if isinstance(v, tuple) and v and isinstance(v[0], int):
            v = "(" + ",".join(map(str, v[:4])) + (",..)" if len(v) > 4 else ")")
        elif isinstance(v, tuple):
            v = f"({v[0]:.4g},{v[1]})"
        parts.append(f"{k}={v}")
    return " ".join(parts)


def search(s2r: Sequence[int], m: int, sc: StageCosts, limit: float | None, *,
           seeds: Sequence[dict] | None = None, space: dict[str, list] | None = None,
           max_sweeps: int = 2) -> tuple[list[list[Action]], tuple[float, float, float], str] | None:
    """Coordinate descent over the knobs of :func:`_list_schedule`; keeps the best score.

    Starts from each seed configuration, then sweeps the knobs one at a time (every value of one
    knob with the others fixed at the best so far) until a sweep brings nothing or ``max_sweeps``
    sweeps are done. The score is ``(makespan, peak memory, total time)``, lower is better.
    Returns ``(per-rank orders, score, description)`` or ``None`` if every configuration got stuck.
    """
    space = space if space is not None else knob_space(s2r, sc, m, limit)
    base = {k: v[0] for k, v in space.items()}
    if seeds is None:
        seeds = [{}, {"pace": space["pace"][1] if len(space["pace"]) > 1 else None, "b_pick": "early"},
                 {"open_caps": None, "b_pick": "early", "f_first": True}]
    cache: dict[tuple, tuple | None] = {}

    def evaluate(cfg: dict) -> tuple | None:
        key = tuple(cfg[k] for k in space)
        if key not in cache:
            out = _list_schedule(s2r, m, sc, limit, Knobs(name=_knob_name(cfg), **cfg))
            if out is not None and cfg.get("pace") is not None:
                # pacing idles on purpose, which an order cannot express: score what the simulator
                # makes of the order (every action as soon as possible)
                out = (out[0],) + asap_times(s2r, m, sc, out[0])
            cache[key] = None if out is None else (
                (round(out[1], 9), round(out[2], 9), round(out[3], 9)), out[0])
        return cache[key]

    best: tuple | None = None
    for seed in seeds:
        cfg = dict(base, **{k: v for k, v in seed.items() if k in space})
        got = evaluate(cfg)
        if got is not None and (best is None or got[0] < best[0]):
            best = (got[0], got[1], cfg)
    if best is None:
        for k, vals in space.items():          # seeds stuck: try each single change from the base
            for v in vals:
                cfg = dict(base, **{k: v})
                got = evaluate(cfg)
                if got is not None and (best is None or got[0] < best[0]):
                    best = (got[0], got[1], cfg)
        if best is None:
            return None
    for _ in range(max_sweeps):
        improved = False
        for k, vals in space.items():
            for v in vals:
                if v == best[2][k]:
                    continue
                cfg = dict(best[2], **{k: v})
                got = evaluate(cfg)
                if got is not None and got[0] < best[0]:
                    best, improved = (got[0], got[1], cfg), True
        if not improved:
            break
    return best[1], best[0], _knob_name(best[2])


# ---------------------------------------------------------------------------- the V family
def _check_v_inputs(num_ranks: object, num_microbatches: object, costs: object, num_chunks: int = 2) -> None:
    if not isinstance(num_ranks, int) or isinstance(num_ranks, bool) or num_ranks < 1:
        raise ScheduleError(f"num_ranks must be an integer >= 1, got {num_ranks!r}")
    if not isinstance(num_microbatches, int) or isinstance(num_microbatches, bool) or num_microbatches < 1:
        raise ScheduleError(f"num_microbatches must be an integer >= 1, got {num_microbatches!r}")
    if not isinstance(costs, CostModel):
        raise ScheduleError(f"costs must be a CostModel, got {type(costs).__name__}")
    if num_chunks != 2:
        kind = "an odd" if isinstance(num_chunks, int) and num_chunks % 2 else "a"
        raise ScheduleError(f"the V placement has exactly 2 chunks per rank (stage r and stage 2p-1-r); "
                            f"got {kind} chunk count {num_chunks!r}")


def v_full_memory(num_ranks: int, costs: CostModel | StageCosts) -> float:
    """``M``: the largest per-rank share of one microbatch's activations, ``mem_b[r] + mem_b[2p-1-r]``."""
    sc = costs.resolve(2 * num_ranks) if isinstance(costs, CostModel) else costs
    p = num_ranks
    return max(sc.mem_b[r] + sc.mem_b[2 * p - 1 - r] for r in range(p))


def one_f_one_b_memory(num_ranks: int, costs: CostModel | StageCosts) -> float:
    """``R``: 1F1B's peak activation memory for the model whose ``2p`` chunks these costs describe.

    1F1B places chunks ``2r`` and ``2r+1`` (the same layers, in order) on rank ``r``, which holds
    ``p - r`` microbatches in flight at its peak (``m >= p``), so
    ``R = max_r (p - r) * (mem_b[2r] + mem_b[2r+1])`` in units of ``mem_b``.
    """
    sc = costs.resolve(2 * num_ranks) if isinstance(costs, CostModel) else costs
    p = num_ranks
    return max((p - r) * (sc.mem_b[2 * r] + sc.mem_b[2 * r + 1]) for r in range(p))


def v_default_limit(num_ranks: int, costs: CostModel | StageCosts, fraction: float) -> float:
    """``max(M, min(fraction, p) / p * R)``: a family's default limit (see the module docstring)."""
    p = num_ranks
    return max(v_full_memory(p, costs), min(fraction, p) / p * one_f_one_b_memory(p, costs))


def v_min_memory(num_ranks: int, costs: CostModel | StageCosts) -> float:
    """The smallest feasible per-rank limit on the V placement (unit of ``mem_b``).

    Rank ``r`` must hold microbatch ``i``'s chunk-0 activation until ``B(i, r)``, which needs
    ``B(i, 2p-1-r)``, which needs ``F(i, 2p-1-r)``: both chunks at once, ``mem_b[r] + mem_b[2p-1-r]``.
    Running one microbatch at a time needs no more, so this is the minimum (= :func:`v_full_memory`).
    """
    return v_full_memory(num_ranks, costs)


def v_schedule(*, num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: float | None = None,
               name: str = "v", default_fraction: Callable[[int], float] | None = None) -> Schedule:
    """A V-placement zero-bubble schedule under a per-rank activation-memory limit.

    Args:
        num_ranks: ``p`` (>= 1); the model has ``2p`` stages.
        num_microbatches: ``m`` (>= 1).
        costs: per-stage (per-chunk) costs for ``2p`` stages; times in any unit.
        memory_limit: per-rank peak activation limit in units of ``costs.mem_b`` (one chunk's
            ``M_B``). ``None``: ``costs.memory_limit``, else :func:`v_default_limit` with
            ``default_fraction(p)`` (1F1B's peak ``R`` when no fraction is given).
        name: the schedule's name.

    Raises:
        ScheduleError: bad sizes or costs, or a limit below :func:`v_min_memory`.
    """
    _check_v_inputs(num_ranks, num_microbatches, costs)
    p, m = num_ranks, num_microbatches
    s2r = v_placement(p)
    base = costs.resolve(2 * p)
    full = v_full_memory(p, base)
    if memory_limit is None:
        memory_limit = costs.memory_limit
    if memory_limit is None:
        frac = default_fraction(p) if default_fraction is not None else float(p)
        memory_limit = v_default_limit(p, base, frac) if full > 0 else math.inf
    try:
        limit = float(memory_limit)
    except (TypeError, ValueError):
        raise ScheduleError(f"memory_limit must be a number, got {memory_limit!r}") from None
    if math.isnan(limit) or limit <= 0:
        raise ScheduleError(f"memory_limit is {memory_limit!r}; it must be > 0")
    if limit * (1 + 1e-12) + 1e-12 < full:
        worst = max(range(p), key=lambda r: base.mem_b[r] + base.mem_b[2 * p - 1 - r])
        raise ScheduleError(
            f"memory_limit {limit:g} is below the minimum {full:g} for the V placement: rank {worst} must hold "
            f"both of its chunks' activations of one microbatch (mem_b[{worst}] + mem_b[{2 * p - 1 - worst}]) "
            f"at once, so no schedule fits")
    sc = costs.with_limit(limit).resolve(2 * p)
    best = search(s2r, m, sc, limit)
    if math.isfinite(limit) and full > 0:
        # also the grid limit k*M/2 just below: a schedule that fits it fits this limit too, which
        # keeps the bubble from rising with the limit (up to the noise between grid points)
        g = math.ceil(limit / (full / 2) - 1e-9) - 1
        if g >= 2:
            lower = search(s2r, m, sc, g * full / 2, max_sweeps=1)
            if lower is not None and (best is None or lower[1] < best[1]):
                best = (lower[0], lower[1], lower[2] + f" (limit {g * full / 2:g})")
    for tag, proxy in proxy_costs(sc):
        # orders built under simplified costs, timed under the real ones: on large pipelines the
        # scheduler's reaction to T_comm or uneven T's can drift into irregular steady states
        got = search(s2r, m, proxy, limit, max_sweeps=1)
        if got is not None:
            ms, pk, tot = asap_times(s2r, m, sc, got[0])
            score = (round(ms, 9), round(pk, 9), round(tot, 9))
            if best is None or score < best[1]:
                best = (got[0], score, f"built with {tag}: {got[2]}")
    for cls_name, ranks_ in _library_v_orders(p, m):
        # orders of PyTorch's own V schedules, re-timed under our costs: kept when they fit the
        # memory limit and beat the search (so the result is never worse than them)
        try:
            res = simulate(Schedule(m, s2r, ranks_, cls_name), sc)
        except ScheduleError:
            continue
        score = (round(res.makespan, 9), round(res.max_peak_memory, 9), round(res.total_time, 9))
        if best is None or score < best[1]:
            best = (ranks_, score, f"torch.distributed.pipelining {cls_name} order")
    if best is None:  # pragma: no cover - the memory-only knobs cannot get stuck on the V
        raise ScheduleError(f"no V schedule found for p={p}, m={m}, memory_limit={limit:g}")
    ranks, score, variant = best
    if 6 * p * m <= _IMPROVE_MAX_ACTIONS:
        better = improve(s2r, m, sc, limit, ranks)
        if better != ranks:
            ranks, variant = better, variant + " + local search"
    res = simulate(Schedule(m, s2r, ranks, name), sc)    # validates; checks memory and deadlock
    return make_schedule(num_microbatches=m, stage_to_rank=s2r, ranks=ranks, name=name,
                         memory_limit=limit, variant=variant, makespan=res.makespan)


def _library_v_orders(p: int, m: int) -> list[tuple[str, list[list[Action]]]]:
    """Per-rank orders of PyTorch's V schedules (ZBV, DualPipeV) for ``p`` ranks, ``m`` microbatches.

    Built offline by :mod:`megatron_zb.schedules.torch_import` (PyTorch is a dependency anyway);
    a class that refuses the shape or yields an invalid order is skipped.
    """
    from .torch_import import import_torch_schedule

    out = []
    for cls_name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV"):
        try:
            sched = import_torch_schedule(cls_name, num_ranks=p, num_microbatches=m)
        except Exception:  # noqa: BLE001 - any refusal (shape constraint, defect, old torch) just skips it
            continue
        if sched.splits_backward and all(a.op != "BW" for _, _, a in sched.actions()):
            out.append((cls_name, sched.ranks))
    return out


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


# ---------------------------------------------------------------------------- registration
def _v_builder(fn: Callable[..., Schedule]) -> Callable[..., Schedule]:
    def build(*, num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: float | None = None,
              num_chunks: int = 2, **_: object) -> Schedule:
        _check_v_inputs(num_ranks, num_microbatches, costs, num_chunks)
        return fn(num_ranks=num_ranks, num_microbatches=num_microbatches, costs=costs, memory_limit=memory_limit)
    return build


def _interleaved_builder(*, num_ranks: int, num_microbatches: int, costs: CostModel,
                         memory_limit: float | None = None, num_chunks: int = 2, **_: object) -> Schedule:
    from .interleaved_zb import interleaved_zb
    return interleaved_zb(num_ranks=num_ranks, num_microbatches=num_microbatches, costs=costs,
                          memory_limit=memory_limit, num_chunks=num_chunks)


register(ScheduleSpec("zbv", "ZB-V: V placement, near-zero bubble at 1F1B's peak memory (p full stages)",
                      "v", True, True, _v_builder(zbv)))
register(ScheduleSpec("v-half", "V-Half: V placement, about 1/2 of 1F1B's activation memory",
                      "v", True, True, _v_builder(v_half)))
register(ScheduleSpec("v-min", "V-Min: V placement, about 1/3 of 1F1B's activation memory",
                      "v", True, True, _v_builder(v_min)))
register(ScheduleSpec("interleaved-zb", "interleaved placement (--chunks) with B/W split, W filling bubbles",
                      "interleaved", True, True, _interleaved_builder))

"""An event-driven list scheduler for split-backward schedules on any placement, and a local search.

:func:`list_schedule` builds per-rank orders for any ``stage_to_rank`` (the V family and
``interleaved-zb`` use it). At each instant the rank that becomes free earliest decides, seeing the
exact finish time of everything already placed (every action goes through the timing kernel,
:class:`~..timing.Timeline`, so without pacing its times are the simulator's):

* per stage, ``F`` and ``B`` go in microbatch order; among the ready ``B`` and ``F`` of the rank's
  chunks it picks by the knobs (``B`` before ``F`` or the reverse; deepest chunk, shallowest chunk
  or oldest microbatch first);
* memory: an ``F`` on a chunk runs only if the activation it allocates *plus* that of the rank's
  later chunks fits the limit (so the microbatch can always finish its forward on this rank). With
  ``F`` and ``B`` in microbatch order this makes the scheduler deadlock-free down to the minimum
  limit on the V: the oldest unfinished microbatch can always advance. When a ``B`` allocates
  (``mem_w > mem_b``, :meth:`~..costs.StageCosts.backward_alloc`) the ``F`` also reserves the
  largest such allocation of the rank's chunks, and the ``B`` runs only when it fits after pending
  ``W`` (which it runs first when it needs their memory);
* ``W`` is deferred: it runs when the memory limit blocks a ready ``F`` (to free memory), fills an
  idle gap once the start of the next ``F``/``B`` is known (placed retroactively, so it delays
  nothing), optionally overruns a gap of at least a fraction of ``T_W``, optionally runs right after
  its ``B``, and the rest run at the end;
* warm-up and pacing knobs: see :class:`Knobs`.

:func:`improve` is a local search that moves single actions while the simulated makespan improves.

Units: times in the unit of the costs; memory limits in the unit of ``costs.mem_b``.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence

from ..costs import StageCosts
from ..ir import Action
from ..limits import slack_ceiling
from ..timing import B_CODE, F_CODE, W_CODE, Code, DeadlockError, Timeline, decode, encode

__all__ = ["Knobs", "asap_times", "improve", "list_schedule", "list_schedule_stats"]

_TOL = 1e-9


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


Ready = tuple[float, int, int]
"""A candidate action: ``(ready time, stage, microbatch)``."""


def _pick(cands: list[Ready], how: str) -> Ready:
    if how == "late":
        return max(cands, key=lambda c: c[1])
    if how == "early":
        return min(cands, key=lambda c: c[1])
    return min(cands, key=lambda c: (c[2], -c[1]))


class _ListScheduler:
    """The state of one pass of the list scheduler (see the module docstring)."""

    def __init__(self, stage_to_rank: Sequence[int], m: int, sc: StageCosts, limit: float | None,
                 knobs: Knobs) -> None:
        s2r = self.s2r = list(stage_to_rank)
        n = len(s2r)
        p = max(s2r) + 1
        self.m, self.knobs = m, knobs
        self.tl = Timeline(s2r, m, sc)
        self.local = [[s for s in range(n) if s2r[s] == r] for r in range(p)]
        self.lim = slack_ceiling(limit)
        alloc = self.tl.delta[F_CODE]
        # memory an F on stage s needs: its own activation plus the rank's later chunks (same mb),
        # plus the most a B of the rank's chunks allocates (0.0 unless mem_w > mem_b)
        self.extra = [sc.backward_alloc(s) for s in range(n)]
        reserve = [max(self.extra[q] for q in self.local[r]) for r in range(p)]
        self.need = [alloc[s] + sum(alloc[q] for q in self.local[s2r[s]] if q > s) + reserve[s2r[s]]
                     for s in range(n)]
        self.freed_by_w = [-d for d in self.tl.delta[W_CODE]]
        self.nf, self.nb = [0] * n, [0] * n
        self.wq: list[list[tuple[int, int]]] = [[] for _ in range(p)]   # pending W (mb, stage), FIFO
        self.wq_head = [0] * p
        self.wq_mem = [0.0] * p                                         # memory freed by all pending W
        self.left = [3 * m * len(self.local[r]) for r in range(p)]
        self.orders: list[list[Code]] = [[] for _ in range(p)]

    def run_w(self, r: int) -> None:
        """Run rank ``r``'s oldest pending ``W`` now."""
        i, s = self.wq[r][self.wq_head[r]]
        self.wq_head[r] += 1
        self.orders[r].append((W_CODE, i, s))
        self.tl.run(r, W_CODE, i, s, self.tl.ready(W_CODE, i, s))
        self.wq_mem[r] -= self.freed_by_w[s]
        self.left[r] -= 1

    def candidates(self, r: int) -> tuple[list[Ready], list[Ready]]:
        """Rank ``r``'s next ``B`` and allowed next ``F`` per stage whose inputs are done."""
        tl, m, knobs, nf, nb = self.tl, self.m, self.knobs, self.nf, self.nb
        local = self.local[r]
        bs: list[Ready] = []
        fs: list[Ready] = []
        for s in local:
            i = nb[s]
            if i < nf[s]:
                rt = tl.ready(B_CODE, i, s)
                if rt < math.inf and not (self.extra[s] > 0 and
                                          tl.mem[r] - self.wq_mem[r] + self.extra[s] > self.lim):
                    bs.append((rt, s, i))           # (an allocating B: only if it fits after every W)
            i = nf[s]
            if i < m:
                rt = tl.ready(F_CODE, i, s)
                if s == 0 and knobs.pace is not None and i >= knobs.pace[1]:
                    rt = max(rt, (i - knobs.pace[1]) * knobs.pace[0])
                if rt == math.inf:
                    continue
                if tl.mem[r] - self.wq_mem[r] + self.need[s] > self.lim:
                    continue                        # cannot fit even after every pending W
                if s == local[0]:
                    if knobs.caps is not None and i - nb[s] >= knobs.caps[r]:
                        continue
                    if knobs.open_caps is not None and i - nf[local[-1]] >= knobs.open_caps[r]:
                        continue
                fs.append((rt, s, i))
        return bs, fs

    def place(self, r: int, op: int, rt: float, s: int, i: int) -> None:
        """Run the chosen ``op`` on ``(i, s)`` (ready at ``rt``) and the ``W``'s due before and after it."""
        tl, wq, head, tw = self.tl, self.wq[r], self.wq_head, self.tl.duration[W_CODE]
        if op == F_CODE:
            while tl.mem[r] + self.need[s] > self.lim:    # W's the memory needs
                self.run_w(r)
        elif self.extra[s] > 0:
            while tl.mem[r] + self.extra[s] > self.lim:   # W's an allocating B needs
                self.run_w(r)
        while head[r] < len(wq) and tl.clock[r] + tw[wq[head[r]][1]] <= rt + _TOL:
            self.run_w(r)                                # W's that fit the idle gap
        gap = rt - tl.clock[r]
        if head[r] < len(wq) and tl.clock[r] < rt - _TOL and gap >= self.knobs.w_gap * tw[wq[head[r]][1]]:
            self.run_w(r)                                # (knob) one that overruns a gap of w_gap * T_W
        self.orders[r].append((op, i, s))
        tl.run(r, op, i, s, rt)
        if op == F_CODE:
            self.nf[s] = i + 1
        else:
            self.nb[s] = i + 1
            wq.append((i, s))
            self.wq_mem[r] += self.freed_by_w[s]
        self.left[r] -= 1
        if self.knobs.eager_w is not None:
            while len(wq) - head[r] > self.knobs.eager_w:
                self.run_w(r)

    def schedule(self) -> bool:
        """Run the event loop; ``False`` if it got stuck."""
        tl, knobs, s2r, n = self.tl, self.knobs, self.s2r, len(self.s2r)
        left = self.left
        heap: list[tuple[float, int]] = [(0.0, r) for r in range(len(left)) if left[r]]
        heapq.heapify(heap)
        while heap:
            t, r = heapq.heappop(heap)
            if left[r] == 0 or tl.clock[r] > t + _TOL:
                continue
            bs, fs = self.candidates(r)
            now = t + _TOL
            b_now = [c for c in bs if c[0] <= now]
            f_now = [c for c in fs if c[0] <= now]
            if b_now and not (knobs.f_first and f_now):
                op, (rt, s, i) = B_CODE, _pick(b_now, knobs.b_pick)
            elif f_now:
                op, (rt, s, i) = F_CODE, _pick(f_now, knobs.f_pick)
            elif not bs and not fs and self.wq_head[r] < len(self.wq[r]) and all(
                    self.nb[q] == self.m for q in self.local[r]):
                while self.wq_head[r] < len(self.wq[r]):   # cool-down: only W's are left
                    self.run_w(r)
                continue
            else:
                future = [c[0] for c in bs + fs if c[0] > now]
                if future:
                    heapq.heappush(heap, (max(min(future), tl.clock[r]), r))
                continue                                  # otherwise a notification wakes the rank
            self.place(r, op, rt, s, i)
            if left[r]:
                heapq.heappush(heap, (tl.clock[r], r))
            nxt = s + 1 if op == F_CODE else s - 1           # wake the rank this result goes to
            if 0 <= nxt < n:
                q = s2r[nxt]
                if q != r and left[q]:
                    heapq.heappush(heap, (max(tl.ready(op, i, nxt), tl.clock[q]), q))
        return not any(left)


def _schedule_codes(stage_to_rank: Sequence[int], m: int, sc: StageCosts, limit: float | None,
                    knobs: Knobs) -> tuple[list[list[Code]], float, float, float] | None:
    """One pass: ``(per-rank orders, makespan, peak memory, total time)`` or ``None`` if stuck."""
    ls = _ListScheduler(stage_to_rank, m, sc, limit, knobs)
    if not ls.schedule():
        return None
    return ls.orders, ls.tl.makespan(), max(ls.tl.peak), ls.tl.total_time()


def list_schedule_stats(stage_to_rank: Sequence[int], num_microbatches: int, sc: StageCosts,
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
        times are the simulator's (every action starts as soon as its rank and inputs allow) -- or
        ``None`` if this configuration got stuck (possible only with more than two chunks per rank).
    """
    out = _schedule_codes(stage_to_rank, num_microbatches, sc, limit, knobs)
    if out is None:
        return None
    return [[decode(c) for c in row] for row in out[0]], out[1], out[2], out[3]


def list_schedule(stage_to_rank: Sequence[int], num_microbatches: int, sc: StageCosts,
                  limit: float | None, knobs: Knobs) -> list[list[Action]] | None:
    """One pass of the list scheduler: per-rank action lists, or ``None`` (see :func:`list_schedule_stats`)."""
    out = list_schedule_stats(stage_to_rank, num_microbatches, sc, limit, knobs)
    return None if out is None else out[0]


def _asap_codes(s2r: Sequence[int], m: int, sc: StageCosts, orders: Sequence[Sequence[Code]],
                spans: list[float] | None = None, timeline: Timeline | None = None) -> tuple[float, float, float]:
    """:func:`asap_times` of integer-coded orders (``timeline``: one built for ``s2r``, ``m``, ``sc``
    and ``len(orders)`` ranks to reuse)."""
    if timeline is None:
        tl = Timeline(s2r, m, sc, num_ranks=len(orders))
    else:
        tl = timeline
        tl.reset()
    tl.play(orders)
    if spans is not None:
        spans[:] = tl.spans()
    return tl.makespan(), max(tl.peak, default=0.0), tl.total_time()


def asap_times(s2r: Sequence[int], m: int, sc: StageCosts, orders: list[list[Action]],
               spans: list[float] | None = None) -> tuple[float, float, float]:
    """``(makespan, peak memory, total time)`` of a deadlock-free split-backward order, timed by the
    simulator's kernel (every action as soon as its rank is free and its inputs have arrived).

    No validation and no per-action records (for search loops); ``spans``, if given, receives the
    per-rank spans. Raises :class:`~..timing.DeadlockError` if the order deadlocks.
    """
    return _asap_codes(s2r, m, sc, [[encode(a) for a in row] for row in orders], spans)


def improve(s2r: Sequence[int], m: int, sc: StageCosts, limit: float | None, orders: list[list[Action]],
            *, max_evals: int = 4000) -> list[list[Action]]:
    """Local search on a schedule: move single actions of a rank while that helps.

    A move is kept when the simulated ``(makespan, sum of per-rank spans, total time)`` gets
    strictly smaller and the order stays valid, deadlock-free and within the memory limit.
    Stops after a pass without improvement or ``max_evals`` evaluations. Used for small problems.
    """
    lim = slack_ceiling(limit)
    codes = [[encode(a) for a in row] for row in orders]
    timeline = Timeline(s2r, m, sc, num_ranks=len(codes))

    def score() -> tuple | None:
        spans: list[float] = []
        try:
            ms, pk, tot = _asap_codes(s2r, m, sc, codes, spans, timeline)
        except DeadlockError:
            return None
        if pk > lim:
            return None
        return (round(ms, 9), round(sum(spans), 9), round(tot, 9))

    best = score()
    if best is None:
        return [list(o) for o in orders]
    evals = 0
    improved = True
    while improved and evals < max_evals:
        improved = False
        for r in range(len(codes)):
            for k in range(len(codes[r])):
                for d in (1, -1, 2, -2, 3, -3, 4, -4, 6, -6):
                    j = k + d
                    row = codes[r]
                    if not 0 <= j < len(row):
                        continue
                    a = row[k]
                    lo, hi = (k + 1, j + 1) if j > k else (j, k)
                    if any(x[1] == a[1] and x[2] == a[2] for x in row[lo:hi]):
                        continue                   # F before B before W of one (mb, stage)
                    new_row = row[:k] + row[k + 1:]
                    new_row.insert(j, a)
                    codes[r] = new_row
                    got = score()
                    evals += 1
                    if got is not None and got < best:
                        best, improved = got, True
                        break
                    codes[r] = row
                    if evals >= max_evals:
                        return [[decode(c) for c in row] for row in codes]
    return [[decode(c) for c in row] for row in codes]

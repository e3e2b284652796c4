"""Exact (minimum-makespan) schedules for small pipelines, with OR-Tools CP-SAT.

What is optimised
-----------------
The decision is the per-rank *order* of the split-backward actions (``F``, ``B``, ``W`` of every
microbatch on every stage). Given the orders, the project's simulator runs every action as soon
as its rank is free and its inputs have arrived, and reports ``makespan = max over ranks of (end
of the rank's last action - start of its first action)`` (the zero-bubble paper's "cost"). The
model here reproduces exactly that semantics, so its optimum is the minimum of the simulator's
makespan over all valid orders (under the memory limit):

* each rank's order is a Hamiltonian path through its actions (``AddCircuit`` with a depot node);
  the literal of arc ``a -> b`` says ``b`` directly follows ``a``;
* ``start[b] = max(ready[b], end[predecessor of b])`` as an *equality* (``AddMaxEquality``), where
  ``ready[b]`` is the latest input arrival (``t_comm`` added across ranks). So no action is
  delayed on purpose: the timing is the simulator's as-soon-as-possible timing. (A model that
  only asks ``start >= ...`` could start a rank late to shorten its span, which the simulator
  cannot reproduce from an order; its optimum would only be a lower bound.)
* memory follows the order: ``mem[b] = mem[pred] + delta(b) <= limit`` on each arc, exactly the
  simulator's per-rank prefix sums (``F`` adds ``mem_b``, ``B`` frees ``mem_b - mem_w``, ``W``
  frees ``mem_w``);
* objective: minimise ``Z`` with ``Z >= last_end[r] - first_start[r]`` for every rank ``r``.

Redundant constraints that only help the search: ``NoOverlap`` of each rank's intervals, the
precedences ``start >= ready``, arcs removed when the dependencies make them impossible, and
``Z >=`` each rank's busy time. The one symmetry broken: microbatches are interchangeable, so
stage 0 runs its forwards in microbatch order (relabel any schedule to get that).

Times are scaled to integers (the smallest power-of-ten-ish factor that makes every duration
integral, up to 10**4; beyond that they are rounded and ``meta['exact_costs']`` is False, in which
case "optimal" refers to the rounded costs). The returned schedule is always re-simulated with the
real costs.

Why CP-SAT and not a MILP with HiGHS
------------------------------------
The problem is disjunctive scheduling (one machine per rank) whose timing is a ``max`` of
predecessor ends. In a MILP, every ordering decision and that ``max`` need big-M constraints whose
LP relaxation is nearly empty, so HiGHS proves little beyond trivial bounds even at ``p=2``.
CP-SAT has native circuit, no-overlap and max constraints, propagates time windows through them,
learns clauses from conflicts, accepts a full warm-start hint (our heuristic schedule), and runs a
portfolio of workers within a wall-clock limit. (``ortools`` must be installed; it is imported on
use, so the rest of the package does not need it.)

Registered names: ``zb-optimal`` (plain placement; warm start from
:func:`~megatron_zb.schedules.greedy.zb_greedy` when importable, else the better of ZB-H1/ZB-H2
within the limit) and ``zbv-optimal`` (V placement; warm start from
:func:`~megatron_zb.schedules.vshape.zbv`). Meant for small instances (``p <= 4``, ``m <= 8``);
larger ones run until the time limit and return the best order found (never worse than the warm
start), with ``optimal=False`` and the proven gap.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

from .costs import CostModel, StageCosts
from .ir import Action, Schedule, ScheduleError, make_schedule, plain_placement, v_placement
from .registry import ScheduleSpec, register
from .simulator import simulate

__all__ = ["ExactResult", "solve_exact", "zb_optimal", "zbv_optimal", "DEFAULT_TIME_LIMIT"]

DEFAULT_TIME_LIMIT = 10.0
"""Seconds the registered ``zb-optimal`` / ``zbv-optimal`` give the solver."""


@dataclass
class ExactResult:
    """Outcome of :func:`solve_exact`.

    Attributes:
        schedule: the best schedule found (validated, within the memory limit).
        makespan: its simulated makespan (real costs).
        lower_bound: proven lower bound on the makespan of any valid order (real-cost units).
        optimal: the solver proved ``schedule`` optimal.
        gap: ``(makespan - lower_bound) / makespan`` (0 when optimal).
        warm_start_makespan: simulated makespan of the warm start (``None`` if none was given).
        status: CP-SAT's status name.
        wall_time: seconds spent in the solver.
        exact_costs: the integer scaling reproduced every duration exactly.
    """

    schedule: Schedule
    makespan: float
    lower_bound: float
    optimal: bool
    gap: float
    warm_start_makespan: float | None
    status: str
    wall_time: float
    exact_costs: bool


def _scale(values: Sequence[float], max_scale: int = 10_000) -> tuple[int, bool]:
    """Smallest factor in 1, 2, 4, 5, 8, 10, 20, ... making every value integral (or max_scale)."""
    cands = sorted({a * 10 ** k for k in range(5) for a in (1, 2, 4, 5, 8)} | {max_scale})
    for f in cands:
        if f > max_scale:
            break
        if all(abs(v * f - round(v * f)) <= 1e-9 * max(1.0, abs(v * f)) for v in values):
            return f, True
    return max_scale, False


def _mem_scale(values: Sequence[float]) -> int:
    den = 1
    for v in values:
        den = math.lcm(den, Fraction(v).limit_denominator(1000).denominator)
    return min(den, 1000)


def solve_exact(*, stage_to_rank: Sequence[int], num_microbatches: int, costs: CostModel,
                memory_limit: float | None = None, warm_start: Schedule | None = None,
                time_limit: float = DEFAULT_TIME_LIMIT, workers: int = 2, seed: int = 0) -> ExactResult:
    """Minimum-makespan split-backward schedule for any placement (see the module docstring).

    Args:
        stage_to_rank: the placement (e.g. :func:`~megatron_zb.schedules.ir.v_placement`).
        num_microbatches: ``m >= 1``.
        costs: per-stage costs (times in any unit; memory in the unit of ``mem_b``).
        memory_limit: per-rank activation limit (unit of ``mem_b``); ``None``: ``costs.memory_limit``
            (``None`` there too: no limit).
        warm_start: a schedule for the same placement to start from (its order is given to the
            solver as a hint; the result is never worse than it). It must split every backward.
        time_limit: wall-clock seconds for the solver.
        workers: CP-SAT search workers.
        seed: CP-SAT random seed.

    Raises:
        ScheduleError: bad input, a warm start that does not fit, or no solution within the limit.
    """
    try:
        from ortools.sat.python import cp_model
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ScheduleError("the exact solver needs OR-Tools: pip install ortools") from e
    s2r = list(stage_to_rank)
    m = num_microbatches
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise ScheduleError(f"num_microbatches must be an integer >= 1, got {m!r}")
    if not s2r or min(s2r) < 0 or set(s2r) != set(range(max(s2r) + 1)):
        raise ScheduleError(f"stage_to_rank {s2r} must place stages on ranks 0..p-1, each rank used")
    if not isinstance(costs, CostModel):
        raise ScheduleError(f"costs must be a CostModel, got {type(costs).__name__}")
    if time_limit is None or not time_limit > 0:
        raise ScheduleError(f"time_limit must be > 0 seconds, got {time_limit!r}")
    n, p = len(s2r), max(s2r) + 1
    limit = costs.memory_limit if memory_limit is None else memory_limit
    sc: StageCosts = costs.with_limit(limit).resolve(n)
    if sc.memory_limit is not None:
        # a rank holds every one of its chunks' activations of a microbatch when that
        # microbatch's last local forward runs (its backwards come after the turn-around)
        need = [sum(sc.mem_b[s] for s in range(n) if s2r[s] == r) for r in range(p)]
        worst = max(range(p), key=lambda r: need[r])
        if need[worst] > sc.memory_limit * (1 + 1e-12) + 1e-12:
            raise ScheduleError(f"memory_limit {sc.memory_limit:g} is below the minimum {need[worst]:g}: rank {worst} "
                                f"must hold the activations of all its stages for one microbatch at once")

    warm_ms = None
    if warm_start is not None:
        if list(warm_start.stage_to_rank) != s2r or warm_start.num_microbatches != m:
            raise ScheduleError("the warm start has another placement or microbatch count")
        if any(a.op == "BW" for _, _, a in warm_start.actions()):
            raise ScheduleError("the warm start must split every backward into B and W")
        warm_start = warm_start.compute_only()
        warm_res = simulate(warm_start, sc)          # raises if it does not fit the limit
        warm_ms = warm_res.makespan

    # ---------------------------------------------------------------- integer data
    tscale, exact_t = _scale(list(sc.t_f) + list(sc.t_b) + list(sc.t_w) + [sc.t_comm])
    dur = {op: [int(round(v * tscale)) for v in vals] for op, vals in (("F", sc.t_f), ("B", sc.t_b), ("W", sc.t_w))}
    comm = int(round(sc.t_comm * tscale))
    use_mem = sc.memory_limit is not None and math.isfinite(sc.memory_limit)
    if use_mem:
        mscale = _mem_scale(list(sc.mem_b) + list(sc.mem_w) + [sc.memory_limit])
        mb = [int(round(v * mscale)) for v in sc.mem_b]
        mw = [int(round(v * mscale)) for v in sc.mem_w]
        mem_cap = int(math.floor(sc.memory_limit * mscale + 1e-6))
        delta = {"F": mb, "B": [w - b for b, w in zip(mb, mw)], "W": [-w for w in mw]}

    acts = [(op, i, s) for s in range(n) for i in range(m) for op in ("F", "B", "W")]
    deps: dict[tuple, list[tuple]] = {}
    for op, i, s in acts:
        if op == "F":
            deps[(op, i, s)] = [("F", i, s - 1)] if s > 0 else []
        elif op == "B":
            deps[(op, i, s)] = [("F", i, s)] + ([("B", i, s + 1)] if s < n - 1 else [])
        else:
            deps[(op, i, s)] = [("B", i, s)]
    # transitive predecessors (over all ranks), to prune impossible arcs; the symmetry edges
    # (stage-0 forwards in microbatch order) are included
    edges = {a: list(deps[a]) for a in acts}
    for i in range(1, m):
        edges[("F", i, 0)].append(("F", i - 1, 0))
    preds: dict[tuple, frozenset] = {}
    indeg = {a: len(edges[a]) for a in acts}
    users: dict[tuple, list] = {a: [] for a in acts}
    for a in acts:
        for d in edges[a]:
            users[d].append(a)
    todo = [a for a in acts if indeg[a] == 0]
    while todo:
        a = todo.pop()
        ps: set = set()
        for d in edges[a]:
            ps.add(d)
            ps |= preds[d]
        preds[a] = frozenset(ps)
        for u in users[a]:
            indeg[u] -= 1
            if indeg[u] == 0:
                todo.append(u)
    n_cross = sum(1 for a in acts for d in deps[a] if s2r[d[2]] != s2r[a[2]])
    horizon = sum(dur[op][s] for op, _, s in acts) + comm * n_cross + 1

    model = cp_model.CpModel()
    start = {a: model.NewIntVar(0, horizon, f"s{a}") for a in acts}
    end = {a: start[a] + dur[a[0]][a[2]] for a in acts}
    for a in acts:
        op, i, s = a
        r = s2r[s]
        terms = []
        for d in deps[a]:
            c = comm if s2r[d[2]] != r else 0
            terms.append(end[d] + c)
            model.Add(start[a] >= end[d] + c)
    for i in range(1, m):
        model.Add(start[("F", i, 0)] >= end[("F", i - 1, 0)])

    rank_acts = [[a for a in acts if s2r[a[2]] == r] for r in range(p)]
    first = [model.NewIntVar(0, horizon, f"first{r}") for r in range(p)]
    last = [model.NewIntVar(0, horizon, f"last{r}") for r in range(p)]
    Z = model.NewIntVar(0, horizon, "Z")
    arcs_of: dict[tuple, dict[tuple | None, object]] = {}
    for r, ra in enumerate(rank_acts):
        model.AddNoOverlap([model.NewIntervalVar(start[a], dur[a[0]][a[2]], end[a], f"iv{a}") for a in ra])
        busy = sum(dur[a[0]][a[2]] for a in ra)
        model.Add(last[r] - first[r] >= busy)
        for a in ra:                                 # redundant, but they tighten the bound on Z
            model.Add(first[r] <= start[a])
            model.Add(last[r] >= end[a])
        model.Add(Z >= last[r] - first[r])
        local = set(ra)
        node = {a: k + 1 for k, a in enumerate(ra)}
        lpreds = {a: preds[a] & local for a in ra}
        lsuccs: dict[tuple, set] = {a: set() for a in ra}
        for a in ra:
            for b in lpreds[a]:
                lsuccs[b].add(a)
        arcs = []
        pe = {a: model.NewIntVar(0, horizon, f"pe{a}") for a in ra}
        memv = {a: model.NewIntVar(0, mem_cap, f"m{a}") for a in ra} if use_mem else {}
        for b in ra:
            arcs_of[b] = {}
            if not lpreds[b]:                        # b may come first
                lit = model.NewBoolVar("")
                arcs.append((0, node[b], lit))
                arcs_of[b][None] = lit
                model.Add(pe[b] == 0).OnlyEnforceIf(lit)
                model.Add(first[r] == start[b]).OnlyEnforceIf(lit)
                if use_mem:
                    model.Add(memv[b] == delta[b[0]][b[2]]).OnlyEnforceIf(lit)
            if not lsuccs[b]:                        # b may come last
                lit = model.NewBoolVar("")
                arcs.append((node[b], 0, lit))
                model.Add(last[r] == end[b]).OnlyEnforceIf(lit)
            for a in ra:
                if a == b or a in lsuccs[b] or b in lpreds[a]:
                    continue                          # b must come before a
                if lpreds[b] & lsuccs[a]:
                    continue                          # something must sit between a and b
                lit = model.NewBoolVar("")
                arcs.append((node[a], node[b], lit))
                arcs_of[b][a] = lit
                model.Add(pe[b] == end[a]).OnlyEnforceIf(lit)
                if use_mem:
                    model.Add(memv[b] == memv[a] + delta[b[0]][b[2]]).OnlyEnforceIf(lit)
        model.AddCircuit(arcs)
        for b in ra:
            op, i, s = b
            ready = [end[d] + (comm if s2r[d[2]] != r else 0) for d in deps[b]]
            model.AddMaxEquality(start[b], ready + [pe[b]])
    model.Minimize(Z)

    # ---------------------------------------------------------------- warm start as a hint
    if warm_start is not None:
        for r, row in enumerate(warm_start.ranks):
            prev = None
            for k, a in enumerate(row):
                key = (a.op, a.mb, a.stage)
                model.AddHint(start[key], int(round(warm_res.start[r][k] * tscale)))
                for src, lit in arcs_of[key].items():
                    model.AddHint(lit, 1 if src == prev else 0)
                prev = key
        model.AddHint(Z, int(round(warm_ms * tscale)))

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit)
    solver.parameters.num_search_workers = max(1, int(workers))
    solver.parameters.random_seed = int(seed)
    t0 = time.perf_counter()
    status = solver.Solve(model)
    wall = time.perf_counter() - t0
    status_name = solver.StatusName(status)
    lb_int = solver.BestObjectiveBound() if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) else 0.0

    best_sched = None
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        ranks = []
        for r, ra in enumerate(rank_acts):
            row = sorted(ra, key=lambda a: (solver.Value(start[a]), solver.Value(end[a])))
            # zero-length actions may share a start time: follow the circuit instead
            succ = {}
            for b in ra:
                for src, lit in arcs_of[b].items():
                    if solver.BooleanValue(lit):
                        succ[src] = b
            chain, cur = [], None
            while cur in succ and len(chain) < len(ra):
                cur = succ[cur]
                chain.append(cur)
            if len(chain) == len(ra):
                row = chain
            ranks.append([Action(op, i, s) for op, i, s in row])
        best_sched = Schedule(m, s2r, ranks, "exact")
    candidates = []
    if best_sched is not None:
        candidates.append(best_sched)
    if warm_start is not None:
        candidates.append(warm_start)
    if not candidates:
        raise ScheduleError(f"the exact solver found no schedule within {time_limit:g} s (status {status_name}); "
                            f"give a warm start or more time")
    scored = [(simulate(c, sc).makespan, k, c) for k, c in enumerate(candidates)]
    makespan, _, sched = min(scored, key=lambda x: (round(x[0], 9), x[1]))
    lower = lb_int / tscale
    if not exact_t:
        lower = min(lower, makespan)  # rounded costs: the bound is only approximate
    optimal = status == cp_model.OPTIMAL and exact_t and abs(makespan - lower) <= 1e-6 * max(1.0, makespan)
    gap = 0.0 if optimal else max(0.0, (makespan - lower) / makespan) if makespan > 0 else 0.0
    out = make_schedule(num_microbatches=m, stage_to_rank=s2r, ranks=sched.ranks, name="exact",
                        solver="cp-sat", optimal=optimal, gap=gap, lower_bound=lower, makespan=makespan,
                        status=status_name, warm_start_makespan=warm_ms, exact_costs=exact_t,
                        memory_limit=sc.memory_limit)
    return ExactResult(out, makespan, lower, optimal, gap, warm_ms, status_name, wall, exact_t)


# ---------------------------------------------------------------------------- registered builders
def _check(num_ranks: object, num_microbatches: object, costs: object) -> None:
    if not isinstance(num_ranks, int) or isinstance(num_ranks, bool) or num_ranks < 1:
        raise ScheduleError(f"num_ranks must be an integer >= 1, got {num_ranks!r}")
    if not isinstance(num_microbatches, int) or isinstance(num_microbatches, bool) or num_microbatches < 1:
        raise ScheduleError(f"num_microbatches must be an integer >= 1, got {num_microbatches!r}")
    if not isinstance(costs, CostModel):
        raise ScheduleError(f"costs must be a CostModel, got {type(costs).__name__}")


def _plain_warm_start(p: int, m: int, costs: CostModel, limit: float) -> Schedule:
    try:
        from .greedy import zb_greedy
    except ImportError:
        zb_greedy = None
    if zb_greedy is not None:
        return zb_greedy(num_ranks=p, num_microbatches=m, costs=costs, memory_limit=limit)
    from .handcrafted import zb_h1, zb_h2
    sc = costs.with_limit(limit).resolve(p)
    best = None
    for fn in (zb_h1, zb_h2):
        s = fn(num_ranks=p, num_microbatches=m)
        res = simulate(s, sc, enforce_memory=False)
        if res.max_peak_memory <= limit * (1 + 1e-9) and (best is None or res.makespan < best[0]):
            best = (res.makespan, s)
    if best is None:
        raise ScheduleError(f"memory_limit {limit:g} is below ZB-H1's peak; no plain warm start is available")
    return best[1]


def zb_optimal(*, num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: float | None = None,
               time_limit: float = DEFAULT_TIME_LIMIT) -> Schedule:
    """Minimum-makespan split-backward schedule on the plain placement (small ``p``, ``m``).

    Memory in units of ``costs.mem_b``; default limit ``costs.memory_limit``, else ``p * max(mem_b)``
    (1F1B's peak). Warm start: ``zb_greedy`` (greedy.py) if importable, else the better of ZB-H1
    and ZB-H2 within the limit. ``meta`` holds ``optimal``, ``gap`` and ``lower_bound``.
    """
    _check(num_ranks, num_microbatches, costs)
    p, m = num_ranks, num_microbatches
    if memory_limit is None:
        memory_limit = costs.memory_limit
    if memory_limit is None:
        memory_limit = p * max(costs.resolve(p).mem_b)
    warm = _plain_warm_start(p, m, costs, memory_limit)
    res = solve_exact(stage_to_rank=plain_placement(p), num_microbatches=m, costs=costs,
                      memory_limit=memory_limit, warm_start=warm, time_limit=time_limit)
    res.schedule.name = "zb-optimal"
    return res.schedule


def zbv_optimal(*, num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: float | None = None,
                time_limit: float = DEFAULT_TIME_LIMIT) -> Schedule:
    """Minimum-makespan schedule on the V placement (small ``p``, ``m``), warm-started from ZB-V.

    Memory in units of ``costs.mem_b`` (one chunk's ``M_B``); default as :func:`~.vshape.zbv`
    (``p * M``, 1F1B's peak). ``meta`` holds ``optimal``, ``gap`` and ``lower_bound``.
    """
    from .vshape import zbv
    _check(num_ranks, num_microbatches, costs)
    warm = zbv(num_ranks=num_ranks, num_microbatches=num_microbatches, costs=costs, memory_limit=memory_limit)
    res = solve_exact(stage_to_rank=v_placement(num_ranks), num_microbatches=num_microbatches, costs=costs,
                      memory_limit=warm.meta["memory_limit"], warm_start=warm, time_limit=time_limit)
    res.schedule.name = "zbv-optimal"
    return res.schedule


def _builder(fn, placement: str):
    def build(*, num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: float | None = None,
              num_chunks: int = 2, **_: object) -> Schedule:
        if placement == "v" and num_chunks != 2:
            raise ScheduleError(f"the V placement has exactly 2 chunks per rank; got {num_chunks!r}")
        return fn(num_ranks=num_ranks, num_microbatches=num_microbatches, costs=costs, memory_limit=memory_limit)
    return build


register(ScheduleSpec("zb-optimal", "exact minimum-makespan schedule (CP-SAT), plain placement, small p and m",
                      "plain", True, True, _builder(zb_optimal, "plain")))
register(ScheduleSpec("zbv-optimal", "exact minimum-makespan schedule (CP-SAT), V placement, small p and m",
                      "v", True, True, _builder(zbv_optimal, "v")))

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
  simulator's per-rank prefix sums (``F`` adds ``mem_b``, ``B`` adds ``mem_w - mem_b`` -- frees, or
  allocates when ``mem_w > mem_b``, so the limit binds after a ``B`` too --, ``W`` frees ``mem_w``);
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

The dependency rule and the durations and memory deltas come from the timing kernel
(:func:`~..timing.inputs`, :meth:`~..costs.StageCosts.duration`, :meth:`~..costs.StageCosts.memory_delta`),
scaled to integers.

Registered names: ``zb-optimal`` (plain placement; warm start from
:func:`~.greedy.zb_greedy`) and ``zbv-optimal`` (V placement; warm start from :func:`~.vshape.zbv`).
Meant for small instances (``p <= 4``, ``m <= 8``); larger ones run until the time limit and return the best order found (never worse than the warm
start), with ``optimal=False`` and the proven gap.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Sequence

from ..catalog import register
from ..costs import CostModel, StageCosts
from ..ir import Op, Placement, Schedule, ScheduleError, make_schedule, plain_placement, v_placement
from ..limits import check_minimum, resolve_limit, slack_ceiling
from ..simulator import simulate
from ..timing import B_CODE, F_CODE, OPS, W_CODE, Code, decode, encode, inputs
from .common import check_cost_model, check_count
from .greedy import DEFAULT_LIMIT_IN_P, min_memory_limit, zb_greedy
from .vshape import check_v_chunks, zbv

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


@dataclass
class _Problem:
    """The integer data of one instance (times scaled by ``tscale``, memory by a memory scale).

    ``dur[op][s]`` / ``delta[op][s]`` are indexed by kernel op code (F_CODE, B_CODE, W_CODE); ``delta`` is ``None``
    without a finite memory limit. ``deps[a]`` lists the actions ``a`` waits for.
    """

    s2r: list[int]
    m: int
    tscale: int
    exact_t: bool
    dur: list[list[int]]
    comm: int
    delta: list[list[int]] | None
    mem_cap: int
    acts: list[Code]
    deps: dict[Code, list[Code]]


def _problem(s2r: list[int], m: int, sc: StageCosts) -> _Problem:
    n = len(s2r)
    tscale, exact_t = _scale(list(sc.t_f) + list(sc.t_b) + list(sc.t_w) + [sc.t_comm])
    dur = [[int(round(sc.duration(OPS[op], s) * tscale)) for s in range(n)] for op in (F_CODE, B_CODE, W_CODE)]
    delta, mem_cap = None, 0
    if sc.memory_limit is not None and math.isfinite(sc.memory_limit):
        mscale = _mem_scale(list(sc.mem_b) + list(sc.mem_w) + [sc.memory_limit])
        alloc = [int(round(sc.memory_delta(Op.F, s) * mscale)) for s in range(n)]
        free_w = [int(round(sc.memory_delta(Op.W, s) * mscale)) for s in range(n)]
        # B's share keeps F + B + W summing to exactly zero in integers
        delta = [alloc, [-(a + w) for a, w in zip(alloc, free_w)], free_w]
        mem_cap = int(math.floor(slack_ceiling(sc.memory_limit) * mscale))  # what the simulator accepts
    acts = [(op, i, s) for s in range(n) for i in range(m) for op in (F_CODE, B_CODE, W_CODE)]
    deps = {(op, i, s): [(q_op, i, q) for q_op, q in inputs(op, s, n)] for op, i, s in acts}
    return _Problem(s2r, m, tscale, exact_t, dur, int(round(sc.t_comm * tscale)), delta, mem_cap, acts, deps)


def _predecessors(pb: _Problem) -> dict[Code, frozenset]:
    """Transitive predecessors of every action (over all ranks), the symmetry edges included
    (stage-0 forwards in microbatch order); used to prune impossible arcs."""
    edges = {a: list(pb.deps[a]) for a in pb.acts}
    for i in range(1, pb.m):
        edges[(F_CODE, i, 0)].append((F_CODE, i - 1, 0))
    preds: dict[Code, frozenset] = {}
    indeg = {a: len(edges[a]) for a in pb.acts}
    users: dict[Code, list] = {a: [] for a in pb.acts}
    for a in pb.acts:
        for d in edges[a]:
            users[d].append(a)
    todo = [a for a in pb.acts if indeg[a] == 0]
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
    return preds


@dataclass
class _Model:
    """The CP-SAT model and the variables the caller reads back."""

    model: Any
    start: dict[Code, Any]
    end: dict[Code, Any]
    z: Any
    rank_acts: list[list[Code]]
    arcs_of: dict[Code, dict[Code | None, Any]]


def _build_model(cp_model: Any, pb: _Problem) -> _Model:
    """The model of the module docstring: circuits per rank, ASAP starts, memory along each order."""
    s2r, dur, comm = pb.s2r, pb.dur, pb.comm
    p = max(s2r) + 1
    preds = _predecessors(pb)
    n_cross = sum(1 for a in pb.acts for d in pb.deps[a] if s2r[d[2]] != s2r[a[2]])
    horizon = sum(dur[op][s] for op, _, s in pb.acts) + comm * n_cross + 1

    model = cp_model.CpModel()
    start = {a: model.NewIntVar(0, horizon, f"s{a}") for a in pb.acts}
    end = {a: start[a] + dur[a[0]][a[2]] for a in pb.acts}
    for a in pb.acts:
        for d in pb.deps[a]:
            model.Add(start[a] >= end[d] + (comm if s2r[d[2]] != s2r[a[2]] else 0))
    for i in range(1, pb.m):
        model.Add(start[(F_CODE, i, 0)] >= end[(F_CODE, i - 1, 0)])

    rank_acts = [[a for a in pb.acts if s2r[a[2]] == r] for r in range(p)]
    first = [model.NewIntVar(0, horizon, f"first{r}") for r in range(p)]
    last = [model.NewIntVar(0, horizon, f"last{r}") for r in range(p)]
    z = model.NewIntVar(0, horizon, "Z")
    arcs_of: dict[Code, dict[Code | None, Any]] = {}
    for r, ra in enumerate(rank_acts):
        model.AddNoOverlap([model.NewIntervalVar(start[a], dur[a[0]][a[2]], end[a], f"iv{a}") for a in ra])
        model.Add(last[r] - first[r] >= sum(dur[a[0]][a[2]] for a in ra))
        for a in ra:                                 # redundant, but they tighten the bound on Z
            model.Add(first[r] <= start[a])
            model.Add(last[r] >= end[a])
        model.Add(z >= last[r] - first[r])
        _add_rank_circuit(model, pb, r, ra, preds, start, end, first[r], last[r], horizon, arcs_of)
    model.Minimize(z)
    return _Model(model, start, end, z, rank_acts, arcs_of)


def _add_rank_circuit(model: Any, pb: _Problem, r: int, ra: list[Code], preds: dict[Code, frozenset],
                      start: dict, end: dict, first: Any, last: Any, horizon: int,
                      arcs_of: dict[Code, dict[Code | None, Any]]) -> None:
    """Rank ``r``'s order as a circuit; each action starts at max(its inputs, its predecessor's end)."""
    s2r, comm, delta = pb.s2r, pb.comm, pb.delta
    local = set(ra)
    node = {a: k + 1 for k, a in enumerate(ra)}
    lpreds = {a: preds[a] & local for a in ra}
    lsuccs: dict[Code, set] = {a: set() for a in ra}
    for a in ra:
        for b in lpreds[a]:
            lsuccs[b].add(a)
    arcs = []
    pe = {a: model.NewIntVar(0, horizon, f"pe{a}") for a in ra}
    memv = {a: model.NewIntVar(0, pb.mem_cap, f"m{a}") for a in ra} if delta is not None else {}
    for b in ra:
        arcs_of[b] = {}
        if not lpreds[b]:                        # b may come first
            lit = model.NewBoolVar("")
            arcs.append((0, node[b], lit))
            arcs_of[b][None] = lit
            model.Add(pe[b] == 0).OnlyEnforceIf(lit)
            model.Add(first == start[b]).OnlyEnforceIf(lit)
            if delta is not None:
                model.Add(memv[b] == delta[b[0]][b[2]]).OnlyEnforceIf(lit)
        if not lsuccs[b]:                        # b may come last
            lit = model.NewBoolVar("")
            arcs.append((node[b], 0, lit))
            model.Add(last == end[b]).OnlyEnforceIf(lit)
        for a in ra:
            if a == b or a in lsuccs[b] or b in lpreds[a]:
                continue                          # b must come before a
            if lpreds[b] & lsuccs[a]:
                continue                          # something must sit between a and b
            lit = model.NewBoolVar("")
            arcs.append((node[a], node[b], lit))
            arcs_of[b][a] = lit
            model.Add(pe[b] == end[a]).OnlyEnforceIf(lit)
            if delta is not None:
                model.Add(memv[b] == memv[a] + delta[b[0]][b[2]]).OnlyEnforceIf(lit)
    model.AddCircuit(arcs)
    for b in ra:
        ready = [end[d] + (comm if s2r[d[2]] != r else 0) for d in pb.deps[b]]
        model.AddMaxEquality(start[b], ready + [pe[b]])


def _hint(md: _Model, pb: _Problem, warm_start: Schedule, warm_starts: list[list[float]], warm_ms: float) -> None:
    """Give the warm start's order and times to the solver as a hint."""
    for r, row in enumerate(warm_start.ranks):
        prev = None
        for k, a in enumerate(row):
            key = encode(a)
            md.model.AddHint(md.start[key], int(round(warm_starts[r][k] * pb.tscale)))
            for src, lit in md.arcs_of[key].items():
                md.model.AddHint(lit, 1 if src == prev else 0)
            prev = key
    md.model.AddHint(md.z, int(round(warm_ms * pb.tscale)))


def _solution_orders(solver: Any, md: _Model) -> list[list[Code]]:
    """Each rank's order in the solution (following the circuit, which orders zero-length actions too)."""
    ranks = []
    for ra in md.rank_acts:
        row = sorted(ra, key=lambda a: (solver.Value(md.start[a]), solver.Value(md.end[a])))
        succ = {}
        for b in ra:
            for src, lit in md.arcs_of[b].items():
                if solver.BooleanValue(lit):
                    succ[src] = b
        chain: list[Code] = []
        cur = None
        while cur in succ and len(chain) < len(ra):
            cur = succ[cur]
            chain.append(cur)
        ranks.append(chain if len(chain) == len(ra) else row)
    return ranks


def _check_inputs(s2r: list[int], m: object, costs: object, time_limit: object) -> None:
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise ScheduleError(f"num_microbatches must be an integer >= 1, got {m!r}")
    if not s2r or min(s2r) < 0 or set(s2r) != set(range(max(s2r) + 1)):
        raise ScheduleError(f"stage_to_rank {s2r} must place stages on ranks 0..p-1, each rank used")
    check_cost_model(costs)
    if time_limit is None or not time_limit > 0:  # type: ignore[operator]
        raise ScheduleError(f"time_limit must be > 0 seconds, got {time_limit!r}")


def _check_limit(s2r: list[int], sc: StageCosts) -> None:
    """A rank holds every one of its chunks' activations of a microbatch when that microbatch's last
    local forward runs (its backwards come after the turn-around), and, when a ``B`` allocates, what
    it holds right after that ``B`` (:meth:`~..costs.StageCosts.microbatch_peak`): below that,
    nothing fits."""
    n, p = len(s2r), max(s2r) + 1
    need = [sc.microbatch_peak([s for s in range(n) if s2r[s] == r]) for r in range(p)]
    worst = max(range(p), key=lambda r: need[r])
    check_minimum(sc.memory_limit, need[worst], f"rank {worst} must hold the activations of all its stages for "
                                                 f"one microbatch at once")


def solve_exact(*, stage_to_rank: Sequence[int], num_microbatches: int, costs: CostModel,
                memory_limit: float | None = None, warm_start: Schedule | None = None,
                time_limit: float = DEFAULT_TIME_LIMIT, workers: int = 2, seed: int = 0) -> ExactResult:
    """Minimum-makespan split-backward schedule for any placement (see the module docstring).

    Args:
        stage_to_rank: the placement (e.g. :func:`~megatron_zb.schedules.ir.v_placement`).
        num_microbatches: ``m >= 1``.
        costs: per-stage costs (times in any unit; memory in the unit of ``mem_b``).
        memory_limit: per-rank activation limit (unit of ``mem_b``), resolved by
            :func:`~..limits.resolve_limit`: ``None``: ``costs.memory_limit``, else no limit (``inf``).
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
    _check_inputs(s2r, m, costs, time_limit)
    limit = resolve_limit(memory_limit, costs, math.inf)
    sc: StageCosts = costs.with_limit(limit).resolve(len(s2r))
    _check_limit(s2r, sc)

    warm_ms = None
    if warm_start is not None:
        if list(warm_start.stage_to_rank) != s2r or warm_start.num_microbatches != m:
            raise ScheduleError("the warm start has another placement or microbatch count")
        if any(a.op is Op.BW for _, _, a in warm_start.actions()):
            raise ScheduleError("the warm start must split every backward into B and W")
        warm_start = warm_start.compute_only()
        warm_res = simulate(warm_start, sc)          # raises if it does not fit the limit
        warm_ms = warm_res.makespan

    pb = _problem(s2r, m, sc)
    md = _build_model(cp_model, pb)
    if warm_start is not None:
        _hint(md, pb, warm_start, warm_res.start, warm_ms)

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit)
    solver.parameters.num_search_workers = max(1, int(workers))
    solver.parameters.random_seed = int(seed)
    t0 = time.perf_counter()
    status = solver.Solve(md.model)
    wall = time.perf_counter() - t0
    status_name = solver.StatusName(status)
    solved = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    lb_int = solver.BestObjectiveBound() if solved else 0.0

    candidates = []
    if solved:
        ranks = [[decode(c) for c in row] for row in _solution_orders(solver, md)]
        candidates.append(Schedule(m, s2r, ranks, "exact"))
    if warm_start is not None:
        candidates.append(warm_start)
    if not candidates:
        raise ScheduleError(f"the exact solver found no schedule within {time_limit:g} s (status {status_name}); "
                            f"give a warm start or more time")
    scored = [(simulate(c, sc).makespan, k, c) for k, c in enumerate(candidates)]
    makespan, _, sched = min(scored, key=lambda x: (round(x[0], 9), x[1]))
    lower = lb_int / pb.tscale
    if not pb.exact_t:
        lower = min(lower, makespan)  # rounded costs: the bound is only approximate
    optimal = status == cp_model.OPTIMAL and pb.exact_t and abs(makespan - lower) <= 1e-6 * max(1.0, makespan)
    gap = 0.0 if optimal else max(0.0, (makespan - lower) / makespan) if makespan > 0 else 0.0
    out = make_schedule(num_microbatches=m, stage_to_rank=s2r, ranks=sched.ranks, name="exact",
                        solver="cp-sat", optimal=optimal, gap=gap, lower_bound=lower, makespan=makespan,
                        status=status_name, warm_start_makespan=warm_ms, exact_costs=pb.exact_t,
                        memory_limit=sc.memory_limit)
    return ExactResult(out, makespan, lower, optimal, gap, warm_ms, status_name, wall, pb.exact_t)


# ---------------------------------------------------------------------------- registered builders
def zb_optimal(*, num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: float | None = None,
               time_limit: float = DEFAULT_TIME_LIMIT) -> Schedule:
    """Minimum-makespan split-backward schedule on the plain placement (small ``p``, ``m``).

    Memory in units of ``costs.mem_b``; the limit is resolved by :func:`~..limits.resolve_limit`
    with the ``zb`` name's default, ``p * max(mem_b)`` (1F1B's peak; raised to
    :func:`~.greedy.min_memory_limit` when a ``B`` allocates above it). Warm start:
    :func:`~.greedy.zb_greedy` under the same limit. ``meta`` holds ``optimal``, ``gap`` and
    ``lower_bound``.
    """
    p = check_count("num_ranks", num_ranks)
    m = check_count("num_microbatches", num_microbatches)
    base = check_cost_model(costs).resolve(p)
    default = DEFAULT_LIMIT_IN_P["zb"] * p * max(base.mem_b)
    limit = resolve_limit(memory_limit, costs, default, minimum=min_memory_limit(num_ranks=p, costs=base))
    warm = zb_greedy(num_ranks=p, num_microbatches=m, costs=costs, memory_limit=limit)
    res = solve_exact(stage_to_rank=plain_placement(p), num_microbatches=m, costs=costs,
                      memory_limit=limit, warm_start=warm, time_limit=time_limit)
    res.schedule.name = "zb-optimal"
    return res.schedule


def zbv_optimal(*, num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: float | None = None,
                time_limit: float = DEFAULT_TIME_LIMIT) -> Schedule:
    """Minimum-makespan schedule on the V placement (small ``p``, ``m``), warm-started from ZB-V.

    Memory in units of ``costs.mem_b`` (one chunk's ``M_B``); the limit is :func:`~.vshape.zbv`'s
    (default ``R``, 1F1B's peak: :func:`~.vshape.one_f_one_b_memory`). ``meta`` holds ``optimal``,
    ``gap`` and ``lower_bound``.
    """
    check_count("num_ranks", num_ranks)
    check_count("num_microbatches", num_microbatches)
    check_cost_model(costs)
    warm = zbv(num_ranks=num_ranks, num_microbatches=num_microbatches, costs=costs, memory_limit=memory_limit)
    res = solve_exact(stage_to_rank=v_placement(num_ranks), num_microbatches=num_microbatches, costs=costs,
                      memory_limit=warm.meta["memory_limit"], warm_start=warm, time_limit=time_limit)
    res.schedule.name = "zbv-optimal"
    return res.schedule


_SLOW = "exact CP-SAT solver: minutes beyond small p and m"
"""Why ``megatron-zb plan`` leaves both exact schedules out unless ``--schedules`` names them."""


@register("zb-optimal", "exact minimum-makespan schedule (CP-SAT), plain placement, small p and m",
          placement=Placement.PLAIN, split_backward=True, cost_aware=True, excluded_from_plan=_SLOW)
def _build_zb_optimal(*, num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: float | None,
                      num_chunks: int) -> Schedule:
    return zb_optimal(num_ranks=num_ranks, num_microbatches=num_microbatches, costs=costs, memory_limit=memory_limit)


@register("zbv-optimal", "exact minimum-makespan schedule (CP-SAT), V placement, small p and m",
          placement=Placement.V, split_backward=True, cost_aware=True, excluded_from_plan=_SLOW)
def _build_zbv_optimal(*, num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: float | None,
                       num_chunks: int) -> Schedule:
    check_v_chunks(num_chunks)
    return zbv_optimal(num_ranks=num_ranks, num_microbatches=num_microbatches, costs=costs, memory_limit=memory_limit)

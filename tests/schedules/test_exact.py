"""The exact solver (CP-SAT) against exhaustive search, the heuristics, and bad input."""

from __future__ import annotations

import itertools
import math

import pytest

pytest.importorskip("ortools")

from megatron_zb.schedules import CostModel, Schedule, ScheduleError, simulate, validate  # noqa: E402
from megatron_zb.schedules.generators.exact import solve_exact, zb_optimal, zbv_optimal  # noqa: E402
from megatron_zb.schedules.ir import Action, plain_placement, v_placement  # noqa: E402
from megatron_zb.schedules.registry import build_schedule, schedule_names  # noqa: E402
from megatron_zb.schedules.simulator import DeadlockError, MemoryLimitError  # noqa: E402
from megatron_zb.schedules.generators.vshape import zbv  # noqa: E402

TIME_LIMIT = 60.0   # generous: the tiny cases below are proven optimal in well under a second


# ---------------------------------------------------------------------------- exhaustive search
def _rank_orders(acts: list[tuple[str, int, int]]):
    """Every order of one rank's actions that the IR accepts (F before B before W per (mb, stage))."""
    def rec(placed: list, rest: list):
        if not rest:
            yield list(placed)
            return
        done = set(placed)
        for k, a in enumerate(rest):
            op, i, s = a
            if op == "B" and ("F", i, s) not in done or op == "W" and ("B", i, s) not in done:
                continue
            placed.append(a)
            yield from rec(placed, rest[:k] + rest[k + 1:])
            placed.pop()
    yield from rec([], list(acts))


def brute_force_enumerate(s2r: list[int], m: int, costs: CostModel) -> float:
    """Literally every combination of per-rank orders, each simulated (only for tiny cases)."""
    p = max(s2r) + 1
    per_rank = [[(op, i, s) for s in range(len(s2r)) if s2r[s] == r for i in range(m) for op in "FBW"]
                for r in range(p)]
    options = [list(_rank_orders(acts)) for acts in per_rank]
    best = math.inf
    for combo in itertools.product(*options):
        sched = Schedule(m, s2r, [[Action(*a) for a in row] for row in combo])
        try:
            best = min(best, simulate(sched, costs).makespan)
        except (DeadlockError, MemoryLimitError):
            continue
    return best


def brute_force_search(s2r: list[int], m: int, costs: CostModel, upper: float = math.inf) -> float:
    """Minimum simulated makespan over all valid per-rank orders, by depth-first search.

    The search builds every combination of per-rank orders exactly once: it always extends the
    lowest rank whose last chosen action has started, and starts chosen actions as soon as their
    inputs have finished (the simulator's rule). Prefixes that deadlock or exceed the memory limit
    are dropped, and so are prefixes whose makespan cannot end below the best found (a rank's span
    is at least its current end plus its remaining work minus its first start) or above ``upper``.
    Returns the minimum, or ``inf`` when no order reaches ``upper`` or below.
    """
    sc = costs.resolve(len(s2r))
    n, p = len(s2r), max(s2r) + 1
    lim = math.inf if sc.memory_limit is None else sc.memory_limit + 1e-9
    per_rank = [[(op, i, s) for s in range(n) if s2r[s] == r for i in range(m) for op in "FBW"] for r in range(p)]
    work = [sum(sc.duration(op, s) for op, _, s in acts) for acts in per_rank]

    def deps(a):
        op, i, s = a
        if op == "F":
            return [("F", i, s - 1)] if s > 0 else []
        if op == "B":
            return [("F", i, s)] + ([("B", i, s + 1)] if s < n - 1 else [])
        return [("B", i, s)]

    best = [upper + 1e-6]

    def resolve(st):
        end, clock, first, pend, left = st
        changed = True
        while changed:
            changed = False
            for r in range(p):
                a = pend[r]
                if a is None:
                    continue
                ds = deps(a)
                if any(d not in end for d in ds):
                    continue
                ready = max([end[d] + (sc.t_comm if s2r[d[2]] != r else 0.0) for d in ds], default=0.0)
                t0 = max(clock[r], ready)
                if first[r] is None:
                    first[r] = t0
                clock[r] = t0 + sc.duration(a[0], a[2])
                left[r] -= sc.duration(a[0], a[2])
                end[a] = clock[r]
                pend[r] = None
                changed = True

    def dfs(st, placed, mem):
        resolve(st)
        end, clock, first, pend, left = st
        lb = max((clock[r] + left[r] - first[r]) if first[r] is not None else work[r] for r in range(p))
        if lb >= best[0] - 1e-9:
            return
        r = next((q for q in range(p) if pend[q] is None and len(placed[q]) < len(per_rank[q])), None)
        if r is None:
            if all(len(placed[q]) == len(per_rank[q]) and pend[q] is None for q in range(p)):
                best[0] = min(best[0], max(clock[q] - first[q] for q in range(p)))
            return                                   # otherwise: deadlock
        done = set(placed[r])
        for a in per_rank[r]:
            op, i, s = a
            if a in done or op == "B" and ("F", i, s) not in done or op == "W" and ("B", i, s) not in done:
                continue
            new_mem = mem[r] + sc.memory_delta(op, s)
            if new_mem > lim:
                continue
            st2 = (dict(end), list(clock), list(first), list(pend), list(left))
            st2[3][r] = a
            placed2 = list(placed)
            placed2[r] = placed[r] + [a]
            mem2 = list(mem)
            mem2[r] = new_mem
            dfs(st2, placed2, mem2)

    dfs(({}, [0.0] * p, [None] * p, [None] * p, list(work)), [[] for _ in range(p)], [0.0] * p)
    return best[0] if best[0] <= upper + 1e-9 or upper == math.inf else math.inf


UNEVEN = CostModel(t_f=1.0, t_b=1.5, t_w=0.5, t_comm=0.25, mem_b=1.0)


def test_search_matches_literal_enumeration():
    """The pruned search is itself checked against plain enumeration on the smallest case."""
    for costs in (CostModel(), UNEVEN, UNEVEN.with_limit(1.0)):
        want = brute_force_enumerate([0, 1], 2, costs)
        assert brute_force_search([0, 1], 2, costs) == pytest.approx(want)
        assert brute_force_search([0, 1], 2, costs, upper=want) == pytest.approx(want)
        assert brute_force_search([0, 1], 2, costs, upper=want - 0.25) == math.inf


_COSTS = {
    "unit": CostModel(t_f=1.0, t_b=1.0, t_w=1.0),
    "uneven-limit2": CostModel(t_f=1.0, t_b=1.5, t_w=0.5, t_comm=0.25, mem_b=1.0, memory_limit=2.0),
    "per-stage": CostModel(t_f=[1.0, 2.0, 1.0, 0.5], t_b=[1.0, 2.0, 2.0, 1.0], t_w=[0.5, 1.0, 0.5, 1.0], t_comm=0.5),
    # B allocates (mem_w > mem_b): the limit binds right after a B (plain: two F's hold 2, a B
    # brings that to 2.5, a second B without a W in between to 3); on the V 2.5 is the minimum
    "alloc-b-limit2.5": CostModel(t_f=1.0, t_b=1.5, t_w=0.5, t_comm=0.25, mem_b=1.0, mem_w=1.5, memory_limit=2.5),
}
# every (placement, m, costs) combination except the V with m=3 and per-stage costs, whose
# exhaustive search takes about a minute (the other V cases with m=3 cover that shape)
_CASES = [(pl, m, c) for pl in ("plain", "v") for m in (2, 3) for c in _COSTS
          if not (pl == "v" and m == 3 and c in ("per-stage", "alloc-b-limit2.5"))]


@pytest.mark.parametrize("placement,m,cname", _CASES)
def test_exact_agrees_with_brute_force(placement, m, cname):
    costs = _COSTS[cname]
    p = 2
    s2r = plain_placement(p) if placement == "plain" else v_placement(p)
    if isinstance(costs.t_f, list) and placement == "plain":
        costs = CostModel(t_f=costs.t_f[:2], t_b=costs.t_b[:2], t_w=costs.t_w[:2], t_comm=costs.t_comm)
    res = solve_exact(stage_to_rank=s2r, num_microbatches=m, costs=costs, time_limit=TIME_LIMIT)
    assert res.optimal and res.gap == 0.0
    # exhaustive search for anything at most the solver's makespan: it must find an order with
    # exactly that makespan and none below (bounding by it keeps m = 3 on the V fast)
    assert brute_force_search(s2r, m, costs, upper=res.makespan) == pytest.approx(res.makespan)
    validate(res.schedule)
    sim = simulate(res.schedule, costs)       # within the memory limit, and what the solver claims
    assert sim.makespan == pytest.approx(res.makespan)


@pytest.mark.parametrize("p,m", [(2, 4), (3, 3), (3, 4), (4, 4)])
def test_exact_never_worse_than_heuristics(p, m):
    costs = CostModel(t_f=1.0, t_b=1.3, t_w=0.7, t_comm=0.1)
    v = zbv(num_ranks=p, num_microbatches=m, costs=costs)
    sv = zbv_optimal(num_ranks=p, num_microbatches=m, costs=costs, time_limit=5.0)
    assert sv.meta["makespan"] <= simulate(v, costs).makespan + 1e-9
    assert simulate(sv, costs.with_limit(sv.meta["memory_limit"])).makespan == pytest.approx(sv.meta["makespan"])
    assert sv.meta["lower_bound"] <= sv.meta["makespan"] + 1e-9
    sp = zb_optimal(num_ranks=p, num_microbatches=m, costs=costs, time_limit=5.0)
    warm = sp.meta["warm_start_makespan"]
    assert warm is not None and sp.meta["makespan"] <= warm + 1e-9
    assert simulate(sp, costs.with_limit(p * 1.0)).max_peak_memory <= p + 1e-9


def test_registered_names_build():
    assert {"zb-optimal", "zbv-optimal"} <= set(schedule_names())
    s = build_schedule("zbv-optimal", num_ranks=2, num_microbatches=2)
    assert s.name == "zbv-optimal" and s.stage_to_rank == v_placement(2) and s.meta["optimal"]
    s = build_schedule("zb-optimal", num_ranks=2, num_microbatches=2)
    assert s.name == "zb-optimal" and s.stage_to_rank == plain_placement(2) and s.meta["optimal"]


def test_memory_limit_binds():
    """A tighter limit can only make the optimum slower, and the result respects it."""
    costs = CostModel()
    loose = solve_exact(stage_to_rank=v_placement(2), num_microbatches=3, costs=costs, time_limit=TIME_LIMIT)
    tight = solve_exact(stage_to_rank=v_placement(2), num_microbatches=3, costs=costs, memory_limit=2.0,
                        time_limit=TIME_LIMIT)
    assert tight.optimal and loose.optimal
    assert tight.makespan > loose.makespan
    assert simulate(tight.schedule, costs.with_limit(2.0)).max_peak_memory <= 2.0 + 1e-9


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_microbatches=0), "num_microbatches"),
    (dict(memory_limit=1.5), "below"),
    (dict(time_limit=0), "time_limit"),
    (dict(stage_to_rank=[0, 2]), "stage_to_rank"),
])
def test_bad_input(kwargs, match):
    args = dict(stage_to_rank=v_placement(2), num_microbatches=2, costs=CostModel(), time_limit=5.0)
    args.update(kwargs)
    with pytest.raises(ScheduleError, match=match):
        solve_exact(**args)


def test_bad_warm_start():
    plain = build_schedule("zb-h1", num_ranks=2, num_microbatches=2)
    with pytest.raises(ScheduleError, match="placement"):
        solve_exact(stage_to_rank=v_placement(2), num_microbatches=2, costs=CostModel(), warm_start=plain)
    fused = build_schedule("1f1b", num_ranks=2, num_microbatches=2)
    with pytest.raises(ScheduleError, match="split"):
        solve_exact(stage_to_rank=plain_placement(2), num_microbatches=2, costs=CostModel(), warm_start=fused)
    with pytest.raises(ScheduleError, match="V placement"):
        build_schedule("zbv-optimal", num_ranks=2, num_microbatches=2, num_chunks=3)

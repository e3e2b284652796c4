"""Tests of the automatic zero-bubble scheduler (megatron_zb.schedules.generators.greedy)."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_zb.schedules import CostModel, ScheduleError, lower, simulate, validate
from megatron_zb.schedules.generators.greedy import run_variant, to_schedule, variants, min_memory_limit, zb_greedy
from megatron_zb.schedules.ir import Action, Schedule

from conftest import paper_rows  # the paper's rows with p and M_W / M_B added

MEM_TOL = 1e-9  # the simulator's own slack when it checks the memory limit


# ---------------------------------------------------------------------------- helpers
def row_costs(row: dict) -> CostModel:
    """Costs of one paper row; memory in units of one stage's M_B."""
    return CostModel(t_f=row["TF"], t_b=row["TB"], t_w=row["TW"], t_comm=row["Tcomm"], mem_b=1.0,
                     mem_w=row["mem_w_ratio"])


def paper_bubble(res) -> float:
    """The paper's bubble rate: (cost - m (T_F + T_B + T_W)) / cost, cost = longest per-rank span."""
    cost = max(e[-1] - s[0] for s, e in zip(res.start, res.end))
    return (cost - max(res.busy)) / cost


def one_f_one_b(p: int, m: int) -> Schedule:
    """Reference 1F1B: rank r runs min(p-1-r, m) warm-up F's, then F/BW pairs, then the BW cooldown."""
    ranks = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        acts = [Action("F", i, r) for i in range(warm)]
        nf = warm
        for i in range(m):
            if nf < m:
                acts.append(Action("F", nf, r))
                nf += 1
            acts.append(Action("BW", i, r))
        ranks.append(acts)
    return Schedule(m, list(range(p)), ranks, "1f1b")


def check(sched: Schedule, costs: CostModel, p: int, m: int, limit: float):
    """Everything every output must satisfy; returns the simulation."""
    validate(sched)
    assert sched.num_ranks == p and sched.num_microbatches == m and sched.stage_to_rank == list(range(p))
    assert {a.op for _, _, a in sched.actions()} <= {"F", "B", "W"}
    res = simulate(sched, costs.with_limit(limit))  # raises on deadlock or when over the limit
    assert max(res.peak_memory) <= limit * (1 + MEM_TOL)
    return res


def rank0_chain_bound(costs: CostModel, p: int, m: int) -> float:
    """A lower bound on rank 0's span (it starts at 0): any stage q cannot start before the first
    forward reaches it, must run m F's and m B's, and its last B must travel back to rank 0, which
    then still runs that microbatch's W."""
    sc = costs.resolve(p)

    def via(q: int) -> float:
        down = sum(sc.t_f[s] + sc.t_comm for s in range(q))
        up = sum(sc.t_b[s] + sc.t_comm for s in range(q))
        return down + m * (sc.t_f[q] + sc.t_b[q]) + up + sc.t_w[0]

    return max(via(q) for q in range(p))


# ---------------------------------------------------------------------------- the paper's rows
@pytest.mark.parametrize("row", paper_rows(), ids=lambda r: f"{r['model']}-m{r['m']}")
@pytest.mark.parametrize("mult, column", [(1, "ZB-1p"), (2, "ZB-2p")])
def test_paper_rows_at_or_below_published_bubble(row, mult, column):
    p, m = row["p"], row["m"]
    costs = row_costs(row)
    limit = mult * p * 1.0
    sched = zb_greedy(num_ranks=p, num_microbatches=m, costs=costs, memory_limit=limit)
    res = check(sched, costs, p, m, limit)
    ours = paper_bubble(res)
    # the paper prints 4 decimals; ours must not be worse at that precision
    assert round(ours, 4) <= row[column], (ours, row[column])
    assert ours < row["1F1B"]
    one = simulate(one_f_one_b(p, m), costs)
    assert res.makespan < one.makespan


def test_paper_2p_m24_reaches_the_lower_bound():
    """1.5B, m=24, ZB-2p: the paper's 0.0433 is the rank-0 chain bound; we must hit it exactly."""
    row = paper_rows()[0]
    assert (row["model"], row["m"]) == ("1.5B", 24)
    p, m = row["p"], row["m"]
    costs = row_costs(row)
    sched = zb_greedy(num_ranks=p, num_microbatches=m, costs=costs, memory_limit=2 * p)
    res = check(sched, costs, p, m, 2 * p)
    bound = rank0_chain_bound(costs, p, m)
    assert res.makespan == pytest.approx(bound, rel=1e-12)
    assert round(paper_bubble(res), 4) == 0.0433


# ---------------------------------------------------------------------------- larger p, uneven, comm
@pytest.mark.parametrize("p, m", [(16, 32), (16, 64), (32, 64)])
def test_larger_pipelines(p, m):
    row = paper_rows()[4]
    costs = row_costs(row)
    one = simulate(one_f_one_b(p, m), costs)
    spans = {}
    for mult in (1, 2):
        sched = zb_greedy(num_ranks=p, num_microbatches=m, costs=costs, memory_limit=mult * p)
        res = check(sched, costs, p, m, mult * p)
        spans[mult] = res.makespan
        bound = max(rank0_chain_bound(costs, p, m), max(res.busy))
    assert spans[1] < 0.95 * one.makespan
    assert spans[2] < spans[1]
    # ZB-2p: within 1 % of a lower bound that ignores memory altogether
    assert spans[2] <= 1.01 * bound


def test_uneven_costs_and_heavy_comm():
    p, m = 12, 40
    costs = CostModel(t_f=[1.0 + 0.1 * (s % 4) for s in range(p)], t_b=[2.0 - 0.05 * s for s in range(p)],
                      t_w=[0.7 + 0.03 * s for s in range(p)], t_comm=2.5,
                      mem_b=[1.0 + 0.2 * (s % 3) for s in range(p)], mem_w=[0.3] * p)
    one = simulate(one_f_one_b(p, m), costs)
    top = 1.4                                   # the largest mem_b
    for mult in (1, 1.5, 2, 4):
        limit = mult * p * top
        sched = zb_greedy(num_ranks=p, num_microbatches=m, costs=costs, memory_limit=limit)
        res = check(sched, costs, p, m, limit)
        assert res.makespan < 0.95 * one.makespan
    # with memory to spare (4p) the long round trips are covered: within 2 % of a lower bound
    assert max(res.peak_memory) < 4 * p * top
    bound = max(rank0_chain_bound(costs, p, m), max(res.busy))
    assert res.makespan <= 1.02 * bound


def test_heavy_comm_fills_the_wait_with_more_forwards():
    """With T_comm = 4 T_F a 1F1B rank idles on every round trip; ZB at 2p hides most of it."""
    p, m = 8, 32
    costs = CostModel(t_f=1.0, t_b=1.0, t_w=1.0, t_comm=4.0, mem_b=1.0)
    one = simulate(one_f_one_b(p, m), costs)
    sched = zb_greedy(num_ranks=p, num_microbatches=m, costs=costs, memory_limit=2 * p)
    res = check(sched, costs, p, m, 2 * p)
    assert paper_bubble(res) < 0.75 * paper_bubble(one)


# ---------------------------------------------------------------------------- memory limit
def test_default_limit_is_2p_then_costs_limit():
    p, m = 4, 10
    costs = CostModel(t_f=1.0, t_b=1.5, t_w=0.5, mem_b=[1.0, 3.0, 2.0, 1.0])
    sched = zb_greedy(num_ranks=p, num_microbatches=m, costs=costs)
    assert sched.meta["memory_limit"] == 2 * p * 3.0
    check(sched, costs, p, m, 2 * p * 3.0)
    sched = zb_greedy(num_ranks=p, num_microbatches=m, costs=costs.with_limit(5.0))
    assert sched.meta["memory_limit"] == 5.0
    assert max(check(sched, costs, p, m, 5.0).peak_memory) > 3.0  # uses the room it was given


def test_unbounded_memory():
    p, m = 4, 12
    costs = CostModel(t_f=1.0, t_b=1.0, t_w=1.0, t_comm=0.5, mem_b=1.0)
    sched = zb_greedy(num_ranks=p, num_microbatches=m, costs=costs, memory_limit=math.inf)
    res = check(sched, costs, p, m, math.inf)
    assert res.makespan <= 1.01 * max(rank0_chain_bound(costs, p, m), max(res.busy))
    # no activation memory at all: the default limit (2p * 0) means "no limit", not "nothing fits"
    free = CostModel(t_f=1.0, t_b=1.0, t_w=1.0, mem_b=0.0)
    sched = zb_greedy(num_ranks=p, num_microbatches=m, costs=free)
    assert sched.meta["memory_limit"] == math.inf
    check(sched, free, p, m, math.inf)


def test_limit_at_the_minimum_runs_one_microbatch_at_a_time():
    p, m = 5, 7
    costs = CostModel(t_f=1.0, t_b=2.0, t_w=1.0, t_comm=0.1, mem_b=[1.0, 2.0, 4.0, 2.0, 1.0], mem_w=0.5)
    assert min_memory_limit(num_ranks=p, costs=costs) == 4.0
    sched = zb_greedy(num_ranks=p, num_microbatches=m, costs=costs, memory_limit=4.0)
    res = check(sched, costs, p, m, 4.0)
    assert res.peak_memory[2] == 4.0
    ops = [a.op for a in sched.ranks[2]]
    assert ops == ["F", "B", "W"] * m  # stage 2 can never hold a second microbatch


@pytest.mark.parametrize("shortfall", [1e-6, 0.25, 0.999])
def test_limit_below_minimum_raises_and_names_it(shortfall):
    costs = CostModel(t_f=1.0, t_b=1.0, t_w=1.0, mem_b=[2.0, 3.5, 1.0])
    with pytest.raises(ScheduleError, match=r"below the minimum 3\.5"):
        zb_greedy(num_ranks=3, num_microbatches=4, costs=costs, memory_limit=3.5 * (1 - shortfall))


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(num_ranks=0), "num_ranks"),
    (dict(num_ranks=-2), "num_ranks"),
    (dict(num_ranks=2.0), "num_ranks"),
    (dict(num_microbatches=0), "num_microbatches"),
    (dict(num_microbatches=-1), "num_microbatches"),
    (dict(costs=CostModel(t_f=-1.0)), "t_f"),
    (dict(costs=CostModel(t_b=[1.0, -0.5, 1.0])), "t_b"),
    (dict(costs=CostModel(t_w=-0.1)), "t_w"),
    (dict(costs=CostModel(t_comm=-1.0)), "t_comm"),
    (dict(costs=CostModel(mem_b=-1.0)), "mem_b"),
    (dict(costs=CostModel(t_f=[1.0, 1.0])), "t_f"),
    (dict(memory_limit=-4.0), "memory_limit"),
    (dict(memory_limit=float("nan")), "memory_limit"),
    (dict(stage_to_rank=[0, 0, 1]), "plain placement"),
    (dict(stage_to_rank=[0, 1, 2, 2, 1, 0]), "plain placement"),
])
def test_bad_input_raises_schedule_error(kwargs, pattern):
    args = dict(num_ranks=3, num_microbatches=4, costs=CostModel())
    args.update(kwargs)
    with pytest.raises(ScheduleError, match=pattern):
        zb_greedy(**args)


def test_plain_placement_may_be_given_explicitly():
    a = zb_greedy(num_ranks=3, num_microbatches=5, costs=CostModel(t_comm=0.2), stage_to_rank=[0, 1, 2])
    b = zb_greedy(num_ranks=3, num_microbatches=5, costs=CostModel(t_comm=0.2))
    assert a.ranks == b.ranks  # and deterministic


# ---------------------------------------------------------------------------- small cases
@pytest.mark.parametrize("m", [1, 2, 5])
def test_single_rank_is_f_b_w_per_microbatch_without_idle(m):
    costs = CostModel(t_f=1.0, t_b=2.0, t_w=0.5, mem_b=1.0)
    sched = zb_greedy(num_ranks=1, num_microbatches=m, costs=costs, memory_limit=1.0)
    res = check(sched, costs, 1, m, 1.0)
    assert [(a.op, a.mb) for a in sched.ranks[0]] == [(op, i) for i in range(m) for op in "FBW"]
    assert res.makespan == pytest.approx(3.5 * m)


def test_zero_weight_gradient_time_and_memory():
    p, m = 4, 9
    costs = CostModel(t_f=1.0, t_b=1.2, t_w=0.0, t_comm=0.3, mem_b=1.0, mem_w=0.0)
    sched = zb_greedy(num_ranks=p, num_microbatches=m, costs=costs, memory_limit=p)
    res = check(sched, costs, p, m, p)
    assert res.makespan <= simulate(one_f_one_b(p, m), costs).makespan


def test_output_lowers_to_matching_communication():
    sched = zb_greedy(num_ranks=4, num_microbatches=6, costs=CostModel(t_comm=0.5))
    lowered = lower(sched)
    assert sum(1 for _, _, a in lowered.actions() if not a.is_compute) == 2 * 2 * 3 * 6


# ---------------------------------------------------------------------------- property tests
def _per_stage(draw, p: int, lo: float, hi: float):
    if draw(st.booleans()):
        return draw(st.floats(lo, hi))
    return draw(st.lists(st.floats(lo, hi), min_size=p, max_size=p))


@st.composite
def problems(draw, max_p: int = 16, max_m: int = 64):
    p = draw(st.integers(1, max_p))
    m = draw(st.integers(1, max_m))
    mem_b = _per_stage(draw, p, 0.05, 4.0)
    mem_b_list = [mem_b] * p if isinstance(mem_b, float) else mem_b
    mem_w = None if draw(st.booleans()) else [b * draw(st.floats(0.0, 1.0)) for b in mem_b_list]
    costs = CostModel(t_f=_per_stage(draw, p, 0.05, 5.0), t_b=_per_stage(draw, p, 0.05, 8.0),
                      t_w=_per_stage(draw, p, 0.01, 5.0),
                      t_comm=draw(st.sampled_from([0.0, 0.01, 0.3, 2.0, 10.0])), mem_b=mem_b, mem_w=mem_w)
    need = max(mem_b_list)
    limit = need * draw(st.one_of(st.just(1.0), st.floats(1.0, 3.0), st.floats(1.0, 3.0 * p)))
    return p, m, costs, limit


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_property_valid_within_limit_and_no_worse_than_1f1b(problem):
    p, m, costs, limit = problem
    sched = zb_greedy(num_ranks=p, num_microbatches=m, costs=costs, memory_limit=limit)
    res = check(sched, costs, p, m, limit)
    sc = costs.resolve(p)
    assert res.makespan >= max(res.busy) * (1 - 1e-12)
    if all(min(p - r, m) * sc.mem_b[r] <= limit for r in range(p)):   # 1F1B fits the limit too
        assert res.makespan <= simulate(one_f_one_b(p, m), costs).makespan * (1 + 1e-12)


@settings(max_examples=40, deadline=None)
@given(problems(max_p=8, max_m=24), st.floats(1e-6, 0.99))
def test_property_limit_below_minimum_raises(problem, shortfall):
    p, m, costs, _ = problem
    need = max(costs.resolve(p).mem_b)
    with pytest.raises(ScheduleError, match="minimum " + re.escape(f"{need:g}")):
        zb_greedy(num_ranks=p, num_microbatches=m, costs=costs, memory_limit=need * (1 - shortfall))


@settings(max_examples=25, deadline=None)
@given(problems(max_p=8, max_m=24))
def test_property_scheduler_timing_equals_simulator(problem):
    """The scheduler scores large problems by its own times: they must be the simulator's exactly."""
    p, m, costs, limit = problem
    sc = costs.with_limit(limit).resolve(p)
    for v in variants(sc, m, limit):
        order, makespan, total = run_variant(sc, m, limit, v)
        res = simulate(to_schedule(m, order, v.name), sc)
        assert res.makespan == makespan
        assert max(e[-1] for e in res.end) == total

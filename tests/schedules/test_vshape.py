"""V-shaped schedules (ZB-V, V-Half, V-Min, any limit in between) and interleaved-zb."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_zb.schedules import CostModel, Schedule, ScheduleError, check_lowered, lower, simulate, validate
from megatron_zb.schedules.generators.baselines import interleaved_1f1b, one_f_one_b
from megatron_zb.schedules.generators.interleaved_zb import interleaved_zb
from megatron_zb.schedules.ir import interleaved_placement, v_placement
from megatron_zb.schedules.registry import build_schedule, get_spec
from megatron_zb.schedules.simulator import deadlocks
from megatron_zb.schedules.generators.list_scheduler import Knobs, list_schedule_stats
from megatron_zb.schedules.generators.vshape import (one_f_one_b_memory, v_full_memory, v_half, v_min, v_min_memory,
                                                     v_schedule, zbv)

UNIT = CostModel(t_f=0.5, t_b=0.5, t_w=0.5)          # T = 1 per full stage, 0.5 per chunk
GENERATORS = {"zbv": zbv, "v-half": v_half, "v-min": v_min}


def _check(sched: Schedule, costs: CostModel, limit: float) -> None:
    validate(sched)
    assert sched.stage_to_rank == v_placement(sched.num_ranks)
    assert not deadlocks(sched)
    res = simulate(sched, costs.with_limit(limit))   # raises MemoryLimitError above the limit
    assert res.max_peak_memory <= limit * (1 + 1e-9)
    assert sched.splits_backward
    check_lowered(lower(sched))


# ---------------------------------------------------------------------------- properties
@st.composite
def v_problem(draw):
    p = draw(st.integers(2, 16))
    m = draw(st.integers(1, min(64, 192 // p)))      # bounded size keeps the file fast
    n = 2 * p
    vals = st.sampled_from([0.5, 0.75, 1.0, 1.5, 2.0])
    if draw(st.booleans()):
        costs = CostModel(t_f=draw(vals), t_b=draw(vals), t_w=draw(st.sampled_from([0.0, 0.25, 0.5, 1.0])),
                          t_comm=draw(st.sampled_from([0.0, 0.05, 0.3])))
    else:
        costs = CostModel(t_f=draw(st.lists(vals, min_size=n, max_size=n)),
                          t_b=draw(st.lists(vals, min_size=n, max_size=n)),
                          t_w=draw(st.lists(vals, min_size=n, max_size=n)),
                          t_comm=draw(st.sampled_from([0.0, 0.1])),
                          mem_b=draw(st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=n, max_size=n)))
    return p, m, costs


def _merged_1f1b_costs(p: int, costs: CostModel) -> CostModel:
    """The plain-placement costs of the same model: chunks 2r and 2r+1 form stage r."""
    sc = costs.resolve(2 * p)
    return CostModel(mem_b=[sc.mem_b[2 * r] + sc.mem_b[2 * r + 1] for r in range(p)])


def test_zbv_default_stays_within_1f1b_peak_when_the_last_chunk_is_heavy():
    """A real GPT's last chunk holds the logits: the rank-0 pair is heavier than 1F1B's stage 0."""
    p, m = 4, 12
    mem = [1.2] + [1.0] * (2 * p - 2) + [2.5]          # embedding on chunk 0, logits on the last chunk
    costs = CostModel(t_f=1.0, t_b=1.0, t_w=0.5, mem_b=mem)
    one = simulate(one_f_one_b(num_ranks=p, num_microbatches=m), _merged_1f1b_costs(p, costs))
    assert one.max_peak_memory == pytest.approx(4 * 2.2)
    assert p * v_full_memory(p, costs) > one.max_peak_memory  # the old default (p * M) would exceed it
    for name, frac in (("zbv", 1.0), ("v-half", 0.75)):
        r = simulate(GENERATORS[name](num_ranks=p, num_microbatches=m, costs=costs), costs)
        assert r.max_peak_memory <= frac * one.max_peak_memory + 1e-9


@pytest.mark.parametrize("name", list(GENERATORS))
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prob=v_problem())
def test_v_generators_valid(name, prob):
    p, m, costs = prob
    sched = GENERATORS[name](num_ranks=p, num_microbatches=m, costs=costs)
    _check(sched, costs, sched.meta["memory_limit"])
    frac = {"zbv": p, "v-half": p / 2 + 1, "v-min": p / 3 + 1.5}[name]
    ref = max((p - r) * (costs.resolve(2 * p).mem_b[2 * r] + costs.resolve(2 * p).mem_b[2 * r + 1]) for r in range(p))
    assert ref == pytest.approx(one_f_one_b_memory(p, costs))
    assert sched.meta["memory_limit"] == pytest.approx(max(v_full_memory(p, costs), min(frac, p) / p * ref))
    if name == "zbv":  # never more than 1F1B's peak for the same model (when that is feasible at all)
        one = simulate(one_f_one_b(num_ranks=p, num_microbatches=max(m, p)), _merged_1f1b_costs(p, costs))
        assert one.max_peak_memory == pytest.approx(ref)
        assert simulate(sched, costs).max_peak_memory <= max(ref, v_full_memory(p, costs)) + 1e-9


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prob=v_problem(), where=st.floats(0.0, 1.0))
def test_any_limit_between_min_and_zbv(prob, where):
    p, m, costs = prob
    lo, hi = v_min_memory(p, costs), p * v_full_memory(p, costs)
    limit = lo + where * (hi - lo)
    sched = v_schedule(num_ranks=p, num_microbatches=m, costs=costs, memory_limit=limit)
    _check(sched, costs, limit)


@pytest.mark.parametrize("p", [2, 3, 5, 16])
@pytest.mark.parametrize("m", [1, 2, 7])
def test_minimum_limit_works(p, m):
    costs = CostModel(t_f=1.0, t_b=2.0, t_w=0.5, mem_b=[1.0 + (s % 3) for s in range(2 * p)])
    limit = v_min_memory(p, costs)
    _check(v_schedule(num_ranks=p, num_microbatches=m, costs=costs, memory_limit=limit), costs, limit)


@pytest.mark.parametrize("p,m", [(4, 12), (3, 7), (8, 5)])
def test_engine_times_are_the_simulators(p, m):
    """Without pacing, the list scheduler's own makespan/peak are the simulator's for its order."""
    costs = CostModel(t_f=1.0, t_b=1.3, t_w=0.6, t_comm=0.2)
    sc = costs.resolve(2 * p)
    for knobs in (Knobs(), Knobs(b_pick="early", f_first=True, w_gap=0.0), Knobs(caps=(2,) * p, eager_w=0, b_pick="old")):
        orders, makespan, peak, total = list_schedule_stats(v_placement(p), m, sc, 2.0 * p, knobs)
        res = simulate(Schedule(m, v_placement(p), orders), sc)
        assert res.makespan == pytest.approx(makespan)
        assert res.total_time == pytest.approx(total)
        assert res.max_peak_memory == pytest.approx(peak)


def test_bubble_falls_as_limit_rises():
    """Monotone within heuristic noise: never more than 1% of the makespan worse than a lower limit."""
    p, m = 6, 18
    prev = None
    for half_steps in range(2, 2 * p + 1):
        limit = half_steps            # chunk units: half a full-stage activation per step
        res = simulate(v_schedule(num_ranks=p, num_microbatches=m, costs=UNIT, memory_limit=limit), UNIT)
        if prev is not None:
            assert res.makespan <= prev * 1.01
            prev = min(prev, res.makespan)
        else:
            prev = res.makespan
    assert prev == pytest.approx(3 * m)   # zero bubble (span metric) at 1F1B's memory


# ---------------------------------------------------------------------------- unit-cost targets
@pytest.mark.parametrize("p", [4, 8, 16])
def test_unit_cost_targets(p):
    m = 3 * p
    one = simulate(one_f_one_b(num_ranks=p, num_microbatches=m), CostModel())
    bound = (p - 1) * 0.5 / ((p - 1) * 0.5 + 3 * m)
    r = simulate(zbv(num_ranks=p, num_microbatches=m, costs=UNIT), UNIT)
    iso = (r.total_time - max(r.busy)) / r.total_time
    assert iso <= bound + 1e-9 and r.bubble_rate <= bound + 1e-9
    assert r.max_peak_memory <= 2 * p + 1e-9                     # 1F1B's peak, in chunk units
    h = simulate(v_half(num_ranks=p, num_microbatches=m, costs=UNIT), UNIT)
    assert h.bubble_rate <= 0.6 * one.bubble_rate
    assert h.max_peak_memory / 2 <= p / 2 + 1 + 1e-9
    v = simulate(v_min(num_ranks=p, num_microbatches=m, costs=UNIT), UNIT)
    assert v.bubble_rate <= one.bubble_rate + 1e-9
    assert v.max_peak_memory / 2 <= p / 3 + 1.5 + 1e-9


def test_zbv_paper_table8_6b():
    """Zero-bubble paper, Table 8, 6.2B: ZB-V bubble 0.0697 at p=16, m=48 (1F1B's memory)."""
    p, m = 16, 48
    chunk = CostModel(t_f=29.7 / 2, t_b=29.4 / 2, t_w=19.5 / 2, t_comm=0.55)
    r = simulate(zbv(num_ranks=p, num_microbatches=m, costs=chunk), chunk.with_limit(2 * p))
    assert r.bubble_rate <= 0.0697


def test_zbv_paper_costs_beat_1f1b_at_same_memory():
    p, m = 8, 24
    full = CostModel(t_f=29.7, t_b=29.4, t_w=19.5, t_comm=0.55)
    chunk = CostModel(t_f=29.7 / 2, t_b=29.4 / 2, t_w=19.5 / 2, t_comm=0.55)
    one = simulate(one_f_one_b(num_ranks=p, num_microbatches=m), full)
    r = simulate(zbv(num_ranks=p, num_microbatches=m, costs=chunk), chunk)
    assert r.max_peak_memory <= 2 * one.max_peak_memory + 1e-9
    assert r.bubble_rate < 0.3 * one.bubble_rate


# ---------------------------------------------------------------------------- errors and plumbing
def test_limit_below_minimum_states_it():
    costs = CostModel(mem_b=[1.0, 2.0, 3.0, 1.5])   # p = 2: rank 0 holds 1 + 1.5, rank 1 holds 2 + 3
    assert v_min_memory(2, costs) == 5.0
    with pytest.raises(ScheduleError, match=r"below the minimum 5"):
        v_schedule(num_ranks=2, num_microbatches=4, costs=costs, memory_limit=4.9)
    with pytest.raises(ScheduleError, match=r"minimum 2"):
        build_schedule("v-min", num_ranks=4, num_microbatches=4, memory_limit=1.5)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_microbatches=0), "num_microbatches"),
    (dict(num_microbatches=-3), "num_microbatches"),
    (dict(num_ranks=0), "num_ranks"),
    (dict(num_microbatches=2.5), "num_microbatches"),
    (dict(memory_limit=-1.0), "memory_limit"),
    (dict(memory_limit="lots"), "memory_limit"),
    (dict(costs=CostModel(t_f=[1.0] * 3)), "stages"),
    (dict(costs="unit"), "CostModel"),
])
@pytest.mark.parametrize("name", list(GENERATORS))
def test_bad_input(name, kwargs, match):
    args = dict(num_ranks=2, num_microbatches=4, costs=CostModel())
    args.update(kwargs)
    with pytest.raises(ScheduleError, match=match):
        GENERATORS[name](**args)


@pytest.mark.parametrize("chunks", [1, 3, 4])
def test_chunk_count_other_than_two_rejected(chunks):
    with pytest.raises(ScheduleError, match="2 chunks" if chunks != 3 else "odd"):
        build_schedule("zbv", num_ranks=4, num_microbatches=8, num_chunks=chunks)


@pytest.mark.parametrize("name", ["zbv", "v-half", "v-min", "interleaved-zb"])
def test_registered(name):
    spec = get_spec(name)
    assert spec.split_backward and spec.cost_aware
    sched = build_schedule(name, num_ranks=4, num_microbatches=8)
    validate(sched)
    assert sched.name == name
    assert Schedule.from_json(sched.to_json()).ranks == sched.ranks
    assert spec.placement == ("interleaved" if name == "interleaved-zb" else "v")


# ---------------------------------------------------------------------------- interleaved-zb
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=st.integers(2, 8), m=st.integers(1, 24), v=st.integers(1, 4),
       tw=st.sampled_from([0.25, 0.5, 1.0]), comm=st.sampled_from([0.0, 0.1]))
def test_interleaved_zb_valid_and_no_slower(p, m, v, tw, comm):
    costs = CostModel(t_f=1.0, t_b=1.0, t_w=tw, t_comm=comm)
    sched = interleaved_zb(num_ranks=p, num_microbatches=m, costs=costs, num_chunks=v)
    validate(sched)
    assert sched.stage_to_rank == interleaved_placement(p, v)
    base = simulate(interleaved_1f1b(num_ranks=p, num_microbatches=m, num_chunks=v), costs)
    res = simulate(sched, costs.with_limit(base.max_peak_memory))   # same memory as interleaved 1F1B
    assert res.makespan <= base.makespan + 1e-9
    check_lowered(lower(sched))


def test_interleaved_zb_fills_bubbles():
    costs = CostModel()
    base = simulate(interleaved_1f1b(num_ranks=4, num_microbatches=8, num_chunks=2), costs)
    res = simulate(interleaved_zb(num_ranks=4, num_microbatches=8, costs=costs, num_chunks=2), costs)
    assert res.bubble_rate < 0.5 * base.bubble_rate


def test_interleaved_zb_bad_input():
    with pytest.raises(ScheduleError, match="chunks"):
        interleaved_zb(num_ranks=4, num_microbatches=8, costs=CostModel(), num_chunks=0)
    with pytest.raises(ScheduleError, match="minimum 2"):
        interleaved_zb(num_ranks=4, num_microbatches=8, costs=CostModel(), memory_limit=1.0)
    assert math.isfinite(v_full_memory(2, CostModel()))


# ---------------------------------------------------------------------------- the hand-made ZB-V order
def test_handcrafted_zbv_order_is_pytorchs_and_the_paper_pattern():
    """The V family's hand-made candidate (our own code, so no schedule depends on the installed
    torch) is the order PyTorch's ``ScheduleZBVZeroBubble`` builds, for p 1-8 and m 1-20; and at
    unit costs with ``m >= 2p - 1`` it has the paper's zero bubble at ``2p`` chunk units (1F1B's peak)."""
    from megatron_zb.schedules.generators.handcrafted import zbv_handcrafted_order
    from megatron_zb.schedules.torch_import import import_torch_schedule

    for p in range(1, 9):
        for m in range(1, 21):
            ours = zbv_handcrafted_order(p, m)
            assert ours == import_torch_schedule("ScheduleZBVZeroBubble", num_ranks=p, num_microbatches=m).ranks, (p, m)
    p, m = 4, 8
    res = simulate(Schedule(m, v_placement(p), zbv_handcrafted_order(p, m)), CostModel())
    assert res.makespan == 2 * 3 * m             # by hand: 2 chunks x (F, B, W) x m unit actions, no idle time
    assert res.peak_memory == [2.0 * p] * p       # every rank: p microbatches of its 2 chunks

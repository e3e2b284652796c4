"""1F1B, interleaved 1F1B, ZB-H1 and ZB-H2: validity, closed forms, the paper's table."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron_zb.schedules import CostModel, ScheduleError, lower, simulate
from megatron_zb.schedules.generators.baselines import interleaved_1f1b, one_f_one_b
from megatron_zb.schedules.generators.handcrafted import zb_h1, zb_h2
from megatron_zb.schedules.registry import build_schedule, schedule_names

from conftest import paper_costs

cost = st.floats(0.1, 5.0, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 16), m=st.integers(1, 64), tf=cost, tb=cost, tw=cost,
       tcomm=st.floats(0, 2), mw=st.floats(0, 1))
def test_every_generator_validates_and_never_deadlocks(p, m, tf, tb, tw, tcomm, mw):
    cm = CostModel(t_f=tf, t_b=tb, t_w=tw, t_comm=tcomm, mem_w=mw)
    for name, sched, limit in [
        ("1f1b", one_f_one_b(num_ranks=p, num_microbatches=m), p),
        ("zb-h1", zb_h1(num_ranks=p, num_microbatches=m), p),
        ("zb-h2", zb_h2(num_ranks=p, num_microbatches=m), 2 * p - 1),
    ]:
        r = simulate(sched, cm.with_limit(limit))  # validates; raises on deadlock or memory
        assert r.max_peak_memory <= limit + 1e-9, name
        lower(sched)  # every transfer has exactly one send and one receive
    v = 2
    cm_v = CostModel(t_f=tf / v, t_b=tb / v, t_w=tw / v, t_comm=tcomm)
    simulate(interleaved_1f1b(num_ranks=p, num_microbatches=m, num_chunks=v), cm_v)


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 16), m=st.integers(1, 64), tf=cost, tb=cost, tw=cost)
def test_closed_forms(p, m, tf, tb, tw):
    cm = CostModel(t_f=tf, t_b=tb, t_w=tw)
    work = m * (tf + tb + tw)
    r = simulate(one_f_one_b(num_ranks=p, num_microbatches=m), cm)
    assert r.makespan == pytest.approx(work + (p - 1) * (tf + tb + tw))
    assert r.peak_memory == [min(p - k, m) for k in range(p)]
    h1 = simulate(zb_h1(num_ranks=p, num_microbatches=m), cm)
    assert h1.makespan <= r.makespan + 1e-9           # never worse than 1F1B ...
    assert h1.max_peak_memory <= min(p, m) + 1e-9     # ... at 1F1B's peak memory
    h2 = simulate(zb_h2(num_ranks=p, num_microbatches=m), cm)
    assert h2.max_peak_memory <= 2 * p - 1 + 1e-9
    # The paper's closed forms hold in its regime: T_W <= T_F and enough microbatches.
    # Compared as whole makespans, relative to their magnitude (a difference of two ~100-unit
    # sums near 0 carries ~1e-12 of rounding, which an absolute 1e-12 rejects).
    if tw <= tf and m >= p:
        assert h1.makespan == pytest.approx(work + (p - 1) * (tf + tb - tw), rel=1e-9)
    if tw <= tf and m >= 2 * p:
        assert h2.makespan == pytest.approx(work + (p - 1) * max(0.0, tf + tb - 2 * tw), rel=1e-9)


@settings(max_examples=30, deadline=None)
@given(p=st.integers(1, 8), k=st.integers(1, 6), v=st.integers(2, 4))
def test_interleaved_bubble_closed_form(p, k, v):
    m = k * p
    assume(m > p or p == 1)
    r = simulate(interleaved_1f1b(num_ranks=p, num_microbatches=m, num_chunks=v),
                 CostModel(t_f=1 / v, t_b=1 / v, t_w=1 / v))
    assert r.makespan - 3 * m == pytest.approx(3 * (p - 1) / v)


def test_paper_table_1f1b_zbh1_zbh2(paper_row):
    """Zero-bubble paper Table 5 columns reproduced within 0.001 from Table 9's costs."""
    p, m = paper_row["p"], paper_row["m"]
    cm = paper_costs(paper_row)
    for sched, col in [(one_f_one_b(num_ranks=p, num_microbatches=m), "1F1B"),
                       (zb_h1(num_ranks=p, num_microbatches=m), "ZB-H1"),
                       (zb_h2(num_ranks=p, num_microbatches=m), "ZB-H2")]:
        r = simulate(sched, cm)
        assert r.bubble_rate == pytest.approx(paper_row[col], abs=1e-3), col
    assert simulate(zb_h1(num_ranks=p, num_microbatches=m), cm).max_peak_memory == pytest.approx(p)
    assert simulate(zb_h2(num_ranks=p, num_microbatches=m), cm).max_peak_memory == pytest.approx(2 * p - 1)


@pytest.mark.parametrize("bad, match", [
    (dict(num_ranks=0, num_microbatches=4), "pipeline size must be an integer >= 1"),
    (dict(num_ranks=2, num_microbatches=0), "number of microbatches must be an integer >= 1"),
])
def test_bad_shapes_are_rejected(bad, match):
    for name in ("1f1b", "zb-h1", "zb-h2", "interleaved-1f1b"):
        with pytest.raises(ScheduleError, match=match):
            build_schedule(name, **bad)
    with pytest.raises(ScheduleError, match="chunks per rank"):
        interleaved_1f1b(num_ranks=2, num_microbatches=2, num_chunks=0)


def test_unknown_schedule_name_lists_the_known_ones():
    with pytest.raises(ScheduleError, match="unknown schedule 'zb-h3'; choose one of: 1f1b, interleaved-1f1b"):
        build_schedule("zb-h3", num_ranks=2, num_microbatches=2)
    assert {"1f1b", "zb-h1", "zb-h2", "zb"} <= set(schedule_names())

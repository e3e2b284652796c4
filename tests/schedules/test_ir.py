"""The schedule IR: JSON form, validator, lowering."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_zb.schedules import (Action, Schedule, ScheduleError, check_lowered, dump, load, lower,
                                   simulate, validate, CostModel)
from megatron_zb.schedules.generators.baselines import interleaved_1f1b, one_f_one_b
from megatron_zb.schedules.generators.handcrafted import zb_h1, zb_h2
from megatron_zb.schedules.ir import B, BW, F, W

GENERATORS = {
    "1f1b": lambda p, m: one_f_one_b(num_ranks=p, num_microbatches=m),
    "interleaved-1f1b": lambda p, m: interleaved_1f1b(num_ranks=p, num_microbatches=m, num_chunks=2),
    "zb-h1": lambda p, m: zb_h1(num_ranks=p, num_microbatches=m),
    "zb-h2": lambda p, m: zb_h2(num_ranks=p, num_microbatches=m),
}


def two_stage() -> Schedule:
    return Schedule(2, [0, 1], [[F(0, 0), F(1, 0), B(0, 0), W(0, 0), B(1, 0), W(1, 0)],
                                [F(0, 1), B(0, 1), W(0, 1), F(1, 1), B(1, 1), W(1, 1)]])


def test_json_form_is_exactly_the_documented_one(tmp_path):
    s = two_stage()
    d = json.loads(s.to_json())
    assert set(d) == {"num_microbatches", "stage_to_rank", "ranks"}
    assert d["ranks"][0][0] == {"op": "F", "mb": 0, "stage": 0}
    dump(s, tmp_path / "s.json")
    assert load(tmp_path / "s.json").ranks == s.ranks


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(sorted(GENERATORS)), p=st.integers(1, 8), m=st.integers(1, 24))
def test_json_round_trip_including_lowered(name, p, m):
    s = GENERATORS[name](p, m)
    back = Schedule.from_json(s.to_json())
    assert back.ranks == s.ranks and back.stage_to_rank == s.stage_to_rank
    assert back.num_microbatches == s.num_microbatches
    lowered = lower(s)
    assert Schedule.from_json(lowered.to_json()).ranks == lowered.ranks


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r[1].remove(W(1, 1)), "lacks W(mb=1, stage=1)"),
    (lambda r: r[0].remove(F(1, 0)), "comes before its forward F(mb=1, stage=0)"),
    (lambda r: r[0].insert(0, r[0].pop(r[0].index(W(0, 0)))), "rank 0 action #0: W(mb=0, stage=0) comes before its forward"),
    (lambda r: r[0].insert(3, r[0].pop(r[0].index(W(1, 0)))), "rank 0 action #3: W(mb=1, stage=0) comes before its input-gradient"),
    (lambda r: r[0].append(F(0, 1)), "stage 1 belongs to rank 1"),
    (lambda r: r[0].append(F(5, 0)), "names microbatch 5, but there are 2 microbatches"),
    (lambda r: r[0].append(F(0, 0)), "duplicates rank 0 action #0"),
    (lambda r: r[1].append(BW(0, 1)), "either BW or B+W"),
    (lambda r: r[0].append(F(0, 7)), "names stage 7, but there are 2 stages"),
])
def test_validator_names_the_first_bad_action(mutate, message):
    s = two_stage()
    mutate(s.ranks)
    with pytest.raises(ScheduleError, match=re.escape(message)):
        validate(s)


def test_validator_rejects_bad_shapes():
    with pytest.raises(ScheduleError, match="num_microbatches must be >= 1"):
        validate(Schedule(0, [0], [[]]))
    with pytest.raises(ScheduleError, match="placed on rank 3"):
        validate(Schedule(1, [0, 3], [[F(0, 0), BW(0, 0)], []]))
    with pytest.raises(ScheduleError, match="unknown action op"):
        Action("X", 0, 0)
    with pytest.raises(ScheduleError, match="lacks the key 'ranks'"):
        Schedule.from_dict({"num_microbatches": 1, "stage_to_rank": [0]})


def test_lowering_inserts_matched_sends_and_receives():
    s = lower(two_stage())
    r0 = [str(a) for a in s.ranks[0]]
    assert r0[:2] == ["F(mb=0, stage=0)", "SEND_F(mb=0, stage=0, peer=1)"]
    assert "RECV_B(mb=0, stage=1, peer=1)" in r0
    assert r0.index("RECV_B(mb=0, stage=1, peer=1)") == r0.index("B(mb=0, stage=0)") - 1
    r1 = [str(a) for a in s.ranks[1]]
    assert r1[0] == "RECV_F(mb=0, stage=0, peer=0)"
    assert r1[r1.index("B(mb=0, stage=1)") + 1] == "SEND_B(mb=0, stage=1, peer=0)"
    assert s.compute_only().ranks == two_stage().ranks
    # the simulator ignores communication actions
    assert simulate(s, CostModel()).makespan == simulate(two_stage(), CostModel()).makespan


def test_lowering_needs_no_transfer_between_stages_of_one_rank():
    s = Schedule(1, [0, 0], [[F(0, 0), F(0, 1), BW(0, 1), BW(0, 0)]])
    assert lower(s).ranks == s.ranks


def test_corrupted_lowered_schedule_is_rejected():
    s = lower(two_stage())
    i = next(i for i, a in enumerate(s.ranks[0]) if a.op == "SEND_F")
    s.ranks[0][i] = Action("SEND_F", 0, 0, peer=0)  # a send to the wrong peer
    with pytest.raises(ScheduleError, match="expected exactly one of each"):
        check_lowered(s)
    s = lower(two_stage())
    s.ranks[1] = [a for a in s.ranks[1] if not (a.op == "RECV_F" and a.mb == 1)]  # a lost receive
    with pytest.raises(ScheduleError, match="SEND_F\\(mb=1, stage=0, peer=1\\) has 1 send\\(s\\) and 0 receive"):
        check_lowered(s)

"""ZB-V with vocabulary parallelism (``zbv-vocab-1``, ``zbv-vocab-2``; schedules/generators/vocab_v.py):
the V placement with every rank's IF/S/T/IB, valid (the IR's validators, lowering), deadlock-free in the
simulator, and within the peak memory its module docstring states. No torch."""

from __future__ import annotations

import json

import pytest

from megatron_zb.cli import main
from megatron_zb.schedules import CostModel, Op, ScheduleError, lower, simulate
from megatron_zb.schedules.costs import VocabCosts
from megatron_zb.schedules.ir import Placement, v_placement, validate
from megatron_zb.schedules.lowering import check_lowered
from megatron_zb.schedules.registry import build_schedule, get_spec

NAMES = {"zbv-vocab-1": 2, "zbv-vocab-2": 1}  # name -> all-reduce barriers
SHAPES = [(p, m) for p in (2, 4) for m in (p, 2 * p)]
UNIT = CostModel(t_f=1.0, t_b=1.0, t_w=1.0, mem_b=1.0, mem_w=0.0, vocab=VocabCosts(t_collective=0.1))
"""Uniform chunks, one chunk's M_B = 1, W frees everything B left (M_W = 0), no S memory."""


@pytest.mark.parametrize("name", NAMES)
def test_shape_validity_and_no_deadlock(name):
    spec = get_spec(name)
    assert spec.placement is Placement.V and spec.vocab_parallel and spec.split_backward
    for p, m in SHAPES:
        s = build_schedule(name, num_ranks=p, num_microbatches=m, costs=UNIT)
        assert s.stage_to_rank == v_placement(p) and s.vocab_barriers == NAMES[name]
        validate(s)                                            # the IR's rules, validate_vocab included
        for r, acts in enumerate(s.ranks):
            for op in (Op.IF, Op.S, Op.T, Op.IB):              # every pass of every microbatch, in order
                assert [(a.mb, a.stage) for a in acts if a.op is op] == [(i, r) for i in range(m)], (p, m, r, op)
            for stage in (r, 2 * p - 1 - r):                   # both chunks: each F, B, W once
                for op in (Op.F, Op.B, Op.W):
                    assert sorted(a.mb for a in acts if a.op is op and a.stage == stage) == list(range(m))
        low = lower(s)                                         # the point-to-point form
        check_lowered(low)
        assert low.compute_only().ranks == s.ranks
        res = simulate(s, UNIT)                                # raises DeadlockError on a deadlock
        assert res.makespan > 0


@pytest.mark.parametrize("name", NAMES)
def test_peak_memory_is_at_most_p_plus_barriers_microbatches_per_rank(name):
    """The docstring's ``L = R + barriers * M``: for uniform chunks ``2(p + barriers)`` chunk M_B on
    every rank (zbv: ``2p``); with ``mem_s`` each S whose T has not run holds that much more."""
    b = NAMES[name]
    for p, m in SHAPES + [(4, 16)]:
        res = simulate(build_schedule(name, num_ranks=p, num_microbatches=m, costs=UNIT), UNIT)
        assert max(res.peak_memory) <= 2 * (p + b), (p, m, res.peak_memory)
        assert max(simulate(build_schedule("zbv", num_ranks=p, num_microbatches=m, costs=UNIT), UNIT)
                   .peak_memory) <= 2 * p
    with_s = CostModel(t_f=1.0, t_b=1.0, t_w=1.0, mem_b=1.0, mem_w=0.0,
                       vocab=VocabCosts(t_collective=0.1, mem_s=0.25))
    s = build_schedule(name, num_ranks=4, num_microbatches=8, costs=with_s)
    res = simulate(s, with_s)
    for r in range(4):   # the S's in flight: at most the microbatches between the last stage's F and B
        assert res.peak_memory[r] <= 2 * (4 + b) + 0.25 * 8


def test_explicit_limit_and_refusals():
    tight = build_schedule("zbv-vocab-2", num_ranks=2, num_microbatches=4, costs=UNIT, memory_limit=4.0)
    assert max(simulate(tight, UNIT).peak_memory) <= 4.0
    with pytest.raises(ScheduleError, match="below the minimum 2 for the V placement"):
        build_schedule("zbv-vocab-1", num_ranks=2, num_microbatches=4, costs=UNIT, memory_limit=1.0)
    with pytest.raises(ScheduleError, match="variant must be 1"):
        from megatron_zb.schedules.generators.vocab_v import vocab_zbv
        vocab_zbv(num_ranks=2, num_microbatches=2, variant=3)


def test_cli_draws_and_round_trips(capsys, tmp_path):
    png, out_json = tmp_path / "v.png", tmp_path / "v.json"
    rc = main(["schedule", "--schedule", "zbv-vocab-1", "--pp", "2", "--microbatches", "4",
               "--plot", str(png), "--json", str(out_json)])
    out = capsys.readouterr().out
    assert rc == 0 and "S output layer forward" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert json.loads(out_json.read_text())["vocab_barriers"] == 2

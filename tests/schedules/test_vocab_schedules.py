"""Vocabulary-parallel passes in the schedule IR (issue 24, schedule side): the IR's rules, the timing
kernel's barriers worked by hand, the generators' peak activation memory (the paper's p+2 / p+1
microbatches, counted by hand) and the views (JSON, lowering, text, plot, CLI). No torch."""

from __future__ import annotations

import json

import pytest

from megatron_zb.cli import main
from megatron_zb.schedules import CostModel, Op, Schedule, ScheduleError, lower, simulate
from megatron_zb.schedules.costs import VocabCosts
from megatron_zb.schedules.ir import BW, F, make_schedule, plain_placement, vocab_pass
from megatron_zb.schedules.lowering import check_lowered
from megatron_zb.schedules.registry import build_schedule, get_spec
from megatron_zb.schedules.text import timeline_text

VOCAB_NAMES = ("1f1b-vocab-1", "1f1b-vocab-2", "zb-h1-vocab-1", "zb-h1-vocab-2")


def _tiny(barriers: int) -> Schedule:
    """p=2, m=1, written by hand: each rank IF, F, S, T, BW, IB."""
    ranks = [[vocab_pass(Op.IF, 0, r), F(0, r), vocab_pass(Op.S, 0, r), vocab_pass(Op.T, 0, r), BW(0, r),
              vocab_pass(Op.IB, 0, r)] for r in range(2)]
    return make_schedule(num_microbatches=1, stage_to_rank=plain_placement(2), ranks=ranks, vocab_barriers=barriers)


TINY_COSTS = CostModel(t_f=1.0, t_b=1.0, t_w=1.0, mem_b=1.0,
                       vocab=VocabCosts(t_if=1.0, t_s=[1.0, 2.0], t_t=1.0, t_ib=1.0, t_collective=0.5, mem_s=0.25))


def test_barriers_timed_by_hand_two_barriers():
    # IF 0-1 on both; embedding all-reduce ends 1.5; F(0,0) 1.5-2.5; F(0,1) 2.5-3.5; broadcast ends 4;
    # S: rank 0 4-5, rank 1 4-6 (slower slice); C1 ends 6.5, so both T run 6.5-7.5 (a barrier: rank 0
    # waits for rank 1's S); C2 ends 8; BW(0,1) 8-10; BW(0,0) 10-12; broadcast of dX ends 12.5; IB 12.5-13.5.
    res = simulate(_tiny(2), TINY_COSTS)
    assert res.start == [[0, 1.5, 4, 6.5, 10, 12.5], [0, 2.5, 4, 6.5, 8, 12.5]]
    assert res.total_time == 13.5
    assert res.peak_memory == [1.25, 1.25]   # F's M_B plus S's mem_s until T
    assert res.busy == [7, 8]


def test_barriers_timed_by_hand_one_barrier():
    # As above up to C1 (ends 6.5): the last stage's backward needs only C1, but rank 1 runs T first
    # (6.5-7.5) in its order, so BW(0,1) 7.5-9.5; BW(0,0) 9.5-11.5; IB 12-13.
    res = simulate(_tiny(1), TINY_COSTS)
    assert res.start == [[0, 1.5, 4, 6.5, 9.5, 12], [0, 2.5, 4, 6.5, 7.5, 12]]
    assert res.total_time == 13


def test_one_barrier_lets_the_last_stage_start_before_T():
    ranks = [[vocab_pass(Op.IF, 0, r), F(0, r), vocab_pass(Op.S, 0, r)] + (
        [vocab_pass(Op.T, 0, r), BW(0, r)] if r == 0 else [BW(0, r), vocab_pass(Op.T, 0, r)]) +
        [vocab_pass(Op.IB, 0, r)] for r in range(2)]
    one = make_schedule(num_microbatches=1, stage_to_rank=[0, 1], ranks=ranks, vocab_barriers=1)
    assert simulate(one, TINY_COSTS).start[1][3] == 6.5          # BW(0,1) right after C1
    two = make_schedule(num_microbatches=1, stage_to_rank=[0, 1], ranks=ranks, vocab_barriers=2)
    with pytest.raises(ScheduleError, match="deadlock"):         # BW(0,1) would wait for its own rank's T
        simulate(two, TINY_COSTS)


@pytest.mark.parametrize("name,extra", [("1f1b-vocab-1", 2), ("1f1b-vocab-2", 1),
                                        ("zb-h1-vocab-1", 2), ("zb-h1-vocab-2", 1)])
def test_peak_activation_memory_is_p_plus_barriers(name, extra):
    # mem_s = 0 and M_W = 0 count transformer microbatches between F and B only: rank r holds its
    # warm-up forwards, p - r + extra (p + 2 on rank 0 for Vocab-1, p + 1 for Vocab-2; 1F1B holds p),
    # capped by m.
    costs = CostModel(t_f=1.0, t_b=1.0, t_w=1.0, mem_b=1.0, mem_w=0.0,
                      vocab=VocabCosts(t_collective=0.1))
    for p, m in ((4, 8), (3, 12), (2, 2)):
        res = simulate(build_schedule(name, num_ranks=p, num_microbatches=m, costs=costs), costs)
        assert res.peak_memory == [min(p - r + extra, m) for r in range(p)], (p, m)
    ref = simulate(build_schedule("1f1b", num_ranks=4, num_microbatches=8), costs)
    assert ref.peak_memory == [4, 3, 2, 1]
    if name.startswith("zb-h1"):   # with M_W = 0.5 ZB-H1's r delayed W's each hold 0.5 more
        half = CostModel(mem_b=1.0, mem_w=0.5, vocab=VocabCosts(t_collective=0.1))
        res = simulate(build_schedule(name, num_ranks=4, num_microbatches=8, costs=half), half)
        assert res.peak_memory == [4 - r + extra + 0.5 * r for r in range(4)]


def test_paper_table_p_plus_2_and_p_plus_1_on_rank_0():
    costs = CostModel(vocab=VocabCosts(t_collective=0.2))
    p = 8
    v1 = simulate(build_schedule("1f1b-vocab-1", num_ranks=p, num_microbatches=24, costs=costs), costs)
    v2 = simulate(build_schedule("1f1b-vocab-2", num_ranks=p, num_microbatches=24, costs=costs), costs)
    assert (v1.peak_memory[0], v2.peak_memory[0]) == (10, 9)


def test_every_shape_builds_and_every_pass_runs_once():
    costs = CostModel(t_f=1.0, t_b=1.2, t_w=0.7, t_comm=0.1,
                      vocab=VocabCosts(t_if=0.05, t_s=0.4, t_t=0.6, t_ib=0.05, t_collective=0.2, mem_s=0.1))
    for name in VOCAB_NAMES:
        assert get_spec(name).vocab_parallel and not get_spec("1f1b").vocab_parallel
        for p in (1, 2, 3, 5):
            for m in (1, 2, 4, 7):
                s = build_schedule(name, num_ranks=p, num_microbatches=m, costs=costs)
                assert s.vocab_barriers == (2 if name.endswith("-1") else 1)
                for r, acts in enumerate(s.ranks):
                    for op in (Op.IF, Op.S, Op.T, Op.IB):
                        assert [a.mb for a in acts if a.op is op] == list(range(m)), (name, p, m, r, op)
                simulate(s, costs)


def test_vocab_parallel_beats_the_output_layer_on_the_last_stage():
    # Simulator only: the same per-rank vocabulary work (p slices) on the last/first stage of 1F1B
    # versus spread over the ranks. p=4, m=16: 1F1B's last stage costs 1 + 4*0.5 per F and B.
    p, m = 4, 16
    vc = VocabCosts(t_if=0.05, t_s=0.5, t_t=0.5, t_ib=0.05, t_collective=0.1)
    base = CostModel(t_f=[1, 1, 1, 3], t_b=[1, 1, 1, 3], t_w=[1.2, 1, 1, 1])
    plain = simulate(build_schedule("1f1b", num_ranks=p, num_microbatches=m), base).makespan
    vocab = simulate(build_schedule("1f1b-vocab-1", num_ranks=p, num_microbatches=m, costs=CostModel(vocab=vc)),
                     CostModel(vocab=vc)).makespan
    # 1F1B is bound by its last stage: m * (3 + 3 + 1) = 112 plus the fill; vocab: each rank m * 4.1 busy
    assert plain >= 112 and vocab < 0.7 * plain


def test_validation_names_the_offence():
    good = _tiny(2)
    bad_flag = Schedule(1, [0, 1], good.ranks)
    with pytest.raises(ScheduleError, match="vocab_barriers is 0"):
        make_schedule(num_microbatches=1, stage_to_rank=[0, 1], ranks=bad_flag.ranks)
    with pytest.raises(ScheduleError, match="vocab_barriers is 3"):
        make_schedule(num_microbatches=1, stage_to_rank=[0, 1], ranks=good.ranks, vocab_barriers=3)
    missing = [list(good.ranks[0]), [a for a in good.ranks[1] if a.op is not Op.IB]]
    with pytest.raises(ScheduleError, match=r"rank 1 lacks IB\(mb=0, stage=1\)"):
        make_schedule(num_microbatches=1, stage_to_rank=[0, 1], ranks=missing, vocab_barriers=2)
    t_first = [[vocab_pass(Op.T, 0, 0) if a.op is Op.S else vocab_pass(Op.S, 0, 0) if a.op is Op.T else a
                for a in good.ranks[0]], good.ranks[1]]
    with pytest.raises(ScheduleError, match=r"rank 0 action #2: T\(mb=0, stage=0\) comes before S"):
        make_schedule(num_microbatches=1, stage_to_rank=[0, 1], ranks=t_first, vocab_barriers=2)
    wrong_rank = [[vocab_pass(Op.IF, 0, 1)] + good.ranks[0][1:], good.ranks[1]]
    with pytest.raises(ScheduleError, match="names its rank as stage; expected 0"):
        make_schedule(num_microbatches=1, stage_to_rank=[0, 1], ranks=wrong_rank, vocab_barriers=2)
    with pytest.raises(ScheduleError, match="not a vocabulary pass"):
        vocab_pass(Op.F, 0, 0)
    with pytest.raises(ScheduleError, match="variant must be 1"):
        from megatron_zb.schedules.generators.vocab import vocab_1f1b
        vocab_1f1b(num_ranks=2, num_microbatches=2, variant=3)


def test_json_round_trip_and_lowering():
    s = build_schedule("zb-h1-vocab-2", num_ranks=3, num_microbatches=4)
    d = json.loads(s.to_json())
    assert d["vocab_barriers"] == 1
    back = Schedule.from_json(s.to_json())
    assert back.vocab_barriers == 1 and back.ranks == s.ranks
    assert "vocab_barriers" not in json.loads(build_schedule("zb-h1", num_ranks=3, num_microbatches=4).to_json())
    low = lower(s)
    check_lowered(low)
    assert low.vocab_barriers == 1 and low.compute_only().ranks == s.ranks
    assert simulate(low, CostModel()).total_time == simulate(s, CostModel()).total_time


def test_text_timeline_and_plot_show_the_passes(tmp_path):
    res = simulate(build_schedule("1f1b-vocab-1", num_ranks=2, num_microbatches=3), CostModel())
    text = timeline_text(res, width=200)
    assert "S output layer forward" in text and "E embedding backward" in text
    rows = text.splitlines()[1:]
    assert all(c in row for row in rows for c in "ISTEFX")
    from megatron_zb.schedules.plot import OP_COLORS, plot_timeline
    assert len({OP_COLORS[op] for op in Op if op.is_compute}) == 8   # distinct colours
    png = tmp_path / "v.png"
    plot_timeline(res, png)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_cli_schedule_verb(capsys, tmp_path):
    out_json = tmp_path / "s.json"
    rc = main(["schedule", "--schedule", "1f1b-vocab-2", "--pp", "4", "--microbatches", "8",
               "--json", str(out_json)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "peak memory         5 M_B" in out and "S output layer forward" in out
    assert json.loads(out_json.read_text())["vocab_barriers"] == 1
    rc = main(["simulate", str(out_json), "--no-timeline"])     # the file simulates to the same numbers
    again = capsys.readouterr().out
    assert rc == 0
    line = next(ln for ln in out.splitlines() if ln.startswith("makespan"))
    assert line in again.splitlines()


def test_warm_up_of_p_minus_r_plus_barriers_is_the_smallest_without_extra_bubble():
    # Each barrier can hold the last stage's backward up to one backward of the slowest rank, so the
    # last stage needs `barriers` more forwards in flight; one fewer leaves a bubble, one more gains
    # nothing (it only holds one more microbatch). p=4, m=16, unit transformer costs.
    from megatron_zb.schedules.generators.baselines import one_f_one_b_order
    from megatron_zb.schedules.generators.vocab import place_vocab_passes
    p, m = 4, 16
    costs = CostModel(vocab=VocabCosts(t_if=0.05, t_s=0.5, t_t=0.5, t_ib=0.05, t_collective=0.1))
    for barriers in (1, 2):
        span = {}
        for extra in (barriers - 1, barriers, barriers + 1):
            base = one_f_one_b_order(p, m, warmup=[p - r + extra for r in range(p)])
            ranks = place_vocab_passes(base, plain_placement(p), m, costs, barriers)
            s = make_schedule(num_microbatches=m, stage_to_rank=plain_placement(p), ranks=ranks,
                              vocab_barriers=barriers)
            span[extra] = simulate(s, costs).makespan
        assert span[barriers - 1] > 1.05 * span[barriers], (barriers, span)
        assert span[barriers + 1] >= span[barriers] - 1e-9, (barriers, span)


def test_duration_spread_refuses_vocabulary_passes():
    from megatron_zb.schedules.spread import DurationSpread, simulate_spread
    s = build_schedule("1f1b-vocab-2", num_ranks=2, num_microbatches=2)
    with pytest.raises(ScheduleError, match="not modelled for vocabulary passes"):
        simulate_spread(s, CostModel(), DurationSpread({}))


def test_executing_consumers_refuse_vocabulary_passes_by_name():
    """The runtime (its factory and install), pretrain_gpt_zb.py's --schedule and the PyTorch
    export refuse a schedule with IF/S/T/IB passes, naming it, instead of running the passes as backwards."""
    from megatron_zb.runtime import get_forward_backward_func
    from megatron_zb.schedules.registry import build_schedule
    from megatron_zb.torch_pipelining.export import TorchExportError, to_torch_actions
    from megatron_zb.training.arguments import ArgumentError
    from megatron_zb.training.pretrain import parse_command_line

    sched = build_schedule("1f1b-vocab-1", num_ranks=2, num_microbatches=4)
    with pytest.raises(ValueError, match="'1f1b-vocab-1' holds vocabulary-parallel passes"):
        get_forward_backward_func("1f1b-vocab-1")
    with pytest.raises(ValueError, match="holds vocabulary-parallel passes"):
        get_forward_backward_func(sched)
    with pytest.raises(ValueError, match="holds vocabulary-parallel passes"):
        get_forward_backward_func("1f1b").install(2, 4, schedule=sched)
    with pytest.raises(TorchExportError, match="holds vocabulary-parallel passes"):
        to_torch_actions(sched)
    argv = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 1 "
            "--global-batch-size 4 --train-iters 2 --lr 1e-3 --mock-data --pipeline-model-parallel-size 2 "
            "--schedule 1f1b-vocab-2").split()
    with pytest.raises(ArgumentError, match=r"--schedule: schedule '1f1b-vocab-2' holds vocabulary-parallel"):
        parse_command_line(argv, world_size=2)

"""Importing PyTorch's pipelining schedules into our IR (megatron_zb.schedules.torch_import)."""

from __future__ import annotations

import re
from collections import Counter

import pytest

pytest.importorskip("torch.distributed.pipelining")

from megatron_zb.schedules import CostModel, simulate, validate  # noqa: E402
from megatron_zb.schedules.ir import interleaved_placement, plain_placement, v_placement  # noqa: E402
from megatron_zb.schedules.registry import build_schedule  # noqa: E402
from megatron_zb.schedules.torch_import import (TORCH_SCHEDULES, TorchImportError,  # noqa: E402
                                                repair_1f1b_last_rank, build_torch_order,
                                                convert_pipeline_order, import_torch_schedule,
                                                torch_schedule_names)

SHAPES = [(p, m) for p in (2, 4) for m in (4, 8)]
CLASSES = sorted(TORCH_SCHEDULES)


def _refused_by_pytorch(cls_name: str, p: int, m: int) -> bool:
    """The documented constructor constraints (torch 2.13) for the shapes we test."""
    if cls_name == "Schedule1F1B":
        return m < p
    if cls_name == "ScheduleDualPipeV":
        return m < 2 * p
    if cls_name in ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble"):
        return m % max(1, m // p) != 0
    return False


def test_all_known_classes_present_in_this_torch():
    assert set(torch_schedule_names()) == set(TORCH_SCHEDULES)


@pytest.mark.parametrize("cls_name", CLASSES)
@pytest.mark.parametrize("p,m", SHAPES)
def test_import_validates_or_is_refused_as_documented(cls_name, p, m):
    if _refused_by_pytorch(cls_name, p, m):
        with pytest.raises(TorchImportError, match=rf"PyTorch's {cls_name} refuses p={p}, m={m}"):
            import_torch_schedule(cls_name, num_ranks=p, num_microbatches=m)
        return
    if cls_name == "Schedule1F1B":
        # the documented defect is detected and reported, naming the bad action on the last rank
        with pytest.raises(TorchImportError,
                           match=rf"rank {p - 1} action #1: BW\(mb=0, stage={p - 1}\) comes before its forward"):
            import_torch_schedule(cls_name, num_ranks=p, num_microbatches=m)
        return
    s = import_torch_schedule(cls_name, num_ranks=p, num_microbatches=m)
    validate(s)
    assert s.num_ranks == p and s.num_microbatches == m
    assert "repaired" not in s.meta
    simulate(s, CostModel())  # and it does not deadlock


@pytest.mark.parametrize("p,m", SHAPES)
def test_1f1b_defect_signature_and_repair(p, m):
    order, _ = build_torch_order("Schedule1F1B", num_ranks=p, num_microbatches=m)
    last_fwd = [a.microbatch_index for a in order[p - 1] if a is not None and a.computation_type.name == "FORWARD"]
    assert last_fwd == list(range(1, m + 1))  # the defect: no F(0), and a nonexistent F(m)
    s = import_torch_schedule("Schedule1F1B", num_ranks=p, num_microbatches=m, repair=True)
    validate(s)
    assert "rank %d" % (p - 1) in s.meta["repaired"]
    # the reconstruction is exactly Megatron's 1F1B (our baseline), every rank, every position
    assert s.ranks == build_schedule("1f1b", num_ranks=p, num_microbatches=m).ranks
    # the other ranks are untouched
    raw = convert_pipeline_order(order, num_microbatches=m, stage_to_rank=plain_placement(p))
    assert s.ranks[:-1] == raw.ranks[:-1]


def test_repair_leaves_a_valid_schedule_alone():
    ours = build_schedule("1f1b", num_ranks=4, num_microbatches=8)
    before = [list(r) for r in ours.ranks]
    assert repair_1f1b_last_rank(ours) == ""
    assert ours.ranks == before


def test_repair_only_applies_to_schedule1f1b():
    s = import_torch_schedule("ScheduleGPipe", num_ranks=4, num_microbatches=8, repair=True)
    assert "repaired" not in s.meta


_TORCH_LETTER = {"F": "F", "I": "B", "W": "W", "B": "BW"}


def _expected_from_repr(order: dict, rank: int) -> list[tuple[str, int, int]]:
    """An independent reading of PyTorch's order via its string form ('3I0', '(0F7;7B3)OVERLAP_F_B')."""
    out = []
    for a in order[rank]:
        if a is None:
            continue
        text = str(a)
        parts = text[1:text.index(")")].split(";") if text.startswith("(") else [text]
        for part in parts:
            mt = re.fullmatch(r"(\d+)([FIWB])(\d+)", part)
            if mt:  # REDUCE_GRAD etc. do not match: dropped
                out.append((_TORCH_LETTER[mt.group(2)], int(mt.group(3)), int(mt.group(1))))
    return out


@pytest.mark.parametrize("cls_name", CLASSES)
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
def test_conversion_keeps_per_rank_order_and_kinds(cls_name, p, m):
    if _refused_by_pytorch(cls_name, p, m):
        pytest.skip("PyTorch refuses this shape")
    order, _ = build_torch_order(cls_name, num_ranks=p, num_microbatches=m)
    s = import_torch_schedule(cls_name, num_ranks=p, num_microbatches=m, repair=True)
    for r in range(p):
        got = [(a.op, a.mb, a.stage) for a in s.ranks[r]]
        want = _expected_from_repr(order, r)
        if cls_name == "Schedule1F1B" and r == p - 1:
            want = [(op, mb - 1 if op == "F" else mb, st) for op, mb, st in want]
        assert got == want, f"rank {r}"
        # counts by kind, against PyTorch's enum names (OVERLAP_F_B counted through its sub-actions)
        torch_counts: Counter = Counter()
        for a in order[r]:
            if a is None:
                continue
            for leaf in a.sub_actions or (a,):
                torch_counts[leaf.computation_type.name] += 1
        ours = Counter(a.op for a in s.ranks[r])
        assert ours["F"] == torch_counts["FORWARD"]
        assert ours["B"] == torch_counts["BACKWARD_INPUT"]
        assert ours["W"] == torch_counts["BACKWARD_WEIGHT"]
        assert ours["BW"] == torch_counts["FULL_BACKWARD"]


def test_a_few_positions():
    zbv = import_torch_schedule("ScheduleZBVZeroBubble", num_ranks=2, num_microbatches=4)
    # torch rank 0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 ...
    assert [str(a) for a in zbv.ranks[0][3:6]] == ["F(mb=0, stage=3)", "B(mb=0, stage=3)", "W(mb=0, stage=3)"]
    assert [str(a) for a in zbv.ranks[0][9:11]] == ["F(mb=3, stage=0)", "B(mb=0, stage=0)"]
    # torch rank 1 starts with an idle slot (None), dropped: our first action is its second slot
    assert str(zbv.ranks[1][0]) == "F(mb=0, stage=1)"
    assert zbv.meta["dropped"]["None"] >= 1

    dpv = import_torch_schedule("ScheduleDualPipeV", num_ranks=2, num_microbatches=4)
    # torch rank 0 slot 7 is (0F3;3B1)OVERLAP_F_B -> F(3, stage 0) then BW(1, stage 3), in that order
    assert [str(a) for a in dpv.ranks[0][7:9]] == ["F(mb=3, stage=0)", "BW(mb=1, stage=3)"]
    assert [str(a) for a in dpv.ranks[0][9:11]] == ["F(mb=2, stage=3)", "BW(mb=0, stage=0)"]

    g = import_torch_schedule("ScheduleGPipe", num_ranks=2, num_microbatches=4)
    assert g.meta["dropped"] == {"REDUCE_GRAD": 2}
    assert [a.op for a in g.ranks[1]] == ["F"] * 4 + ["BW"] * 4


@pytest.mark.parametrize("cls_name,placement", [
    ("ScheduleZBVZeroBubble", "v"), ("ScheduleDualPipeV", "v"), ("ScheduleInterleaved1F1B", "interleaved"),
    ("ScheduleInterleavedZeroBubble", "interleaved"), ("ScheduleLoopedBFS", "interleaved"),
    ("Schedule1F1B", "plain"), ("ScheduleGPipe", "plain")])
def test_placement(cls_name, placement):
    s = import_torch_schedule(cls_name, num_ranks=4, num_microbatches=8, repair=True)
    want = {"v": v_placement(4), "interleaved": interleaved_placement(4, 2), "plain": plain_placement(4)}[placement]
    assert s.stage_to_rank == want
    assert s.meta["placement"] == placement


def test_interleaved_takes_num_chunks():
    s = import_torch_schedule("ScheduleInterleavedZeroBubble", num_ranks=2, num_microbatches=4, num_chunks=3)
    assert s.stage_to_rank == interleaved_placement(2, 3)
    validate(s)


# The shared notes' independent measurement (T_F = T_B = T_W per full stage, a V or interleaved
# chunk costs half, M_W = M_B/2, T_comm = 0, m = 3p): bubble rate of one isolated iteration, and
# peak activation memory in units of one full stage's M_B.
NOTES = {
    ("ScheduleZBVZeroBubble", 4): (0.040, 4.0), ("ScheduleZBVZeroBubble", 8): (0.0464, 8.0),
    ("ScheduleDualPipeV", 4): (0.040, 4.5), ("ScheduleDualPipeV", 8): (0.0464, 8.5),
    ("ScheduleInterleavedZeroBubble", 4): (0.040, 4.0), ("ScheduleInterleavedZeroBubble", 8): (0.0464, 8.0),
    ("ScheduleInterleaved1F1B", 4): (0.111, 5.5), ("ScheduleInterleaved1F1B", 8): (0.127, 11.5),
}


@pytest.mark.parametrize("cls_name,p", sorted(NOTES))
def test_simulator_matches_independent_measurement(cls_name, p):
    bubble, peak = NOTES[(cls_name, p)]
    s = import_torch_schedule(cls_name, num_ranks=p, num_microbatches=3 * p)
    r = simulate(s, CostModel(t_f=0.5, t_b=0.5, t_w=0.5, t_comm=0.0, mem_b=0.5, mem_w=0.25))
    isolated = (r.total_time - max(r.busy)) / r.total_time
    assert isolated == pytest.approx(bubble, abs=6e-4)
    assert r.max_peak_memory == pytest.approx(peak)
    # the V lower bound of the notes: the last rank waits for p-1 chunk forwards
    assert r.total_time >= (p - 1) * 0.5 + 3 * 3 * p - 1e-9


def test_zbv_makespan_bubble_is_zero_at_unit_costs():
    # SimResult.bubble_rate uses the largest per-rank span (the paper's cost). ZBV keeps every rank
    # busy from its first to its last action, so that rate is 0; the notes' 0.040 is the isolated
    # iteration's, which also counts the last rank's (p-1)/2 late start.
    s = import_torch_schedule("ScheduleZBVZeroBubble", num_ranks=4, num_microbatches=12)
    r = simulate(s, CostModel(t_f=0.5, t_b=0.5, t_w=0.5, mem_b=0.5))
    assert r.bubble_rate == pytest.approx(0.0, abs=1e-12)
    assert r.total_time == pytest.approx(36 + 1.5)


def test_errors():
    with pytest.raises(TorchImportError, match="unknown PyTorch schedule 'Nope'"):
        import_torch_schedule("Nope", num_ranks=2, num_microbatches=4)
    with pytest.raises(TorchImportError, match="num_microbatches must be an integer >= 1"):
        import_torch_schedule("ScheduleGPipe", num_ranks=2, num_microbatches=0)
    order, _ = build_torch_order("ScheduleDualPipeV", num_ranks=2, num_microbatches=4)
    bad = dict(order)
    overlap = next(a for a in bad[0] if a is not None and a.computation_type.name == "OVERLAP_F_B")
    bad[0] = [overlap._replace(sub_actions=None)]
    with pytest.raises(TorchImportError, match="OVERLAP_F_B without sub-actions"):
        convert_pipeline_order(bad, num_microbatches=4, stage_to_rank=v_placement(2))
    with pytest.raises(TorchImportError, match=r"lacks ranks \[1\]"):
        convert_pipeline_order({0: order[0]}, num_microbatches=4, stage_to_rank=v_placement(2))


def _load_bench():
    import megatron_zb.bench.schedules as bench  # python -m megatron_zb.bench schedules

    return bench


def test_bench_reports_invalid_rows_instead_of_crashing():
    bench = _load_bench()
    st = bench.Setting("unit p=4", 4, 12, 1.0, 1.0, 1.0, 0.0, 0.5)
    rows = bench.run_setting(st, ["1f1b", "zb-h1"], ["Schedule1F1B", "ScheduleZBVZeroBubble"], 0, lambda _: None)
    by_name = {r.name: r for r in rows}
    assert by_name["Schedule1F1B"].bubble is None and "invalid" in by_name["Schedule1F1B"].error
    assert by_name["Schedule1F1B (repaired)"].bubble == pytest.approx(by_name["1f1b"].bubble)
    zbv = by_name["ScheduleZBVZeroBubble"]
    assert zbv.isolated == pytest.approx(0.04) and zbv.peak == pytest.approx(4.0)
    table = bench.render(st, rows)
    assert "| Schedule1F1B | PyTorch | plain | invalid |" in table
    assert "| ScheduleZBVZeroBubble | PyTorch | V | 0.0000 | 0.0400 | 4.00 | zb-h1 (0.0769) | 0.00 |" in table


def test_bench_main_writes_markdown(tmp_path, capsys):
    bench = _load_bench()
    from megatron_zb.schedules.registry import schedule_names
    out = tmp_path / "t.md"
    skip = ",".join(n for n in schedule_names() if n != "1f1b")
    assert bench.main(["--settings", "unit", "--skip", skip, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("`python ")
    assert "### (a) unit costs, p=8, m=24" in text
    assert out.read_text().startswith("`python ")

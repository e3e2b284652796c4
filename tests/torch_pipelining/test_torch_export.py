"""Export of megatron-zb schedules to PyTorch's pipeline runtime (megatron_zb.torch_pipelining.export).

PyTorch 2.13's own functions are the judges: ``_PipelineScheduleRuntime._load_csv`` (which runs
``_validate_schedule`` and the lowering ``_prepare_schedule_with_comms``), ``_validate_schedule``
again for the stage placement, ``_simulate_comms_compute``, and, in the execution test, the
runtime itself on two gloo processes. The expected action lists are not computed by the exporter:
they are our schedule's actions rewritten with PyTorch's documented letters.
"""

from __future__ import annotations

import csv
import time
from functools import partial

import pytest

pytest.importorskip("torch.distributed.pipelining")

import torch  # noqa: E402
from torch.distributed.pipelining import schedules as ts  # noqa: E402
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping  # noqa: E402

from megatron_zb.cli import main as cli_main  # noqa: E402
from megatron_zb.schedules.fusion import AS_WRITTEN, split_all  # noqa: E402
from megatron_zb.schedules.ir import BW, F, Placement, Schedule, make_schedule  # noqa: E402
from megatron_zb.schedules.lowering import lower  # noqa: E402
from megatron_zb.schedules.registry import build_schedule, get_spec, schedule_names  # noqa: E402
from megatron_zb.schedules.torch_import import StandInStage  # noqa: E402
from megatron_zb.testing.distributed import run_distributed  # noqa: E402
from megatron_zb.testing.torch_pipelining import LMConfig, reference, run_rank  # noqa: E402
from megatron_zb.torch_pipelining.export import (TorchExportError, check_torch_version, parse_cell,  # noqa: E402
                                                 read_torch_csv, to_torch_actions, torch_csv_text,
                                                 torch_placement, write_torch_csv)

EXACT = ("zb-optimal", "zbv-optimal")  # CP-SAT: small shapes only (their registry description says so)
SHAPES = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p)]
EXACT_SHAPES = [(2, 2), (2, 4), (4, 4)]
PYTORCH_LETTER = {"F": ["F"], "I": ["B"], "W": ["W"], "B": ["B", "W"]}  # PyTorch letter -> our ops (B = I + W)
NOT_SIMULATED = {"UNSHARD", "RESHARD", "REDUCE_GRAD"}  # inserted by the lowering, unknown to the simulator


def _ours_split(s: Schedule) -> list[list[tuple[str, int, int]]]:
    """Every rank's actions as (op, mb, stage), our fused BW written as B then W."""
    return [[(op, a.mb, a.stage) for a in acts for op in (["B", "W"] if a.op == "BW" else [a.op.value])]
            for acts in s.ranks]


def _torch_split(order: dict) -> list[list[tuple[str, int, int]]]:
    """PyTorch's per-rank actions as (our op, mb, stage) by the documented letters (its B = our B + W)."""
    return [[(op, a.microbatch_index, a.stage_index) for a in order[r] for op in PYTORCH_LETTER[a.computation_type.value]]
            for r in sorted(order)]


def _runtime(s: Schedule) -> ts._PipelineScheduleRuntime:
    """PyTorch's runtime on stand-in stages (the four attributes its constructor reads; no process group)."""
    p, n = s.num_ranks, s.num_stages
    return ts._PipelineScheduleRuntime([StandInStage(n, p) for _ in range(n // p)], s.num_microbatches)


def _check_in_pytorch(s: Schedule, path) -> None:
    """Our CSV goes through PyTorch's own loading, validation, lowering and simulator unchanged."""
    p, n, m = s.num_ranks, s.num_stages, s.num_microbatches
    write_torch_csv(s, path)
    rt = _runtime(s)
    rt._load_csv(str(path), format="compute_only")  # _validate_schedule + _prepare_schedule_with_comms
    style = "v" if get_spec(s.name).placement is Placement.V else "loop"
    mapping = ts._validate_schedule(rt.pipeline_order, p, n, m)
    assert mapping == generate_stage_to_rank_mapping(p, n, style=style) == rt.stage_index_to_group_rank
    assert _torch_split(rt.pipeline_order) == _ours_split(s)  # exactly our order, every rank
    for acts in rt.pipeline_order.values():  # an I directly followed by its own W was written as B
        assert not any(a.computation_type.value == "I" and b == ts._Action(a.stage_index, ts.W, a.microbatch_index)
                       for a, b in zip(acts, acts[1:]))
    lowered = rt.pipeline_order_with_comms
    assert sum(a.computation_type.value in ("SEND_F", "SEND_B") for acts in lowered.values() for a in acts) > 0
    ts._simulate_comms_compute({r: [a for a in acts if a.computation_type.value not in NOT_SIMULATED]
                                for r, acts in lowered.items()}, lambda i: mapping[i], n)


@pytest.mark.parametrize("name", [n for n in schedule_names() if not get_spec(n).vocab_parallel])
def test_every_family_passes_pytorchs_checks(name, tmp_path):
    for p, m in (EXACT_SHAPES if name in EXACT else SHAPES):
        s = build_schedule(name, num_ranks=p, num_microbatches=m)
        _check_in_pytorch(s, tmp_path / f"{name}-p{p}-m{m}.csv")


def test_interleaved_with_three_chunks(tmp_path):
    for name in ("interleaved-1f1b", "interleaved-zb"):
        s = build_schedule(name, num_ranks=4, num_microbatches=8, num_chunks=3)
        assert s.num_stages == 12
        _check_in_pytorch(s, tmp_path / f"{name}.csv")
        assert torch_placement(s).stages_per_rank == 3


def test_placement_names_pytorchs_classes():
    by_name = {n: torch_placement(build_schedule(n, num_ranks=4, num_microbatches=8))
               for n in ("1f1b", "interleaved-zb", "zbv")}
    assert (by_name["1f1b"].style, by_name["1f1b"].stages_per_rank) == ("loop", 1)
    assert set(by_name["1f1b"].torch_classes) == {"Schedule1F1B", "ScheduleGPipe"}
    assert (by_name["interleaved-zb"].style, by_name["interleaved-zb"].stages_per_rank) == ("loop", 2)
    assert "ScheduleInterleavedZeroBubble" in by_name["interleaved-zb"].torch_classes
    assert (by_name["zbv"].style, by_name["zbv"].stages_per_rank) == ("v", 2)
    assert set(by_name["zbv"].torch_classes) == {"ScheduleZBVZeroBubble", "ScheduleDualPipeV"}


def test_a_schedule_written_as_it_runs_keeps_adjacent_i_and_w_apart():
    """Unmarked, an I directly followed by its W is written as one fused B; marked as written as it runs
    (what ``auto``'s split_where_faster returns), the same pair is written as PyTorch's I and W."""
    from megatron_zb.schedules.ir import B, W

    s = Schedule(1, [0, 1], [[F(0, 0), BW(0, 0)], [F(0, 1), B(0, 1), W(0, 1)]])
    assert [str(a) for a in to_torch_actions(s)[1]] == ["1F0", "1B0"]
    s.meta[AS_WRITTEN] = True
    assert [str(a) for a in to_torch_actions(s)[1]] == ["1F0", "1I0", "1W0"]
    assert [str(a) for a in to_torch_actions(s)[0]] == ["0F0", "0B0"]


def test_cells_are_read_by_full_match(tmp_path):
    # the hazard: PyTorch's parser takes a prefix, so a malformed cell reads as another action
    assert ts._Action.from_str("1F0x") == ts._Action(1, ts.F, 0)
    assert ts._Action.from_str("3I12") == ts._Action(3, ts.I, 12)
    with pytest.raises(TorchExportError, match=r"'1F0x' is not a compute-only action cell"):
        parse_cell("1F0x")
    for bad in ("1F", "F0", "01F0", "1X0", "1 F0", "1F0;2F0"):
        with pytest.raises(TorchExportError):
            parse_cell(bad)
    assert parse_cell("12W31") == ts._Action(12, ts.W, 31)
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0F1\n1F0,1F1x\n")
    with pytest.raises(TorchExportError, match=r"rank 1 cell #1: '1F1x' is not"):
        read_torch_csv(path)
    s = build_schedule("zbv", num_ranks=4, num_microbatches=16)  # two-digit microbatches
    text = torch_csv_text(s)
    assert "15" in text and text.count("\n") == 4
    write_torch_csv(s, tmp_path / "x.csv")
    with open(tmp_path / "x.csv", newline="") as f:  # what PyTorch's _load_csv reads, cell by cell
        theirs = {r: [ts._Action.from_str(c) for c in row] for r, row in enumerate(csv.reader(f))}
    assert read_torch_csv(tmp_path / "x.csv") == theirs
    assert _torch_split(theirs) == _ours_split(s)


def test_refusals():
    with pytest.raises(TorchExportError, match=r"tested with PyTorch 2\.13 only, and this is PyTorch 2\.12\.1: "
                                               r"install torch 2\.13"):
        check_torch_version("2.12.1")
    assert check_torch_version() == str(torch.__version__)
    zb = build_schedule("zb-h1", num_ranks=2, num_microbatches=4)
    with pytest.raises(TorchExportError, match=r"carries send/receive actions.*schedule\.compute_only\(\)"):
        to_torch_actions(lower(zb))
    # a placement PyTorch has no style for: stage 0 on rank 1
    swapped = make_schedule(num_microbatches=1, stage_to_rank=[1, 0], name="swapped",
                            ranks=[[F(0, 1), BW(0, 1)], [F(0, 0), BW(0, 0)]])
    with pytest.raises(TorchExportError, match=r"places stages on ranks as \[1, 0\], which neither of PyTorch's"):
        to_torch_actions(swapped)
    broken = Schedule(2, [0, 1], [[F(0, 0), BW(0, 0)], [F(0, 1), BW(0, 1)]], name="broken")
    with pytest.raises(TorchExportError, match=r"'broken' is not a valid schedule: rank 0 lacks F\(mb=1, stage=0\)"):
        to_torch_actions(broken)


def _run_and_compare(cfg: LMConfig, p: int, m: int, names: tuple[str, ...], csv_names: tuple[str, ...],
                     extra: dict[str, Schedule] | None = None):
    """Run PyTorch's ``Schedule1F1B`` and our ``names`` in PyTorch's runtime on ``p`` gloo processes;
    check every run against the unpipelined model; return the per-rank results and the labels
    checked bitwise against ``Schedule1F1B``. ``extra``: more schedules, by label, loaded with
    ``prepare_runtime``.

    Tolerance against the unpipelined reference: relative 1e-12 per tensor (norm of the
    difference / norm of the reference). The pipeline computes each microbatch's gradient with
    the same operations, but sums the microbatches in its own order and scales by 1/m in place;
    float64 rounding of that is ~m * 2.2e-16 relative, while any real error (a microbatch lost
    or counted twice, a stage's gradient missing) is O(1/m). Against PyTorch's own
    ``Schedule1F1B`` the check is bitwise wherever every stage finishes its weight gradients in
    microbatch order, as 1F1B does (the same sums in the same order).
    """
    sched = {n: build_schedule(n, num_ranks=p, num_microbatches=m) for n in names} | (extra or {})
    runs = [("torch", "Schedule1F1B", "torch")] + [(n, s, "csv" if n in csv_names else "actions")
                                                     for n, s in sched.items()]
    t0 = time.perf_counter()
    res = run_distributed(partial(run_rank, cfg, runs, m), world_size=p, timeout=180,
                          preload=("torch", "torch.distributed", "megatron_zb"))
    print(f"distributed part, {p} processes: {time.perf_counter() - t0:.1f} s")
    ref_losses, ref_grads = reference(cfg, m)
    got = {label: ({k: g for r in res for k, g in r[label]["grads"].items()},
                   [loss for r in res for loss in r[label]["losses"]]) for label, _, _ in runs}
    torch_grads, torch_losses = got["torch"]
    bitwise = set()
    for label, (grads, losses) in got.items():
        assert set(grads) == set(ref_grads), label
        assert len(losses) == m and all(torch.allclose(a, b, rtol=1e-12, atol=0) for a, b in zip(losses, ref_losses))
        for k, g in grads.items():
            assert (g - ref_grads[k]).norm() <= 1e-12 * ref_grads[k].norm(), (label, k)
        if label == "torch":
            continue
        s = sched[label]
        w_order = [[a.mb for a in s.ranks[s.stage_to_rank[st]] if a.stage == st and a.op in ("W", "BW")]
                   for st in range(s.num_stages)]
        if all(o == list(range(m)) for o in w_order):
            assert all(torch.equal(g, torch_grads[k]) for k, g in grads.items()), label
            assert all(torch.equal(a, b) for a, b in zip(losses, torch_losses)), label
            bitwise.add(label)
        kinds = {k for r in res for k in r[label]["kinds"]}
        assert ("I" in kinds and "W" in kinds) == s.splits_backward, (label, kinds)
    return res, bitwise


def test_runs_in_pytorchs_runtime_on_2_processes():
    """A float64 4-layer transformer LM in PyTorch's runtime (``_run_and_compare`` has the tolerances);
    ``zb-h1`` and ``v-half`` loaded from their CSV file as torchtitan does; the V schedule's stages
    built the other way are refused. ``1f1b-v`` (V placement, fused backward) runs with PyTorch's
    ``B`` only; ``zbv`` written as it runs with every ``I`` directly followed by its ``W`` runs them as
    PyTorch's ``I`` and ``W``, never its fused ``B``."""
    apart = split_all(build_schedule("zbv", num_ranks=2, num_microbatches=4))  # every I directly followed by its W
    apart.meta[AS_WRITTEN] = True  # ... and written as it runs: two actions each, not PyTorch's fused B
    res, bitwise = _run_and_compare(LMConfig(), 2, 4, ("1f1b", "zb-h1", "zb-1p", "zb-2p", "zbv", "v-half", "1f1b-v",
                                                       "interleaved-zb"), csv_names=("zb-h1", "v-half"),
                                    extra={"zbv, I and W apart": apart})
    assert {"1f1b", "zb-h1"} <= bitwise  # the same weight-gradient order as 1F1B by construction
    assert all("B" not in r["zbv, I and W apart"]["kinds"] for r in res)
    for r, want in ((0, "[0, 3]"), (1, "[1, 2]")):
        msg = res[r]["refused"]["message"]
        assert f"rank {r} holds stages" in msg and f"places stages {want} on it" in msg and "'v' placement" in msg


def test_runs_in_pytorchs_runtime_on_4_processes():
    """The same at p=4 (8 layers: the V and interleaved schedules have 8 stages of one layer)."""
    res, _ = _run_and_compare(LMConfig(layers=8), 4, 8, ("zb-2p", "zbv", "v-min", "interleaved-zb"),
                              csv_names=("zbv",))
    assert len(res) == 4


# ------------------------------------------------------------------------------ command line
def test_cli_schedule_and_plan_write_the_csv(capsys, tmp_path, monkeypatch):
    out = tmp_path / "zbv.csv"
    rc = cli_main(["schedule", "--schedule", "zbv", "--pp", "2", "--microbatches", "4", "--no-timeline",
                   "--torch-csv", str(out)])
    text, err = capsys.readouterr()
    assert rc == 0, err
    assert f"wrote {out} (--torch-csv: PyTorch stage placement 'v'" in text and "ZBVZeroBubble" in text
    rt = _runtime(build_schedule("zbv", num_ranks=2, num_microbatches=4))
    rt._load_csv(str(out), format="compute_only")
    assert _torch_split(rt.pipeline_order) == _ours_split(build_schedule("zbv", num_ranks=2, num_microbatches=4))

    rc = cli_main(["schedule", "--schedule", "zb-h1", "--pp", "2", "--microbatches", "4", "--no-timeline",
                   "--torch-csv", str(tmp_path / "missing" / "x.csv")])
    _, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith(f"megatron-zb: error: --torch-csv {tmp_path / 'missing' / 'x.csv'}: cannot write")

    with monkeypatch.context() as mp:
        mp.setattr(torch, "__version__", "2.14.0")
        rc = cli_main(["schedule", "--schedule", "zb-h1", "--pp", "2", "--microbatches", "4", "--no-timeline",
                       "--torch-csv", str(tmp_path / "x.csv")])
    _, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1 and not (tmp_path / "x.csv").exists()
    assert "this is PyTorch 2.14.0: install torch 2.13" in err

    plan_csv = tmp_path / "plan.csv"
    rc = cli_main(["plan", "--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8",
                   "--seq-length", "512", "--micro-batch-size", "1", "--vocab-size", "1000", "--bf16",
                   "--pipeline-model-parallel-size", "2", "--num-microbatches", "4", "--gpu", "H100",
                   "--schedules", "1f1b,zb-h1", "--torch-csv", str(plan_csv)])
    text, err = capsys.readouterr()
    assert rc == 0, err
    best = text.split("recommended: ")[1].split()[0]
    assert f"wrote {plan_csv} (--torch-csv: {best}; PyTorch stage placement 'loop'" in text
    rows = plan_csv.read_text().splitlines()
    assert len(rows) == 2 and rows[0].startswith("0F0,")

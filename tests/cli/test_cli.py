"""End-to-end tests of the megatron-zb command line (megatron_zb/cli/)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_zb.cli import Costs, build_and_simulate, main
from megatron_zb.schedules import registry

ROOT = Path(__file__).resolve().parents[2]
NAMES = registry.schedule_names()
PIPELINE_NAMES = [n for n in NAMES if not registry.get_spec(n).vocab_parallel]
"""Schedules without vocabulary passes (those add work per rank: tests/schedules/test_vocab_schedules.py)."""


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def parse_report(out: str) -> dict:
    """The numbers of a schedule/simulate report."""
    def num(key: str) -> float:
        m = re.search(rf"^{key}\s+([0-9.eE+-]+)", out, re.M)
        assert m, f"no {key!r} line in:\n{out}"
        return float(m.group(1))

    rows = re.findall(r"^\s*(\d+)\s+([\d,]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)%\s+([\d.]+)$", out, re.M)
    return dict(bubble=num("bubble rate"), makespan=num("makespan"), total=num("isolated iteration"),
                peak=num("peak memory"), busy=[float(r[2]) for r in rows], peaks=[float(r[5]) for r in rows],
                stages=[r[1] for r in rows])


def assert_one_line_error(rc: int, err: str, *needles: str) -> None:
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("megatron-zb: error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, err)


# ---------------------------------------------------------------------------------- schedule
@pytest.mark.parametrize("name", PIPELINE_NAMES)
def test_every_registered_schedule_runs_and_round_trips_through_json(name, capsys, tmp_path):
    js = tmp_path / f"{name}.json"
    rc, out, err = run(capsys, "schedule", "--schedule", name, "--pp", 3, "--microbatches", 4, "--json", js)
    assert rc == 0, err
    rep = parse_report(out)
    assert 0 <= rep["bubble"] < 1
    assert len(rep["busy"]) == 3
    # every rank does m * (tf + tb + tw) = 12 of work, whatever the placement
    assert rep["busy"] == pytest.approx([12.0] * 3)
    assert rep["makespan"] >= 12
    timeline = [ln for ln in out.splitlines() if re.match(r"rank \d+ \|", ln)]
    assert len(timeline) == 3 and all(ln.endswith("|") for ln in timeline)

    data = json.loads(js.read_text())
    assert set(data) == {"num_microbatches", "stage_to_rank", "ranks"}
    assert data["num_microbatches"] == 4 and len(data["ranks"]) == 3
    assert all(set(a) == {"op", "mb", "stage"} for acts in data["ranks"] for a in acts)

    rc, out2, err = run(capsys, "simulate", js, "--no-timeline")
    assert rc == 0, err
    rep2 = parse_report(out2)
    for key in ("bubble", "makespan", "total", "peak", "peaks", "busy"):
        assert rep2[key] == pytest.approx(rep[key]), key
    assert "lowering: ok" in out2
    assert not any(re.match(r"rank \d+ \|", ln) for ln in out2.splitlines())  # --no-timeline


def test_known_values_of_1f1b_and_zb_h1(capsys):
    # 1F1B: bubble (p-1)(tf+tb+tw) = 9 of 33; ZB-H1: (p-1)(tf+tb-tw) = 3 of 27; both peak p*M_B.
    rc, out, _ = run(capsys, "schedule", "--schedule", "1f1b", "--pp", 4, "--microbatches", 8)
    assert rc == 0
    rep = parse_report(out)
    assert rep["makespan"] == 33 and rep["bubble"] == pytest.approx(9 / 33, abs=1e-4)
    assert rep["peaks"] == [4, 3, 2, 1]
    rc, out, _ = run(capsys, "schedule", "--schedule", "zb-h1", "--pp", 4, "--microbatches", 8,
                     "--mem-b", 2, "--mem-w", 1)
    rep = parse_report(out)
    assert rep["makespan"] == 27 and rep["bubble"] == pytest.approx(3 / 27, abs=1e-4)
    assert rep["peak"] == 8  # p * M_B with M_B = 2


def test_text_timeline_of_1f1b(capsys):
    rc, out, _ = run(capsys, "schedule", "--schedule", "1f1b", "--pp", 2, "--microbatches", 2)
    assert rc == 0
    assert "rank 0 |FF..XX.XX|" in out
    assert "rank 1 |.FXXFXX..|" in out
    rc, out, _ = run(capsys, "schedule", "--schedule", "1f1b", "--pp", 2, "--microbatches", 2,
                     "--timeline-style", "mb", "--width", 18)
    assert "rank 0 |0011....0000..1111|" in out
    assert "rank 1 |..000000111111....|" in out


def test_units_split_a_rank_share_across_its_chunks():
    # interleaved with v chunks: each stage gets 1/v of the time and memory, so a rank's work is
    # the same as 1F1B's, and memory is reported in M_B of a whole rank's share.
    costs = Costs(tf=2, tb=3, tw=1, mem_b=2)
    for v in (2, 3):
        _, res = build_and_simulate("interleaved-1f1b", pp=4, microbatches=8, chunks=v, costs=costs)
        assert res.schedule.num_stages == 4 * v
        assert res.busy == pytest.approx([8 * 6.0] * 4)
        assert res.costs.t_f == pytest.approx((2 / v,) * (4 * v))
    # Megatron's warm-up: rank 0 holds 2(p-1) + (v-1)p + 1 = 11 chunk activations (v=2) = 5.5 stage M_B
    _, res = build_and_simulate("interleaved-1f1b", pp=4, microbatches=8, chunks=2, costs=Costs(mem_b=2))
    assert res.peak_memory[0] == pytest.approx(11 * 2 / 2)


def test_memory_limit_counts_in_chunk_mb_for_interleaved(capsys):
    base = ("schedule", "--schedule", "interleaved-1f1b", "--pp", 4, "--microbatches", 8, "--chunks", 2)
    rc, out, err = run(capsys, *base, "--memory-limit", 11)  # 11 chunks' M_B = 5.5 M_B: exactly the peak
    assert rc == 0, err
    assert parse_report(out)["peak"] == 5.5
    rc, _, err = run(capsys, *base, "--memory-limit", 10.5)
    assert_one_line_error(rc, err, "--memory-limit 10.5", "interleaved-1f1b")


@pytest.mark.skipif("zbv" not in NAMES, reason="V schedules not registered")
def test_memory_limit_is_respected_by_v_schedule():
    # --memory-limit 6 on the V placement: 6 chunk M_B = 3 M_B of a rank's share.
    _, res = build_and_simulate("zbv", pp=4, microbatches=8, costs=Costs(memory_limit=6))
    assert res.max_peak_memory <= 3 + 1e-9
    assert res.schedule.num_stages == 8


def test_memory_limit_too_small_for_fixed_schedule(capsys):
    rc, _, err = run(capsys, "schedule", "--schedule", "1f1b", "--pp", 4, "--microbatches", 8, "--memory-limit", 3)
    assert_one_line_error(rc, err, "--memory-limit", "rank 0")


@pytest.mark.parametrize("args, flag", [
    (["--pp", "0"], "--pp"),
    (["--pp", "two"], "--pp"),
    (["--microbatches", "-3"], "--microbatches"),
    (["--chunks", "0"], "--chunks"),
    (["--tf", "0"], "--tf"),
    (["--tb", "-1"], "--tb"),
    (["--tw", "nan"], "--tw"),
    (["--tcomm", "x"], "--tcomm"),
    (["--mem-b", "0"], "--mem-b"),
    (["--mem-w", "-1"], "--mem-w"),
    (["--memory-limit", "0.5"], "--memory-limit"),
    (["--memory-limit", "-2"], "--memory-limit"),
    (["--schedule", "no-such-schedule"], "--schedule"),
    (["--width", "0"], "--width"),
    (["--plot", "out.jpg"], "--plot"),
])
def test_bad_flags_exit_2_naming_the_flag(args, flag, capsys, tmp_path):
    argv = {"--schedule": "1f1b", "--pp": "2", "--microbatches": "2"}
    extra = []
    for k, v in zip(args[::2], args[1::2]):
        if k in argv:
            argv[k] = v
        else:
            extra += [k, str(tmp_path / v) if k == "--plot" else v]
    flat = [x for kv in argv.items() for x in kv]
    rc, _, err = run(capsys, "schedule", *flat, *extra)
    assert_one_line_error(rc, err, flag)


def test_missing_required_flag_and_command(capsys):
    rc, _, err = run(capsys, "schedule", "--schedule", "1f1b", "--pp", 2)
    assert_one_line_error(rc, err, "--microbatches")
    rc, _, err = run(capsys)
    assert_one_line_error(rc, err, "COMMAND")


def test_help_and_list(capsys):
    rc, out, _ = run(capsys, "schedule", "--help")
    assert rc == 0
    for flag in ("--schedule", "--pp", "--microbatches", "--chunks", "--tf", "--tb", "--tw", "--tcomm",
                 "--mem-b", "--mem-w", "--memory-limit", "--json", "--plot", "--no-timeline"):
        assert flag in out
    assert "ONE RANK'S SHARE" in out and "ONE STAGE's M_B" in out
    rc, out, _ = run(capsys, "list")
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split()[:2] == ["name", "placement"]
    for name in NAMES:
        spec = registry.get_spec(name)
        row = next(ln for ln in lines if ln.split()[0] == name)
        assert row.split()[1] == spec.placement
        assert spec.description in row


# ---------------------------------------------------------------------------------- simulate
def _write(tmp_path: Path, name: str, ranks: list[list[tuple[str, int, int]]], m: int = 2,
           s2r: list[int] | None = None) -> Path:
    d = {"num_microbatches": m, "stage_to_rank": s2r if s2r is not None else list(range(len(ranks))),
         "ranks": [[{"op": op, "mb": mb, "stage": st} for op, mb, st in acts] for acts in ranks]}
    path = tmp_path / name
    path.write_text(json.dumps(d))
    return path


def _good_ranks() -> list[list[tuple[str, int, int]]]:
    return [[("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("W", 0, 0), ("B", 1, 0), ("W", 1, 0)],
            [("F", 0, 1), ("B", 0, 1), ("W", 0, 1), ("F", 1, 1), ("B", 1, 1), ("W", 1, 1)]]


def test_simulate_handwritten_file(capsys, tmp_path):
    path = _write(tmp_path, "mine.json", _good_ranks())
    rc, out, err = run(capsys, "simulate", path)
    assert rc == 0, err
    assert "schedule mine:" in out
    assert "lowering: ok (4 send/recv pairs derived)" in out
    rep = parse_report(out)
    assert rep["busy"] == [6, 6]


def test_simulate_rejects_missing_w(capsys, tmp_path):
    ranks = _good_ranks()
    del ranks[1][5]  # W(mb=1, stage=1)
    rc, _, err = run(capsys, "simulate", _write(tmp_path, "missing_w.json", ranks))
    assert_one_line_error(rc, err, "missing_w.json", "W(mb=1, stage=1)")


def test_simulate_rejects_w_before_b(capsys, tmp_path):
    ranks = _good_ranks()
    ranks[0][2], ranks[0][3] = ranks[0][3], ranks[0][2]
    rc, _, err = run(capsys, "simulate", _write(tmp_path, "w_first.json", ranks))
    assert_one_line_error(rc, err, "rank 0 action #2", "W(mb=0, stage=0)", "B(mb=0, stage=0)")


def test_simulate_rejects_deadlock(capsys, tmp_path):
    ranks = [[("F", 0, 0), ("B", 0, 0), ("W", 0, 0), ("F", 1, 0), ("B", 1, 0), ("W", 1, 0)],
             [("F", 1, 1), ("B", 1, 1), ("W", 1, 1), ("F", 0, 1), ("B", 0, 1), ("W", 0, 1)]]
    rc, _, err = run(capsys, "simulate", _write(tmp_path, "dead.json", ranks))
    assert_one_line_error(rc, err, "deadlock", "rank 1 blocked at action #0 F(mb=1, stage=1)")


def test_simulate_checks_lowered_communication(capsys, tmp_path):
    js = tmp_path / "low.json"
    rc, _, err = run(capsys, "schedule", "--schedule", "zb-h1", "--pp", 3, "--microbatches", 3, "--json", js,
                     "--lowered")
    assert rc == 0, err
    data = json.loads(js.read_text())
    ops = {a["op"] for acts in data["ranks"] for a in acts}
    assert {"SEND_F", "RECV_F", "SEND_B", "RECV_B"} <= ops
    assert all("peer" in a for acts in data["ranks"] for a in acts if a["op"].startswith(("SEND", "RECV")))
    rc, out, err = run(capsys, "simulate", js, "--no-timeline")
    assert rc == 0, err
    assert "send/recv pairs given in the file, all matched" in out
    # remove one receive: the matching send is reported
    idx = next(i for i, a in enumerate(data["ranks"][1]) if a["op"] == "RECV_F")
    del data["ranks"][1][idx]
    js.write_text(json.dumps(data))
    rc, _, err = run(capsys, "simulate", js)
    assert_one_line_error(rc, err, "SEND_F(mb=0, stage=0, peer=1)")


@pytest.mark.parametrize("text, needle", [
    ('{"num_microbatches": 2,', "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"num_microbatches": 1, "stage_to_rank": [0]}', "'ranks'"),
    ('{"num_microbatches": 1, "stage_to_rank": [0], "ranks": [[7]]}', "rank 0 action #0"),
    ('{"num_microbatches": 1, "stage_to_rank": [0], "ranks": [[{"op": "F", "mb": "x", "stage": 0}]]}', "'mb'"),
    ('{"num_microbatches": 1, "stage_to_rank": [0], "ranks": [[{"op": "Q", "mb": 0, "stage": 0}]]}', "'Q'"),
    ('{"num_microbatches": 1, "stage_to_rank": [0], "ranks": [[{"op": "F", "stage": 0}]]}', "'mb'"),
])
def test_simulate_rejects_malformed_files(text, needle, capsys, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(text)
    rc, _, err = run(capsys, "simulate", path)
    assert_one_line_error(rc, err, "bad.json", needle)


def test_simulate_missing_file(capsys, tmp_path):
    rc, _, err = run(capsys, "simulate", tmp_path / "nope.json")
    assert_one_line_error(rc, err, "nope.json")


def test_simulate_uses_the_same_units_for_v_files(capsys, tmp_path):
    # a V-placed file: two stages per rank, so each stage takes half of --tf etc.
    s2r = [0, 1, 1, 0]
    ranks = [[("F", 0, 0), ("F", 0, 3), ("BW", 0, 3), ("BW", 0, 0)], [("F", 0, 1), ("F", 0, 2), ("BW", 0, 2),
                                                                      ("BW", 0, 1)]]
    path = _write(tmp_path, "v.json", ranks, m=1, s2r=s2r)
    rc, out, err = run(capsys, "simulate", path, "--tf", 2, "--tb", 2, "--tw", 2, "--mem-b", 4, "--no-timeline")
    assert rc == 0, err
    rep = parse_report(out)
    assert rep["busy"] == [6, 6]          # 1 microbatch * (2 + 2 + 2), split over two chunks
    assert rep["peaks"] == [4, 4]         # both chunks held at once: 2 + 2
    assert rep["total"] == 12
    rc, _, err = run(capsys, "simulate", path, "--mem-b", 4, "--memory-limit", 1.5)  # 1.5 chunk M_B = 3 < 4
    assert_one_line_error(rc, err, "--memory-limit 1.5")


# ---------------------------------------------------------------------------------- outputs
def test_plot_flag_writes_png_and_svg(capsys, tmp_path):
    png, svg = tmp_path / "t.png", tmp_path / "sub" / "t.svg"
    rc, out, err = run(capsys, "schedule", "--schedule", "zb-h1", "--pp", 3, "--microbatches", 4, "--plot", png)
    assert rc == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    js = tmp_path / "s.json"
    run(capsys, "schedule", "--schedule", "zb-h1", "--pp", 3, "--microbatches", 4, "--json", js)
    rc, out, err = run(capsys, "simulate", js, "--plot", svg)
    assert rc == 0, err
    text = svg.read_text()
    assert "<svg" in text and text.rstrip().endswith("</svg>") and len(text) > 10_000


def test_chunks_note_for_non_interleaved(capsys):
    rc, _, err = run(capsys, "schedule", "--schedule", "1f1b", "--pp", 2, "--microbatches", 2, "--chunks", 3,
                     "--no-timeline")
    assert rc == 0
    assert "--chunks is ignored by 1f1b" in err


def test_python_dash_m_entry_point(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    ok = subprocess.run([sys.executable, "-m", "megatron_zb", "schedule", "--schedule", "zb-h1", "--pp", "4",
                         "--microbatches", "8", "--no-timeline"], capture_output=True, text=True, env=env,
                        cwd=tmp_path, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert parse_report(ok.stdout)["makespan"] == 27
    assert "Traceback" not in ok.stderr


# ---------------------------------------------------------------------------------- DP reduce
def test_dp_reduce_flags_add_the_reduce_to_the_reported_times(capsys, tmp_path):
    """1F1B, p=2, m=2, unit costs: rank 0's last BW runs 7-9 (rank 1's 5-7). 4 bytes per rank in
    buckets of 1 byte at 4 bytes/unit: 0.25 each. Overlapped, rank 0's buckets are ready at 7.5,
    8, 8.5, 9 and end at 9.25 (rank 1's at 7.25); without overlap rank 0 reduces 9-10."""
    base = ["schedule", "--schedule", "1f1b", "--pp", 2, "--microbatches", 2, "--no-timeline",
            "--dp-reduce-bytes", 4, "--dp-bandwidth", 4, "--dp-bucket-bytes", 1]
    rc, out, err = run(capsys, *base, "--plot", tmp_path / "dp.png")
    assert rc == 0, err
    rep = parse_report(out)
    assert rep["total"] == pytest.approx(9.25) and rep["makespan"] == pytest.approx(9.25)
    assert "compute ends at 9, iteration at 9.25; exposed per rank [0.25, 0.25]" in out
    assert (tmp_path / "dp.png").stat().st_size > 10_000
    rc, out, err = run(capsys, *base, "--no-dp-overlap")
    assert rc == 0, err
    assert parse_report(out)["total"] == pytest.approx(10.0)
    assert "after the compute" in out and "exposed per rank [1, 1]" in out
    rc, out, _ = run(capsys, "schedule", "--schedule", "1f1b", "--pp", 2, "--microbatches", 2, "--no-timeline")
    assert parse_report(out)["total"] == pytest.approx(9.0) and "DP reduce" not in out


@pytest.mark.parametrize("flags,needle", [
    (["--dp-reduce-bytes", "4"], "--dp-reduce-bytes needs --dp-bandwidth"),
    (["--dp-bandwidth", "4"], "--dp-bandwidth and --dp-bucket-bytes need --dp-reduce-bytes"),
    (["--dp-reduce-bytes", "4", "--dp-bandwidth", "0"], "--dp-bandwidth"),
], ids=["no-bandwidth", "no-bytes", "zero-bandwidth"])
def test_dp_reduce_flag_errors_are_one_line(flags, needle, capsys):
    rc, _, err = run(capsys, "schedule", "--schedule", "zb", "--pp", 2, "--microbatches", 2, *flags)
    assert_one_line_error(rc, err, needle)

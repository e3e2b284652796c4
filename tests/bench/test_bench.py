"""The benchmark machinery (no timing assertions): emulated stages through the real runtime, the
per-stage activation measurement against the simulator, the report helpers, and
``scripts/benchmark.py --quick`` end to end."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest

import megatron_zb  # noqa: F401  (CPU shim)
from megatron_zb.bench.emulated import emulated_check_rank
from megatron_zb.bench.report import (Row, achieved_costs, action_gaps, hop_latencies, iteration_times, markdown_table,
                                      median, median_interval, paired_ratios, ratios, read_csv, verdict,
                                      write_csv)
from megatron_zb.schedules import CostModel, Op
from megatron_zb.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------- emulated stage + runtime
@pytest.mark.parametrize("p", [2, 4])
def test_emulated_stages_run_through_the_real_runtime(p):
    schedules = ["1f1b", "zb-h1", "zb-2p", "zbv", "v-half"]
    m = 2 * p
    res = run_distributed(partial(emulated_check_rank, schedules, m), world_size=p, timeout=120)
    for name in schedules:
        per_rank = [r[name] for r in res]
        assert sum(r["losses"] for r in per_rank) == m, name          # the last stage returns m losses
        assert all(r["losses"] == (m if r["holds_loss"] else 0) for r in per_rank), name
        assert all(r["pending"] == [] for r in per_rank), name        # no W left behind
        assert all(g == m for r in per_rank for g in r["weight_grads"]), name  # every W (or BW) ran once
        # time_actions timed every send and receive of the plan, in order, each with end >= start
        assert all(r["comm_timed"] == r["comm_planned"] for r in per_rank), name
        # LoopOverhead: one call, every compute action counted; the stages sleep (wall, no CPU), so
        # their wall time is at least the targets' and their CPU time well below it
        for r in per_rank:
            ov = r["overhead"]
            assert ov.calls == 1 and ov.compute_actions == r["compute_planned"], name
            assert ov.compute_wall >= 0.5e-3 * r["compute_planned"], name  # each sleeps >= 0.5 ms (V: half of 1 ms)
            assert ov.compute_cpu < ov.compute_wall, name
            assert ov.compute_wall + ov.comm_wall <= ov.wall and ov.overhead_cpu >= 0, name
        deferred = sum(r["deferred"] for r in per_rank)
        executed = sum(r["w_executed"] for r in per_rank)
        if name == "1f1b":
            assert deferred == 0 and executed == 0
        else:  # split backward: every B queued its W, every W ran it
            stages = 2 * p if name in ("zbv", "v-half") else p
            assert deferred == executed == m * stages, name


# ---------------------------------------------------------------------- activation memory on the real model
def test_memory_rank_measures_what_the_simulator_predicts():
    from dataclasses import asdict

    from megatron_zb.bench.real import ModelSpec, memory_rank
    from megatron_zb.schedules import simulate

    model = ModelSpec(num_layers=4, hidden=32, heads=4, seq=16, vocab=64, micro_batch=2)
    cfg = dict(model=asdict(model), memory_schedules=["1f1b", "zb-h1", "zbv"], memory_m=4, measure_m=4,
               measure_iters=1)
    res = run_distributed(partial(memory_rank, cfg), world_size=2, timeout=120)
    for kind, stages in (("plain", 2), ("v", 4)):
        mem = res[0]["measured"][kind]["mem"]
        assert sorted(mem) == list(range(stages))
        assert all(mb > mw > 0 for mb, mw in mem.values()), mem  # W closures keep part of F's activations
    for name in ("1f1b", "zb-h1", "zbv"):
        sched = res[0]["memory"][name]["schedule"]
        sim = simulate(sched, res[0]["costs"]["v" if name == "zbv" else "plain"], enforce_memory=False)
        for r, rank_res in enumerate(res):
            got = rank_res["memory"][name]["peak_bytes"]
            assert got == pytest.approx(sim.peak_memory[r], rel=0.05), (name, r)
    # ZB-V's default limit is 1F1B's peak for the same layers (the last chunk carries the logits)
    peak = {n: max(r["memory"][n]["peak_bytes"] for r in res) for n in ("1f1b", "zbv")}
    assert peak["zbv"] <= 1.05 * peak["1f1b"], peak


# ---------------------------------------------------------------------- report helpers
def test_iteration_times_take_max_end_minus_min_start_over_ranks():
    per_rank = [[(0.0, 1.0), (10.0, 10.5)], [(0.2, 1.4), (9.9, 10.3)]]
    assert iteration_times(per_rank) == pytest.approx([1.4, 0.6])
    assert iteration_times([]) == []
    with pytest.raises(ValueError, match="different numbers"):
        iteration_times([[(0.0, 1.0)], []])


def test_hop_latencies_count_only_waits_on_another_rank():
    # rank 0: F(0,0) 0-1, F(1,0) 1-2, B(0,0) 5-6 ; rank 1: F(0,1) 1.5-2.5, B(0,1) 2.5-3.5, F(1,1) 3.5-4
    r0 = [("F", 0, 0, 0.0, 1.0), ("F", 1, 0, 1.0, 2.0), ("B", 0, 0, 5.0, 6.0)]
    r1 = [("F", 0, 1, 1.5, 2.5), ("BW", 0, 1, 2.5, 3.5), ("F", 1, 1, 3.5, 4.0)]
    hops = hop_latencies([r0, r1], [0, 1])
    # F(0,1): rank 1 had nothing before -> not counted (no previous action); F(1,1): busy until 3.5 -> not a wait;
    # B(0,0): rank 0 idle from 2.0, gradient from BW(0,1) ended 3.5 -> 1.5
    assert hops == pytest.approx([1.5])
    assert hop_latencies([r0 + r1], [0, 0]) == []  # same rank: no transfer
    # gaps: rank 0 F(1,0) right after F(0,0) (0.0); rank 1 BW(0,1) after F(0,1) (0.0), F(1,1) after BW (0.0,
    # its input F(1,0) ended at 2.0 <= 3.5); B(0,0) waited -> no gap
    assert action_gaps([r0, r1], [0, 1]) == pytest.approx([0.0, 0.0, 0.0])
    assert action_gaps([[("F", 0, 0, 0.0, 1.0), ("F", 1, 0, 1.25, 2.0)]], [0]) == pytest.approx([0.25])
    # the runtime records Op members (ActionTiming.records): same answers
    as_ops = [[(Op(op), mb, st, t0, t1) for op, mb, st, t0, t1 in r] for r in (r0, r1)]
    assert hop_latencies(as_ops, [0, 1]) == pytest.approx([1.5])
    assert action_gaps(as_ops, [0, 1]) == pytest.approx([0.0, 0.0, 0.0])


def test_achieved_costs_replace_planned_costs_by_median_durations():
    """Planned T_F/T_B/T_W = 1/2/3 ms on 2 stages. Split backward: rank 0 ran stage 0 with F taking
    4, 5, 9 ms (median 5) and B 6 ms; rank 1 ran stage 1 with W 7 ms; stage 1's F/B and stage 0's W
    were not timed and keep the plan -> T_F [5, 1], T_B [6, 2], T_W [3, 7]. The same with the ops
    as the strings the emulated benchmark uses. Fused: BW of stage 0 took 8 ms -> T_B stays 2,
    T_W = 8 - 2 = 6; stage 1 keeps 2 + 3."""
    planned = CostModel(t_f=1.0, t_b=2.0, t_w=3.0, t_comm=0.5)
    split = [{Op.F: {0: [0.004, 0.005, 0.009]}, Op.B: {0: [0.006]}}, {Op.W: {1: [0.007]}, Op.F: {1: []}}]
    for per_rank in (split, [{str(op): d for op, d in r.items()} for r in split]):
        got = achieved_costs(per_rank, planned, 2)
        assert got.t_f == pytest.approx([5.0, 1.0]) and got.t_b == pytest.approx([6.0, 2.0])
        assert got.t_w == pytest.approx([3.0, 7.0]) and got.t_comm == 0.5
    fused = achieved_costs([{Op.F: {0: [0.001]}, Op.BW: {0: [0.008]}}], planned, 2)
    assert fused.t_b == pytest.approx([2.0, 2.0]) and fused.t_w == pytest.approx([6.0, 3.0])
    with pytest.raises(ValueError):
        achieved_costs([{"Q": {0: [0.001]}}], planned, 2)  # an unknown op is refused, not skipped


def test_paired_ratios():
    assert paired_ratios([2.0, 3.0], [1.0, 2.0]) == [2.0, 1.5]
    with pytest.raises(ValueError):
        paired_ratios([1.0], [1.0, 2.0])


def test_median_interval_is_the_binomial_order_statistic_interval():
    """90% interval of the median from order statistics: n = 20 -> P(Bin(20, 1/2) <= 5) = 21700 / 2^20
    = 0.0207 (coverage 0.959), <= 6: 0.0577 (0.885 < 0.9), so (x_6, x_15); n = 10 -> <= 1: 11 / 1024
    (0.979), <= 2: 56 / 1024 (0.891), so (x_2, x_9); n = 5 -> <= 0: 1/32 (0.9375): (min, max);
    n = 4 -> 1/16 (0.875): no interval."""
    assert median_interval([float(x) for x in range(20, 0, -1)]) == (6.0, 15.0)  # order of the input irrelevant
    assert median_interval([float(x) for x in range(1, 11)]) == (2.0, 9.0)
    assert median_interval([5.0, 1.0, 3.0, 2.0, 4.0]) == (1.0, 5.0)
    assert all(math.isnan(v) for v in median_interval([1.0, 2.0, 3.0, 4.0]))
    assert median_interval([float(x) for x in range(1, 11)], confidence=0.8) == (3.0, 8.0)  # <= 2: 0.891 >= 0.8


def test_median_and_ratios():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([1.0, 2.0]) == 1.5
    assert math.isnan(median([]))
    r = ratios({"base": 2.0, "a": 1.0, "b": 3.0}, "base")
    assert r == {"base": 1.0, "a": 0.5, "b": 1.5}
    with pytest.raises(KeyError):
        ratios({"a": 1.0}, "base")
    with pytest.raises(ZeroDivisionError):
        ratios({"base": 0.0}, "base")


def test_verdict_and_markdown_table():
    assert (verdict(True), verdict(False), verdict(None)) == ("PASS", "FAIL", "n/a")
    t = markdown_table(["a", "b"], [[1, "x|y"], ["2", 3.5]])
    assert t.splitlines() == ["| a | b |", "|---|---|", "| 1 | x/y |", "| 2 | 3.5 |"]
    with pytest.raises(ValueError):
        markdown_table(["a"], [[1, 2]])


def test_round_progress_line_counts_rounds_and_estimates_what_is_left(monkeypatch):
    from megatron_zb.bench import progress

    clock = iter([100.0, 110.0, 130.0])  # start, after round 1, after round 2
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    rp = progress.RoundProgress("real", 4, enabled=False)
    assert rp.line(m=8, times_ms={"1f1b": 12.34, "zbv": 10.0}) == \
        "real m=8 round 1/4: 1f1b 12.3, zbv 10.0 ms; elapsed 10 s, ETA 30 s"
    # 30 s for 2 rounds: 15 s per round, 2 left
    assert rp.line(m=None, times_ms={}, what="warm-up round").endswith("warm-up round 2/4: - ms; elapsed 30 s, ETA 30 s")
    assert [progress.duration(x) for x in (59.4, 410, 3725)] == ["59 s", "6 min 50 s", "1 h 02 min"]


def test_heartbeat_prints_while_the_body_runs_and_stops_after_it():
    import io
    import threading
    import time

    from megatron_zb.bench import progress

    out = io.StringIO()
    with pytest.raises(KeyError):  # the body's exception passes through; the thread still stops
        with progress.heartbeat("vocab bench: round 1/3 zbv", every_s=0.02, stream=out):
            deadline = time.monotonic() + 10.0
            while out.getvalue().count("\n") < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            raise KeyError("done")
    lines = out.getvalue().splitlines()
    assert len(lines) >= 2
    assert all(re.fullmatch(r"\[\d\d:\d\d:\d\d\] vocab bench: round 1/3 zbv: running, \d+ s", ln) for ln in lines), lines
    assert not any(t.name == "bench-heartbeat" for t in threading.enumerate())
    time.sleep(0.1)
    assert out.getvalue().splitlines() == lines  # nothing after the body ended


def test_csv_round_trip(tmp_path):
    rows = [Row("real-timing", 2, 8, "zb-2p", "ratio_vs_megatron_1f1b", 0.9123456789),
            Row("emulated", 8, 24, "zbv", "measured_ms", 123.0, "ms")]
    path = tmp_path / "r.csv"
    write_csv(rows, path)
    assert path.read_text().splitlines()[0] == "section,p,m,variant,metric,value,unit"
    assert read_csv(path) == rows


# ---------------------------------------------------------------------- the script, end to end
def test_quick_benchmark_end_to_end(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmark.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    md = (out / "results.md").read_text()
    for heading in ("## Real compute", "### Activation memory, PP=2", "### Activation memory, PP=4",
                    "## Emulated cluster", "## Optimizer post-validation"):
        assert heading in md, heading
    assert md in proc.stdout  # the tables are printed too
    rows = read_csv(out / "results.csv")
    sections = {r.section for r in rows}
    assert {"real-timing", "real-targets", "memory", "measured-costs", "post-validation"} <= sections
    assert any(s.startswith("emulated/") for s in sections)
    # Each variant's ratio is its median time over megatron-core 1F1B's median at the same m.
    timing = {(r.m, r.variant, r.metric): r.value for r in rows if r.section == "real-timing"}
    medians = {(m, v): val for (m, v, metric), val in timing.items() if metric == "median_ms"}
    assert len({v for _, v in medians} - {"megatron-1f1b"}) >= 2, medians
    for (m, v), ms in medians.items():
        base = medians[(m, "megatron-1f1b")]
        assert ms > 0 and timing[(m, v, "ratio_vs_megatron_1f1b")] == pytest.approx(ms / base, rel=1e-6), (m, v)
    assert "real:" in proc.stderr and "emulated" in proc.stderr  # progress on stderr
    # one progress line per round of every section (--quick: m=4, 1 warm-up + 2 timed rounds), with ETA
    for line in ("real m=4 warm-up round 1/3:", "real m=4 round 3/3:", "emulated p=4 m=12 round 4/4:",
                 "postval m=4 round 2/2:", "memory PP=4 m=4 tracked iteration 5/5:"):
        assert re.search(re.escape(line) + r" .* ms; elapsed (\d+ (h|min|s) ?)+, ETA (\d+ (h|min|s) ?)+", proc.stderr), line
    # the runtime's own overhead per compute action, for each of our schedules (not megatron-core's)
    runtime = {(r.variant, r.metric): r.value for r in rows if r.section == "real-runtime"}
    ours = {v for (_, v) in medians} - {"megatron-1f1b"}
    for v in ours:
        assert 0 < runtime[(v, "overhead_cpu_us_per_action")] < 1e5, (v, runtime)
        assert runtime[(v, "measured_over_simulated_achieved")] > 0, v
        assert all(runtime[(v, f"cpu_ms_per_F_rank{r}")] > 0 for r in (0, 1)), v  # ActionTiming.cpu
    assert "runtime overhead" in proc.stderr and "| overhead us/action (CPU) |" in md
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / "real_ratios.png").stat().st_size > 0
    pngs = list(out.glob("emulated_vs_simulated_scale*.png"))
    assert pngs and all(p.stat().st_size > 0 for p in pngs)


def test_other_processes_cpu_reports_the_hypervisor_steal_separately():
    """/proc/stat's steal column (CPU time the host gave to other guests) is part of what other
    processes take and is read from the same snapshot; nan before the first reading."""
    import time

    from megatron_zb.bench.machine import OtherProcessesCpu
    o = OtherProcessesCpu()
    assert math.isnan(o.steal_cores())
    time.sleep(0.3)
    others, steal = o.cores(), o.steal_cores()
    if math.isnan(others):
        pytest.skip("/proc not readable here")
    assert 0.0 <= steal <= os.cpu_count() and 0.0 <= others <= os.cpu_count()


def test_one_entry_point_runs_every_benchmark_by_name(capsys):
    """``python -m megatron_zb.bench NAME --help`` reaches each benchmark's own command line (in this
    process); no name lists them (exit 2), an unknown name is refused with the list (exit 2)."""
    from megatron_zb.bench.__main__ import BENCHMARKS, main

    assert main([]) == 2
    listing = capsys.readouterr().out
    assert all(f"  {name} " in listing for name in BENCHMARKS)
    for name, bench in BENCHMARKS.items():
        argv = list(sys.argv)
        assert main([name, "--help"]) == 0, name
        assert sys.argv == argv  # restored
        usage = capsys.readouterr().out
        own = bench.module.rsplit(".", 1)[-1]
        assert usage.startswith("usage:") and own in usage, (name, usage[:200])
    assert main(["no-such-benchmark"]) == 2
    assert "unknown benchmark 'no-such-benchmark'" in capsys.readouterr().err

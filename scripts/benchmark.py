#!/usr/bin/env python
"""Rerunnable benchmarks of megatron-zb on a CPU machine (gloo, real processes).

Sections (all on by default; ``--sections`` picks some):

* ``real``      -- tiny megatron-core GPT, PP=2 (2 processes, 1 torch thread each), m in --ms:
  iteration time of megatron-core's own 1F1B (forward_backward_pipelining_without_interleaving)
  versus megatron-zb's runtime running 1F1B, ZB-H1, ZB-2p and ZB-V, interleaved round-robin over
  the repeats, warm-up excluded, median, as a ratio to megatron-core's 1F1B. ZB-2p and ZB-V are
  re-planned with T_F/T_B/T_W measured by ``time_actions`` on this model (and the measured p2p
  latency) before they are timed. Also: peak activation bytes per rank of each schedule.
* ``memory``    -- the same activation-memory measurement at PP in --mem-pps (default 4 and 8,
  m = 2 PP; timing-insensitive).
* ``emulated``  -- emulated cluster, P=4 and 8 processes: each stage's compute is a calibrated
  sleep of the zero-bubble paper's 1.5B costs divided by --emu-scales, real runtime, real p2p;
  measured iteration time versus the simulator's isolated-iteration time.
* ``postval``   -- megatron-core's synchronous optimizer step versus post-validation
  (megatron_zb.optimizer.PostValidationOptimizer), same zero-bubble schedule, same run.

Progress goes to stderr; the tables to stdout and to --out DIR (results.md, results.csv, PNGs).
Target columns (PASS/FAIL) are reported, never enforced: the exit status is 0 whenever the
benchmark ran.

Usage: python scripts/benchmark.py [--quick] [--out DIR] [--sections real,memory,emulated,postval]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import statistics
import sys
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import megatron_zb  # noqa: E402,F401  (CPU shim)
from megatron_zb.bench.report import (Row, action_gaps, hop_latencies, iteration_times,  # noqa: E402
                                      markdown_table, median, paired_ratios, plot_measured_vs_simulated,
                                      plot_ratio_bars, ratios, verdict, write_csv)
from megatron_zb.schedules import CostModel, simulate  # noqa: E402
from megatron_zb.schedules.registry import build_schedule  # noqa: E402

SECTIONS = ("real", "memory", "emulated", "postval", "dp")  # dp: megatron_zb.bench.dp (its docstring)
DEFAULT_SECTIONS = SECTIONS[:4]  # dp runs only when asked for (8 processes, 1-2 minutes even with --quick)
LABEL = {"megatron-1f1b": "megatron-core 1F1B", "1f1b": "1F1B", "zb-h1": "ZB-H1", "zb-2p": "ZB-2p",
         "zbv": "ZB-V", "v-half": "V-Half"}
PAPER_15B = dict(t_f=18.522, t_b=18.086, t_w=9.337, hidden=2304, heads=24, seq=1024)
"""The zero-bubble paper's 1.5B model, p=8, m=24 row (ms per stage; arXiv 2401.10241 Table 9)."""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def loadavg() -> tuple[float, float, float]:
    try:
        a, b, c = open("/proc/loadavg").read().split()[:3]
        return float(a), float(b), float(c)
    except OSError:
        return (float("nan"),) * 3


def _busy_jiffies() -> int:
    """Busy CPU time of the whole machine (all cores), in clock ticks, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal ...
    return v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)


def _own_jiffies(root: int) -> int:
    """CPU ticks of process ``root`` and its descendants, reaped children included (cutime/cstime)."""
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(d)] = int(rest[1])
        ticks[int(d)] = sum(int(x) for x in rest[11:15])  # utime stime cutime cstime
    total = 0
    for pid, t in ticks.items():
        q = pid
        while q not in (0, 1) and q != root and q in parent:
            q = parent[q]
        if q == root:
            total += t
    return total


class LoadSampler:
    """Samples, every ``period`` seconds in a daemon thread, the 1-minute load average and the CPU
    used by processes *outside* this benchmark (machine busy time minus this process tree's)."""

    def __init__(self, period: float = 2.0) -> None:
        self.period = period
        self.samples: list[float] = []
        self.others: list[float] = []  # cores busy with other processes, per window
        self._marked = self._marked_load = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        hz = os.sysconf("SC_CLK_TCK")
        try:
            last = (time.monotonic(), _busy_jiffies(), _own_jiffies(os.getpid()))
        except OSError:
            last = None
        while not self._stop.is_set():
            self.samples.append(loadavg()[0])
            self._stop.wait(self.period)
            if last is None:
                continue
            try:
                now = (time.monotonic(), _busy_jiffies(), _own_jiffies(os.getpid()))
            except OSError:
                continue
            dt = now[0] - last[0]
            if dt > 0:
                self.others.append(max(0.0, ((now[1] - last[1]) - (now[2] - last[2])) / hz / dt))
            last = now

    def mark(self, name: str) -> str:
        """Describe the other processes' CPU use since the previous mark (one line per section)."""
        o = self.others[self._marked:]
        s = self.samples[self._marked_load:]
        self._marked, self._marked_load = len(self.others), len(self.samples)
        if not o:
            return f"{name}: -"
        return (f"{name}: other processes {statistics.fmean(o):.2f} cores mean, {max(o):.2f} max; "
                f"1-min load {min(s):.2f}-{max(s):.2f}")

    def stop(self) -> str:
        self._stop.set()
        self._t.join(self.period + 1.0)
        s = self.samples or [float("nan")]
        o = self.others or [float("nan")]
        return (f"1-min load average during the run (includes the benchmark's own processes): min {min(s):.2f}, "
                f"median {statistics.median(s):.2f}, max {max(s):.2f}; CPU used by other processes (machine busy "
                f"time minus this benchmark's process tree, {self.period:g}-s windows): mean "
                f"{statistics.fmean(o):.2f} cores, max {max(o):.2f} of {os.cpu_count()}")


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch
    try:
        from importlib.metadata import version
        mcore = version("megatron-core")
    except Exception:  # pragma: no cover - metadata missing
        mcore = "?"
    return (f"{os.cpu_count()} cores ({cpu}), {platform.system()} {platform.release()}, Python "
            f"{platform.python_version()}, torch {torch.__version__}, megatron-core {mcore}, gloo, CPU only")


def ms(x: float) -> str:
    return f"{x * 1e3:.1f}" if x == x else "-"


def comm_range(samples: list[float]) -> str:
    if not samples:
        return "not sampled"
    return f"median {median(samples):.3f} ms (min {min(samples):.3f}, max {max(samples):.3f}, {len(samples)} samples)"


def fmt_ratio(x: float) -> str:
    return f"{x:.3f}" if x == x else "-"


# ---------------------------------------------------------------------- configs
def configs(args: argparse.Namespace) -> dict[str, Any]:
    from megatron_zb.bench.real import ModelSpec

    if args.quick:
        model = ModelSpec(num_layers=8, hidden=64, heads=4, seq=32, vocab=128, micro_batch=2)
        return dict(
            model=model, ms=[4], warmup=1, repeats=2, measure_iters=1,
            mem=[dict(p=4, m=4)], emu_ps=[4], emu_scales=args.emu_scales or [4.0], emu_warmup=2, emu_repeats=2,
            pv=dict(m=4, block=2, warmup=1, repeats=1),
        )
    model = ModelSpec(num_layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                      vocab=args.vocab, micro_batch=args.micro_batch)
    return dict(
        model=model, ms=args.ms, warmup=args.warmup, repeats=args.repeats, measure_iters=3,
        mem=[dict(p=p, m=2 * p) for p in args.mem_pps], emu_ps=[4, 8],
        emu_scales=args.emu_scales or [1.0, 2.0], emu_warmup=3,
        emu_repeats=args.emu_repeats,
        pv=dict(m=8, block=4, warmup=1, repeats=args.pv_repeats),
    )


# ---------------------------------------------------------------------- sections
def section_real(cfg: dict[str, Any], rows: list[Row], md: list[str], out: Path, timeout: float) -> dict[str, Any]:
    from megatron_zb.bench.real import MEGATRON_1F1B, timing_rank
    from megatron_zb.testing import run_distributed

    variants = [MEGATRON_1F1B, "1f1b", "zb-h1", "zb-2p", "zbv"]
    mem_scheds = ["1f1b", "zb-h1", "zb-2p", "zbv", "v-half"]
    model = cfg["model"]
    rcfg = dict(model=asdict(model), variants=variants, ms=cfg["ms"], warmup=cfg["warmup"], repeats=cfg["repeats"],
                measure_iters=cfg["measure_iters"], measure_m=max(cfg["ms"]), memory_schedules=mem_scheds,
                memory_m=max(cfg["ms"]))
    log(f"real: PP=2, {model.describe()}; m in {cfg['ms']}, {cfg['warmup']} warm-up + {cfg['repeats']} timed rounds "
        f"over {len(variants)} variants")
    res = run_distributed(timing_rank, world_size=2, args=(rcfg,), timeout=timeout, threads=1)
    plan_costs = res[0]["costs"]  # what ZB-2p / ZB-V were planned with (T_comm measured before the runs)
    samples = res[0]["comm_samples_ms"]
    t_comm = median(samples) if samples else res[0]["t_comm_ms"]
    # the simulator below uses the p2p latency measured during the timed rounds
    costs = {k: replace(c, t_comm=t_comm) for k, c in plan_costs.items()}

    # measured costs
    md.append("## Real compute: tiny GPT, PP=2, CPU\n")
    md.append(f"Model: {model.describe()}; PP=2 = 2 processes with 1 torch thread each; gloo p2p. "
              f"Variants run round-robin in the same processes ({cfg['warmup']} warm-up rounds excluded, "
              f"{cfg['repeats']} timed rounds, the starting variant rotates each round); iteration time = "
              f"max end - min start over both ranks of one forward_backward call; median over rounds. "
              f"megatron-core's 1F1B runs with megatron-core's own linear autograd function (the "
              f"weight-gradient store is uninstalled for it).\n")
    mrows = []
    for kind, label in (("plain", "plain (1F1B, ZB-H1, ZB-2p)"), ("v", "V (ZB-V), 2 chunks/rank")):
        meas = res[0]["measured"][kind]
        for s in sorted(meas["times"]):
            tf, tb, tw = meas["times"][s]
            mb, mw = meas["mem"][s]
            bw = meas["bw"].get(s)
            mrows.append([label, s, f"{tf:.2f}", f"{tb:.2f}", f"{tw:.2f}", "-" if bw is None else f"{bw:.2f}",
                          f"{mb / 2**20:.2f}", f"{mw / 2**20:.2f}"])
            if bw is not None:
                rows.append(Row("measured-costs", 2, 0, f"{kind}-stage{s}", "t_bw", bw, "ms"))
            for metric, val, unit in (("t_f", tf, "ms"), ("t_b", tb, "ms"), ("t_w", tw, "ms"), ("mem_b", mb, "B"),
                                      ("mem_w", mw, "B")):
                rows.append(Row("measured-costs", 2, 0, f"{kind}-stage{s}", metric, val, unit))
    rows.append(Row("measured-costs", 2, 0, "p2p", "t_comm_plan", res[0]["t_comm_ms"], "ms"))
    rows.append(Row("measured-costs", 2, 0, "p2p", "t_comm_run", t_comm, "ms"))
    md.append(f"Measured costs per stage (median of `time_actions` over {cfg['measure_iters']} iterations of "
              f"ZB-H1 / ZB-V at m={rcfg['measure_m']}; T_BW: the fused backward of our 1F1B, for comparison with "
              f"T_B + T_W (the simulator assumes they are equal); memory: one microbatch in isolation, in the "
              f"runtime's activation tracker). T_comm (one-way gloo latency of one activation, ping-pong): "
              f"{res[0]['t_comm_ms']:.3f} ms before the runs (ZB-2p and ZB-V were planned with it), "
              f"{comm_range(samples)} during the timed rounds (median used by the simulator below).\n")
    md.append(markdown_table(["placement", "stage", "T_F ms", "T_B ms", "T_W ms", "T_BW ms (1F1B)", "M_B MiB",
                              "M_W MiB"], mrows))

    trows, grows = [], []
    ratio_by_m: dict[int, dict[str, float]] = {}
    for m in cfg["ms"]:
        spread = {v: iteration_times([r["timings"][m][v] for r in res]) for v in variants}
        med = {v: median(spread[v]) for v in variants}
        rat = ratios(med, MEGATRON_1F1B)
        paired = {v: median(paired_ratios(spread[v], spread[MEGATRON_1F1B])) for v in variants}
        ratio_by_m[m] = {LABEL[v]: rat[v] for v in variants if v != MEGATRON_1F1B}
        sim = {}
        for v in variants:
            name = "1f1b" if v == MEGATRON_1F1B else v
            kind = "v" if name == "zbv" else "plain"
            sched = build_schedule(name, num_ranks=2, num_microbatches=m, costs=plan_costs[kind])  # as the ranks did
            sim[v] = simulate(sched, costs[kind], enforce_memory=False)
        for v in variants:
            xs = spread[v]
            sim_ratio = sim[v].total_time / sim["1f1b"].total_time
            trows.append([m, LABEL[v], ms(med[v]), f"{ms(min(xs))}-{ms(max(xs))}", fmt_ratio(rat[v]),
                          fmt_ratio(paired[v]), fmt_ratio(med[v] / med["1f1b"]), fmt_ratio(sim_ratio),
                          f"{sim[v].bubble_rate:.3f}"])
            rows += [Row("real-timing", 2, m, v, "median_ms", med[v] * 1e3, "ms"),
                     Row("real-timing", 2, m, v, "ratio_vs_megatron_1f1b", rat[v]),
                     Row("real-timing", 2, m, v, "paired_ratio_vs_megatron_1f1b", paired[v]),
                     Row("real-timing", 2, m, v, "simulated_ratio_vs_1f1b", sim_ratio)]
        overhead = rat["1f1b"] - 1.0
        pred = sim["1f1b"].total_time - sim["zb-2p"].total_time  # ms (costs are in ms)
        got = (med["1f1b"] - med["zb-2p"]) * 1e3
        ok1, ok2 = overhead <= 0.03, (got >= 0.5 * pred) if pred > 0 else None
        grows.append([m, f"{overhead * 100:+.1f}%", f"{(paired['1f1b'] - 1) * 100:+.1f}%", verdict(ok1),
                      f"{pred:.1f}", f"{got:.1f}",
                      f"{got / pred:.2f}" if pred > 0 else "-", verdict(ok2)])
        rows += [Row("real-targets", 2, m, "1f1b", "overhead_vs_megatron", overhead),
                 Row("real-targets", 2, m, "zb-2p", "predicted_saving_ms", pred, "ms"),
                 Row("real-targets", 2, m, "zb-2p", "measured_saving_ms", got, "ms")]
        log(f"real m={m}: " + ", ".join(f"{LABEL[v]} {ms(med[v])} ms" for v in variants))
    md.append("\nIteration times. 'ratio' = median / median of megatron-core's 1F1B (< 1 is faster); 'paired' = "
              "median over rounds of (this variant / megatron-core's 1F1B in the same round), which cancels drift "
              "between rounds; 'sim ratio' = the simulator's isolated-iteration time relative to 1F1B under the "
              "measured costs; 'sim bubble' = `SimResult.bubble_rate`:\n")
    md.append(markdown_table(["m", "variant", "median ms", "range ms", "ratio vs megatron 1F1B", "paired",
                              "ratio vs our 1F1B", "sim ratio vs 1F1B", "sim bubble"], trows))
    md.append("\nTargets: our 1F1B within 3% of megatron-core's 1F1B; ZB-2p faster than our 1F1B by at least half "
              "of the time the simulator predicts it saves (measured costs):\n")
    md.append(markdown_table(["m", "our 1F1B overhead", "(paired)", "<= 3%", "ZB-2p predicted saving ms",
                              "measured saving ms", "measured / predicted", ">= 0.5"], grows))
    if plot_ratio_bars(ratio_by_m, out / "real_ratios.png", title=f"PP=2 CPU, {model.describe()}",
                       baseline_label="megatron-core 1F1B"):
        md.append("\n![ratios](real_ratios.png)\n")
    memory_table(res, costs, 2, max(cfg["ms"]), rows, md, heading="### Activation memory, PP=2")
    return dict(costs=costs, t_comm=t_comm)


def memory_table(res: list[dict[str, Any]], costs: dict[str, CostModel], p: int, m: int, rows: list[Row],
                 md: list[str], heading: str) -> None:
    names = list(res[0]["memory"])
    if not names:
        return
    per = {}
    for n in names:
        measured = [r["memory"][n]["peak_bytes"] for r in res]
        sched = res[0]["memory"][n]["schedule"]  # the very schedule the ranks ran
        c = costs["v" if n in ("zbv", "v-half") else "plain"]
        per[n] = (measured, simulate(sched, c, enforce_memory=False).peak_memory)
    base, base_sim = (max(per["1f1b"][0]), max(per["1f1b"][1])) if "1f1b" in per else (float("nan"),) * 2
    zbv = max(per["zbv"][0]) if "zbv" in per else float("nan")
    mrows = []

    def mib(xs):
        return ", ".join(f"{x / 2**20:.2f}" for x in xs)

    for n in names:
        measured, sim = per[n]
        rel, rel_sim = max(measured) / base, max(sim) / base_sim
        check, ok = "-", None
        if n in ("zb-h1", "zbv"):
            check, ok = "<= 1.05 x 1F1B", rel <= 1.05
        elif n == "v-half":
            # published V-Half memory: (p+2)//2 microbatches where 1F1B holds p (-> 1/2 as p grows)
            bound = ((p + 2) // 2) / p
            half = max(measured) / zbv
            check, ok = (f"<= {(p + 2) // 2}/{p} = {bound:.3f} x 1F1B + 5% (published V-Half, -> 1/2 as p "
                         f"grows); {half:.2f} x ZB-V"), rel <= bound + 0.05
            rows.append(Row("memory", p, m, n, "ratio_vs_zbv", half))
        mrows.append([LABEL.get(n, n), mib(measured), mib(sim), f"{max(measured) / max(sim):.3f}", f"{rel:.3f}",
                      f"{rel_sim:.3f}", check, verdict(ok)])
        for r, (a, b) in enumerate(zip(measured, sim)):
            rows += [Row("memory", p, m, n, f"rank{r}_peak_bytes", a, "B"),
                     Row("memory", p, m, n, f"rank{r}_simulated_bytes", b, "B")]
        rows.append(Row("memory", p, m, n, "ratio_vs_1f1b", rel))
        rows.append(Row("memory", p, m, n, "simulated_ratio_vs_1f1b", rel_sim))
    md.append(f"\n{heading} (m={m}; MiB per rank)\n")
    md.append("'measured' = `last_peak_bytes` of `track_memory=True` on each rank (bytes of tensors autograd saved, "
              "each storage counted until it is freed, pending W closures included); 'simulated' = the simulator's "
              "per-rank peak for the same schedule with each stage's M_B / M_W in bytes as measured in the same "
              "processes (one microbatch in isolation); "
              "'vs 1F1B' compares the largest rank, measured and simulated.\n")
    md.append(markdown_table(["schedule", "measured MiB", "simulated MiB", "measured / sim", "vs 1F1B",
                              "sim vs 1F1B", "target", "verdict"], mrows))


def section_memory(cfg: dict[str, Any], rows: list[Row], md: list[str], timeout: float) -> None:
    from megatron_zb.bench.real import memory_rank
    from megatron_zb.testing import run_distributed

    for run in cfg["mem"]:
        p, m = run["p"], run["m"]
        model = asdict(cfg["model"])
        model["num_layers"] = max(model["num_layers"], 2 * p)  # the V placement needs 2p chunks of >= 1 layer
        log(f"memory: PP={p}, m={m}, {model['num_layers']} layers")
        rcfg = dict(model=model, memory_schedules=["1f1b", "zb-h1", "zb-2p", "zbv", "v-half"],
                    memory_m=m, measure_m=m, measure_iters=1)
        res = run_distributed(memory_rank, world_size=p, args=(rcfg,), timeout=timeout, threads=1)
        memory_table(res, res[0]["costs"], p, m, rows, md,
                     heading=f"### Activation memory, PP={p}, {model['num_layers']} layers")


def section_emulated(cfg: dict[str, Any], rows: list[Row], md: list[str], out: Path, timeout: float) -> None:
    from megatron_zb.bench.emulated import emulated_rank
    from megatron_zb.testing import run_distributed

    scales = cfg["emu_scales"]
    schedules = ["1f1b", "zb-h1", "zb-2p", "zbv", "v-half"]
    h, a, s = PAPER_15B["hidden"], PAPER_15B["heads"], PAPER_15B["seq"]
    mem_w_ratio = 32 * h / (34 * h + 5 * a * s)
    md.append("\n## Emulated cluster: sleep-for-compute stages, real runtime and p2p\n")
    md.append(f"Each stage is `megatron_zb.bench.emulated.EmulatedStage`: F/B/W sleep the zero-bubble paper's 1.5B "
              f"costs (T_F={PAPER_15B['t_f']}, T_B={PAPER_15B['t_b']}, T_W={PAPER_15B['t_w']} ms per stage, p=8 "
              f"row) divided by a scale ({', '.join(f'{x:g}' for x in scales)}), half of that per chunk on the V "
              f"placement; M_W/M_B = {mem_w_ratio:.3f} (the paper's formula) for the schedule builders. Sleeps are "
              f"calibrated during {cfg['emu_warmup']} warm-up rounds so that each compute action, as timed by "
              f"`time_actions` (framework overhead included), lasts its target. The runtime, the weight-gradient "
              f"store and gloo p2p are the real ones; activations are [64, 1, 256] fp32; one process per rank, all "
              f"on this machine's {os.cpu_count()} cores. m = 3p; {cfg['emu_repeats']} timed rounds, round-robin "
              f"over the schedules. 'simulated' = `simulate(...).total_time` (isolated iteration) with the target "
              f"costs and the T_comm measured during the run; 'sim (achieved)' = the same with each action's "
              f"measured median duration; 'gap' = mean idle time between two consecutive compute actions of a "
              f"rank that was not waiting for data (the runtime's sends, receive bookkeeping, loop); 'hop' = "
              f"mean observed latency of a cross-rank dependency the receiving rank was waiting for "
              f"(producer's end to consumer's start: send, transfer, wake-up, receive); 'send call' = median "
              f"duration of the producer's `isend` call (`last_timing.comm`), the first part of a hop; "
              f"'sim (+gap, hop)' = "
              f"achieved durations plus one gap per compute action, with 'hop' as T_comm; 'start-up' = rank 0's "
              f"delay from entering forward_backward to its first F.\n")
    for scale in scales:
        plot_data: dict[int, dict[str, tuple[float, float]]] = {}
        section = f"emulated/{scale:g}"
        for p in cfg["emu_ps"]:
            m = 3 * p
            spec = dict(schedules=schedules, m=m, t_f=PAPER_15B["t_f"] / scale * 1e-3,
                        t_b=PAPER_15B["t_b"] / scale * 1e-3, t_w=PAPER_15B["t_w"] / scale * 1e-3,
                        mem_w_ratio=mem_w_ratio, shape=(64, 1, 256), warmup=cfg["emu_warmup"],
                        repeats=cfg["emu_repeats"], calibrate=True)
            log(f"emulated: p={p}, m={m}, paper costs / {scale:g}")
            res = run_distributed(emulated_rank, world_size=p, args=(spec,), timeout=timeout, threads=1)
            samples = [x * 1e3 for x in res[0]["comm_samples"]]
            t_comm = median(samples) if samples else res[0]["t_comm"] * 1e3
            erows = []
            plot_data[p] = {}
            for n in schedules:
                meas = median(iteration_times([r["times"][n] for r in res]))
                plan = res[0]["costs"][n]
                sched = build_schedule(n, num_ranks=p, num_microbatches=m, costs=plan)
                c = replace(plan, t_comm=t_comm)
                sim = simulate(sched, c, enforce_memory=False)
                ca = achieved_costs(res, n, c, sched.num_stages)
                sim_a = simulate(sched, ca, enforce_memory=False)
                its = [[r["records"][n][i] for r in res] for i in range(len(res[0]["records"][n]))]
                hops = [h * 1e3 for recs in its for h in hop_latencies(recs, res[0]["s2r"][n])]
                gaps = [g * 1e3 for recs in its for g in action_gaps(recs, res[0]["s2r"][n])]
                sends = [x * 1e3 for r in res for x in r["send_calls"][n]]
                send_call = median(sends) if sends else float("nan")
                hop = statistics.fmean(hops) if hops else float("nan")  # means: their sums are what add up
                gap = statistics.fmean(gaps) if gaps else float("nan")
                sim_h = sim_a
                if hops and gaps:  # every compute action followed by the median gap, transfers take `hop`
                    sc = ca.resolve(sched.num_stages)
                    co = replace(ca, t_f=[x + gap for x in sc.t_f], t_b=[x + gap for x in sc.t_b],
                                 t_w=[x + gap for x in sc.t_w], t_comm=hop)
                    sim_h = simulate(sched, co, enforce_memory=False)
                start = median(res[0]["startup"][n]) * 1e3
                ratio = meas * 1e3 / sim.total_time
                ok = all(r["losses_ok"][n] for r in res)
                deferred = sum(r["deferred"][n] for r in res)
                erows.append([LABEL[n], f"{meas * 1e3:.1f}", f"{sim.total_time:.1f}", f"{ratio:.3f}",
                              verdict(ratio <= 1.05), f"{sim_a.total_time:.1f}",
                              f"{meas * 1e3 / sim_a.total_time:.3f}", f"{gap:.2f}", f"{hop:.2f}",
                              f"{send_call:.2f}",
                              f"{sim_h.total_time:.1f}",
                              f"{meas * 1e3 / sim_h.total_time:.3f}", f"{start:.2f}", f"{sim.bubble_rate:.3f}",
                              "yes" if ok else "NO", deferred])
                rows += [Row(section, p, m, n, "measured_ms", meas * 1e3, "ms"),
                         Row(section, p, m, n, "simulated_ms", sim.total_time, "ms"),
                         Row(section, p, m, n, "measured_over_simulated", ratio),
                         Row(section, p, m, n, "simulated_achieved_ms", sim_a.total_time, "ms"),
                         Row(section, p, m, n, "hop_latency_ms", hop, "ms"),
                         Row(section, p, m, n, "action_gap_ms", gap, "ms"),
                         Row(section, p, m, n, "send_call_ms", send_call, "ms"),
                         Row(section, p, m, n, "simulated_with_overheads_ms", sim_h.total_time, "ms"),
                         Row(section, p, m, n, "startup_ms", start, "ms")]
                plot_data[p][LABEL[n]] = (meas * 1e3, sim.total_time)
                log(f"emulated p={p} {n}: measured {meas * 1e3:.1f} ms, simulated {sim.total_time:.1f} ms "
                    f"({ratio:.3f})")
            rows.append(Row(section, p, m, "p2p", "t_comm_plan", res[0]["t_comm"] * 1e3, "ms"))
            rows.append(Row(section, p, m, "p2p", "t_comm_run", t_comm, "ms"))
            t_f, t_b, t_w = (PAPER_15B[k] / scale for k in ("t_f", "t_b", "t_w"))
            md.append(f"\n### p={p}, m={m}, paper costs / {scale:g} (T_F={t_f:.2f}, T_B={t_b:.2f}, T_W={t_w:.2f} ms "
                      f"per stage); T_comm {res[0]['t_comm'] * 1e3:.3f} ms before the runs (planning), "
                      f"{comm_range(samples)} during the timed rounds (simulator)\n")
            md.append(markdown_table(["schedule", "measured ms", "simulated ms", "measured / sim", "<= 1.05",
                                      "sim (achieved) ms", "measured / sim (achieved)", "gap ms", "hop ms",
                                      "send call ms",
                                      "sim (+gap, hop) ms", "measured / sim (+gap, hop)", "start-up ms",
                                      "sim bubble", "losses ok", "W deferred"], erows))
        png = f"emulated_vs_simulated_scale{scale:g}.png"
        if plot_measured_vs_simulated(plot_data, out / png, title=f"emulated cluster, paper 1.5B costs / {scale:g}"):
            md.append(f"\n![emulated, costs / {scale:g}]({png})\n")


def achieved_costs(res: list[dict[str, Any]], name: str, c: CostModel, num_stages: int) -> CostModel:
    """``c`` with each stage's T_F / T_B / T_W replaced by the achieved median action durations (ms)."""
    ach: dict[str, dict[int, float]] = {}
    for r in res:
        for op, d in r["achieved"][name].items():
            for st, xs in d.items():
                ach.setdefault(op, {})[st] = statistics.median(xs) * 1e3
    sc = c.resolve(num_stages)
    tf = [ach.get("F", {}).get(st, sc.t_f[st]) for st in range(num_stages)]
    if "BW" in ach:  # fused backward: keep T_B, put the rest of the achieved BW into T_W
        tb = list(sc.t_b)
        tw = [max(0.0, ach["BW"].get(st, tb[st] + sc.t_w[st]) - tb[st]) for st in range(num_stages)]
    else:
        tb = [ach.get("B", {}).get(st, sc.t_b[st]) for st in range(num_stages)]
        tw = [ach.get("W", {}).get(st, sc.t_w[st]) for st in range(num_stages)]
    return CostModel(t_f=tf, t_b=tb, t_w=tw, t_comm=c.t_comm, mem_b=c.mem_b, mem_w=c.mem_w)


def section_postval(cfg: dict[str, Any], real_info: dict[str, Any] | None, rows: list[Row], md: list[str],
                    timeout: float) -> None:
    md.append("\n## Optimizer post-validation on versus off\n")
    try:
        from megatron_zb.bench.real import post_validation_rank
        from megatron_zb.optimizer import PostValidationOptimizer  # noqa: F401
    except ImportError as e:
        md.append(f"post-validation: not available in this build ({e})\n")
        log("post-validation: not available in this build")
        return
    from megatron_zb.testing import run_distributed

    pv = cfg["pv"]
    schedule = "zb-2p"
    costs = real_info["costs"]["plain"] if real_info else None
    rcfg = dict(model=asdict(cfg["model"]), schedule=schedule, costs=costs, m=pv["m"], block=pv["block"],
                warmup=pv["warmup"], repeats=pv["repeats"], clip_grad=1e4)
    log(f"post-validation: PP=2, {schedule}, m={pv['m']}, blocks of {pv['block']} iterations, "
        f"{pv['repeats']} timed rounds")
    res = run_distributed(post_validation_rank, world_size=2, args=(rcfg,), timeout=timeout, threads=1)
    blocks = {n: [t / pv["block"] for t in iteration_times([r["times"][n] for r in res])] for n in res[0]["times"]}
    per_iter = {n: median(xs) for n, xs in blocks.items()}
    rat = per_iter["post-validation"] / per_iter["sync"]
    paired = median(paired_ratios(blocks["post-validation"], blocks["sync"]))

    def rng(xs: list[float]) -> str:
        return f"{ms(min(xs))}-{ms(max(xs))}"

    pred = "-"
    if costs is not None:
        sched = build_schedule(schedule, num_ranks=2, num_microbatches=pv["m"], costs=costs)
        sim = simulate(sched, costs, enforce_memory=False)
        pred = f"{sim.makespan / sim.total_time:.3f}"
    cnt = res[0]["counters"] or {}
    md.append(f"Same schedule ({LABEL[schedule]}, PP=2, m={pv['m']}, measured costs), each variant with its own "
              f"DDP-wrapped model copy and megatron-core Adam (fp32, clip_grad=1e4 so that clipping never fires); "
              f"blocks of {pv['block']} back-to-back iterations (forward/backward + step, post-validated block "
              f"ends with `finalize()`), alternating, {pv['repeats']} timed rounds after {pv['warmup']} warm-up. "
              f"'paired' = median over rounds of the per-round ratio. 'bound' = the simulator's makespan / "
              f"isolated iteration: the best ratio if consecutive iterations could overlap (post-validation as "
              f"implemented still waits, before the next forward, until every rank has launched its reductions, "
              f"see docs/post_validation.md).\n")
    md.append(markdown_table(["schedule", "sync ms/iter", "range", "post-validation ms/iter", "range", "ratio",
                              "paired", "bound", "eager steps", "rollbacks"],
                             [[LABEL[schedule], ms(per_iter["sync"]), rng(blocks["sync"]),
                               ms(per_iter["post-validation"]), rng(blocks["post-validation"]), f"{rat:.3f}",
                               f"{paired:.3f}", pred, cnt.get("eager_steps", "-"), cnt.get("rollbacks", "-")]]))
    rows += [Row("post-validation", 2, pv["m"], schedule, "sync_ms_per_iter", per_iter["sync"] * 1e3, "ms"),
             Row("post-validation", 2, pv["m"], schedule, "postval_ms_per_iter", per_iter["post-validation"] * 1e3,
                 "ms"),
             Row("post-validation", 2, pv["m"], schedule, "ratio", rat),
             Row("post-validation", 2, pv["m"], schedule, "paired_ratio", paired)]
    log(f"post-validation: sync {ms(per_iter['sync'])} ms/iter, post-validated {ms(per_iter['post-validation'])} "
        f"ms/iter ({rat:.3f})")


# ---------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", default="out/bench", help="output directory (default out/bench)")
    ap.add_argument("--quick", action="store_true", help="1-2 minute smoke run (tiny sizes, few repeats)")
    ap.add_argument("--sections", default=",".join(DEFAULT_SECTIONS),
                    help=f"comma list of {', '.join(SECTIONS)} (default all but dp)")
    ap.add_argument("--ms", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8, 16],
                    help="microbatch counts of the real PP=2 timing (default 4,8,16)")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up rounds of the real timing (default 2)")
    ap.add_argument("--repeats", type=int, default=30, help="timed rounds of the real timing (default 30)")
    ap.add_argument("--layers", type=int, default=8, help="GPT layers of the real model (default 8)")
    ap.add_argument("--hidden", type=int, default=128, help="hidden size (default 128)")
    ap.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    ap.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    ap.add_argument("--vocab", type=int, default=512, help="vocabulary size (default 512)")
    ap.add_argument("--micro-batch", type=int, default=1, help="micro batch size (default 1)")
    ap.add_argument("--emu-scales", type=lambda x: [float(v) for v in x.split(",")], default=None,
                    help="comma list: divide the paper's per-stage times by each (default 1,2: T_F = 18.5 and 9.3 ms; "
                         "--quick: 4)")
    ap.add_argument("--mem-pps", type=lambda x: [int(v) for v in x.split(",")], default=[4, 8],
                    help="comma list of PP sizes for the memory section (default 4,8; m = 2 PP)")
    ap.add_argument("--emu-repeats", type=int, default=10, help="timed rounds of the emulated cluster (default 10)")
    ap.add_argument("--pv-repeats", type=int, default=20,
                    help="timed rounds of the post-validation comparison (default 20)")
    ap.add_argument("--timeout", type=float, default=900.0, help="hard limit per distributed run, seconds")
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="MINUTES",
                    help="first wait up to this long for the 1-minute load average to fall below --quiet-load "
                         "(default 0: start at once); the results record the load either way")
    ap.add_argument("--quiet-load", type=float, default=2.5, help="load average counted as quiet (default 2.5)")
    args = ap.parse_args(argv)
    which = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = set(which) - set(SECTIONS)
    if bad:
        ap.error(f"unknown section(s) {sorted(bad)}; choose from {', '.join(SECTIONS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = configs(args)
    if args.wait_quiet > 0:
        deadline = time.monotonic() + 60 * args.wait_quiet
        while loadavg()[0] >= args.quiet_load and time.monotonic() < deadline:
            log(f"waiting for a quiet machine: 1-min load {loadavg()[0]:.2f} >= {args.quiet_load:g}")
            time.sleep(30)
    t_start = time.perf_counter()
    sampler = LoadSampler()
    load_start = loadavg()
    command = "python " + shlex.join(["scripts/benchmark.py"] + (argv if argv is not None else sys.argv[1:]))
    log(f"{command}; load average at start {load_start[0]:.2f}, {load_start[1]:.2f}, {load_start[2]:.2f}")

    rows: list[Row] = []
    body: list[str] = []
    real_info = None
    marks = []

    def mark(name: str) -> None:
        marks.append(sampler.mark(name))
        log(marks[-1])

    if "real" in which:
        real_info = section_real(cfg, rows, body, out, args.timeout)
        mark("real")
    if "memory" in which:
        section_memory(cfg, rows, body, args.timeout)
        mark("memory")
    if "emulated" in which:
        section_emulated(cfg, rows, body, out, args.timeout)
        mark("emulated")
    if "postval" in which:
        section_postval(cfg, real_info, rows, body, args.timeout)
        mark("postval")
    if "dp" in which:
        from megatron_zb.bench.dp import dp_section
        dp_section(quick=args.quick, timeout=args.timeout, rows=rows, md=body, log=log)
        mark("dp")

    load_line = sampler.stop()
    elapsed = time.perf_counter() - t_start
    head = [
        "# megatron-zb benchmark results\n",
        f"- command: `{command}`",
        f"- date: {datetime.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}",
        f"- machine: {machine()}",
        f"- load: at start {load_start[0]:.2f} / {load_start[1]:.2f} / {load_start[2]:.2f} (1/5/15 min); {load_line}",
        f"- per section: {'; '.join(marks)}",
        f"- wall time: {elapsed:.0f} s" + (" (--quick: smoke-test sizes, numbers not meaningful)"
                                            if args.quick else ""),
        "- GPU throughput is not measured here: CPU processes over gloo only.",
        "- Targets are reported as PASS/FAIL and never fail the script.\n",
    ]
    text = "\n".join(head) + "\n" + "\n".join(body)
    (out / "results.md").write_text(text)
    write_csv(rows, out / "results.csv")
    print(text, flush=True)
    log(f"wrote {out / 'results.md'}, {out / 'results.csv'} and plots; done in {elapsed:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

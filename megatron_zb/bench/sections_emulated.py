"""The ``emulated`` section of the ``cpu`` benchmark (:mod:`megatron_zb.bench.cpu`): sleep-for-compute stages, real runtime and p2p.

:func:`section_emulated` runs :func:`megatron_zb.bench.emulated.emulated_rank` at each PP and
cost scale and appends its table to the results (markdown lines and CSV rows).
"""

from __future__ import annotations

import os
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..planning.memory import mem_w_ratio as paper_mem_w_ratio
from ..schedules import simulate
from ..schedules.registry import build_schedule
from .progress import log
from .report import (LABEL, PAPER_15B, Row, achieved_costs, action_gaps, comm_range, hop_latencies, iteration_times,
                     markdown_table, median, plot_measured_vs_simulated, verdict)

__all__ = ["section_emulated"]


def section_emulated(cfg: dict[str, Any], rows: list[Row], md: list[str], out: Path, timeout: float) -> None:
    from ..testing import run_distributed
    from .emulated import emulated_rank

    scales = cfg["emu_scales"]
    schedules = ["1f1b", "zb-h1", "zb-2p", "zbv", "v-half"]
    h, a, s = PAPER_15B["hidden"], PAPER_15B["heads"], PAPER_15B["seq"]
    mem_w_ratio = paper_mem_w_ratio(hidden_size=h, num_attention_heads=a, seq_length=s)
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
              f"duration of the producer's `isend` call (`Measured.timing.comm`), the first part of a hop; "
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
                ca = achieved_costs([r["achieved"][n] for r in res], c, sched.num_stages)
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

"""Benchmarks of the V-shaped schedules, interleaved-zb and the exact solver (simulated).

Usage:
    python scripts/bench_vshape.py                       # every section except the exact grid
    python scripts/bench_vshape.py --sections exact --exact-time-limit 20
    python scripts/bench_vshape.py --sections table8,unit,sweep,interleaved,exact
    python -m megatron_zb.bench vshape ...               # the same, from an installed package

Prints Markdown tables. Bubble = the simulator's ``bubble_rate``: (makespan - busiest rank's
work) / makespan with makespan = the longest per-rank span (the zero-bubble paper's definition).
"iso" is the same with the isolated-iteration time (first start on any rank to last end on any
rank) instead of the makespan. Memory columns are in full-stage activations (one rank's share of a
microbatch, ``M = mem_b[r] + mem_b[2p-1-r]`` on the V; one stage's ``M_B`` on the plain placement).
"""

from __future__ import annotations

import argparse
import statistics
import time

from megatron_zb.schedules import CostModel, simulate
from megatron_zb.schedules.generators.baselines import interleaved_1f1b, one_f_one_b
from megatron_zb.schedules.generators.greedy import zb_greedy
from megatron_zb.schedules.generators.interleaved_zb import interleaved_zb
from megatron_zb.schedules.generators.vshape import v_half, v_min, v_schedule, zbv
from megatron_zb.schedules.ir import Placement

# Zero-bubble paper, Table 9, 6.2B row (ms per full stage); Table 8 lists ZB-V for three model sizes,
# which we model with these same T ratios (per chunk: times halved; T_comm is per transfer, kept).
PAPER_T = dict(t_f=29.7, t_b=29.4, t_w=19.5, t_comm=0.55)
TABLE8 = [("6.2B", 16, 48, 0.0697), ("14.6B", 24, 72, 0.0638), ("28.3B", 32, 96, 0.0593)]


def per_chunk(t_f: float, t_b: float, t_w: float, t_comm: float, **kw) -> CostModel:
    return CostModel(t_f=t_f / 2, t_b=t_b / 2, t_w=t_w / 2, t_comm=t_comm, **kw)


def iso(res) -> float:
    return (res.total_time - max(res.busy)) / res.total_time


def table8() -> None:
    print("## ZB-V vs the zero-bubble paper's Table 8 (6.2B T ratios: T_F 29.7, T_B 29.4, T_W 19.5, "
          "T_comm 0.55 ms per full stage; chunk = half)\n")
    print("| model | p | m | paper ZB-V | ours ZB-V | ours ZB-V (iso) | ZB-V peak / 1F1B peak | ours 1F1B | seconds |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, p, m, target in TABLE8:
        t0 = time.perf_counter()
        cv = per_chunk(**PAPER_T)
        s = zbv(num_ranks=p, num_microbatches=m, costs=cv)
        dt = time.perf_counter() - t0
        r = simulate(s, cv)
        r1 = simulate(one_f_one_b(num_ranks=p, num_microbatches=m), CostModel(**PAPER_T))
        ratio = (r.max_peak_memory / 2) / r1.max_peak_memory
        print(f"| {name} | {p} | {m} | {target:.4f} | {r.bubble_rate:.4f} | {iso(r):.4f} | {ratio:.2f} "
              f"| {r1.bubble_rate:.4f} | {dt:.1f} |", flush=True)
    print()


def unit() -> None:
    print("## Unit costs (T_F = T_B = T_W = 1 per full stage, 0.5 per chunk; M_W = M_B/2), m = 3p\n")
    print("ZB-V bound: (p-1)*0.5 / ((p-1)*0.5 + 3m) (isolated iteration). Peaks in full-stage activations "
          "(1F1B: p). Targets: V-Half bubble <= 0.6x 1F1B and peak <= p/2+1; V-Min bubble <= 1F1B and "
          "peak <= p/3+1.5.\n")
    print("| p | m | schedule | bubble | bubble (iso) | bound (iso) | / 1F1B bubble | peak | peak target |")
    print("|---|---|---|---|---|---|---|---|---|")
    cv = CostModel(t_f=0.5, t_b=0.5, t_w=0.5)
    for p in (4, 8, 16):
        m = 3 * p
        r1 = simulate(one_f_one_b(num_ranks=p, num_microbatches=m), CostModel())
        bound = (p - 1) * 0.5 / ((p - 1) * 0.5 + 3 * m)
        print(f"| {p} | {m} | 1F1B | {r1.bubble_rate:.4f} | {iso(r1):.4f} | | 1.00 | {r1.max_peak_memory:g} | |")
        for fn, target in ((zbv, f"{p}"), (v_half, f"{p / 2 + 1:g}"), (v_min, f"{p / 3 + 1.5:.2f}")):
            r = simulate(fn(num_ranks=p, num_microbatches=m, costs=cv), cv)
            b = f"{bound:.4f}" if fn is zbv else ""
            print(f"| {p} | {m} | {fn.__name__.replace('_', '-')} | {r.bubble_rate:.4f} | {iso(r):.4f} | {b} "
                  f"| {r.bubble_rate / r1.bubble_rate:.2f} | {r.max_peak_memory / 2:g} | <= {target} |", flush=True)
    print()


def sweep() -> None:
    print("## Memory limit sweep on the V (unit costs, p = 8, m = 24; limit in full-stage activations)\n")
    print("| limit | bubble | peak |")
    print("|---|---|---|")
    cv = CostModel(t_f=0.5, t_b=0.5, t_w=0.5)
    p, m = 8, 24
    for half_steps in range(2, 2 * p + 1):
        lim = half_steps / 2
        r = simulate(v_schedule(num_ranks=p, num_microbatches=m, costs=cv, memory_limit=2 * lim), cv)
        print(f"| {lim:g} | {r.bubble_rate:.4f} | {r.max_peak_memory / 2:g} |", flush=True)
    print()


def interleaved() -> None:
    print("## interleaved-zb vs interleaved 1F1B (same peak memory by default)\n")
    print("| costs | p | m | v | interleaved-1f1b | interleaved-zb | peak 1f1b / zb (chunk M_B) |")
    print("|---|---|---|---|---|---|---|")
    for cname, c in (("unit", CostModel()), ("6.2B/2", per_chunk(**PAPER_T))):
        for p, m, v in ((4, 8, 2), (4, 12, 3), (8, 16, 2), (8, 24, 2), (8, 20, 2)):
            s = interleaved_zb(num_ranks=p, num_microbatches=m, costs=c, num_chunks=v)
            r = simulate(s, c)
            r0 = simulate(interleaved_1f1b(num_ranks=p, num_microbatches=m, num_chunks=v), c)
            print(f"| {cname} | {p} | {m} | {v} | {r0.bubble_rate:.4f} | {r.bubble_rate:.4f} "
                  f"| {r0.max_peak_memory:g} / {r.max_peak_memory:g} |", flush=True)
    print()


EXACT_COSTS = {
    "unit": dict(t_f=1.0, t_b=1.0, t_w=1.0, t_comm=0.0),
    "6.2B": PAPER_T,
    "skew": dict(t_f=1.0, t_b=1.5, t_w=0.5, t_comm=0.1),
}


def exact(time_limit: float) -> None:
    from megatron_zb.schedules.generators.exact import solve_exact
    print(f"## Heuristics vs the exact solver (CP-SAT, {time_limit:g} s per instance, 2 workers; "
          f"memory limit = 1F1B's peak)\n")
    print("gap = (heuristic - optimum) / optimum, over instances the solver proved optimal.\n")
    print("| placement | heuristic | costs | p | m | heuristic | optimum / best | proven | bound gap | seconds |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    gaps: dict[str, list[float]] = {}
    unproven: list[str] = []
    for placement in (Placement.V, Placement.PLAIN):
        for cname, t in EXACT_COSTS.items():
            for p in (2, 3, 4):
                for m in range(2, 7):
                    if placement is Placement.V:
                        c = per_chunk(**t)
                        heur = zbv(num_ranks=p, num_microbatches=m, costs=c)
                        hname = "zbv"
                    else:
                        c = CostModel(**t)
                        heur = zb_greedy(num_ranks=p, num_microbatches=m, costs=c, memory_limit=float(p))
                        hname = "zb_greedy"
                    s2r = placement.stage_to_rank(p)
                    lim = heur.meta["memory_limit"]
                    hm = simulate(heur, c.with_limit(lim)).makespan
                    res = solve_exact(stage_to_rank=s2r, num_microbatches=m, costs=c, memory_limit=lim,
                                      warm_start=heur, time_limit=time_limit)
                    gap = (hm - res.makespan) / res.makespan
                    tag = f"{placement}/{cname}/p{p}/m{m}"
                    if res.optimal:
                        gaps.setdefault(hname, []).append(gap)
                    else:
                        unproven.append(tag)
                    print(f"| {placement} | {hname} | {cname} | {p} | {m} | {hm:.4g} | {res.makespan:.4g} | "
                          f"{'yes' if res.optimal else 'no'} | {res.gap:.3f} | {res.wall_time:.1f} |", flush=True)
    print()
    print("| heuristic | proven instances | max gap | median gap | within 3% |")
    print("|---|---|---|---|---|")
    for h, g in gaps.items():
        print(f"| {h} | {len(g)} | {max(g):.4f} | {statistics.median(g):.4f} | {sum(x <= 0.03 + 1e-12 for x in g)} |")
    if unproven:
        print(f"\nnot proven optimal within the time limit: {', '.join(unproven)}")
    print()


def main(argv: list[str] | None = None, *, invoked_as: tuple[str, ...] = ("scripts/bench_vshape.py",)) -> None:
    """The benchmark on ``argv`` (default ``sys.argv[1:]``); ``invoked_as``: what follows ``python`` in
    the command line printed first (``scripts/bench_vshape.py``, or ``-m megatron_zb.bench.vshape``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", default="table8,unit,sweep,interleaved",
                    help="comma-separated: table8, unit, sweep, interleaved, exact")
    ap.add_argument("--exact-time-limit", type=float, default=20.0, help="seconds per exact solve")
    args = ap.parse_args(argv)
    print(f"<!-- python {' '.join(invoked_as)} --sections {args.sections}"
          + (f" --exact-time-limit {args.exact_time_limit:g}" if "exact" in args.sections else "") + " -->\n")
    for sec in args.sections.split(","):
        sec = sec.strip()
        if sec == "exact":
            exact(args.exact_time_limit)
        elif sec in ("table8", "unit", "sweep", "interleaved"):
            globals()[sec]()
        else:
            ap.error(f"unknown section {sec!r}")


if __name__ == "__main__":
    main(invoked_as=("-m", "megatron_zb.bench.vshape"))

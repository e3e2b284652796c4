"""Rerunnable benchmarks of megatron-zb on a CPU machine (gloo, real processes).

Sections (all but ``dp`` on by default; ``--sections`` picks some):

* ``real``      -- tiny megatron-core GPT, PP=2 (2 processes, 1 torch thread each), m in --ms:
  iteration time of megatron-core's own 1F1B (forward_backward_pipelining_without_interleaving)
  versus megatron-zb's runtime running 1F1B, ZB-H1, ZB-2p and ZB-V, interleaved round-robin over
  the repeats, warm-up excluded, median, as a ratio to megatron-core's 1F1B. ZB-2p and ZB-V are
  re-planned with T_F/T_B/T_W measured by ``time_actions`` on this model (and the measured p2p
  latency) before they are timed. Also: the runtime's own overhead per compute action (CPU and
  wall microseconds outside compute actions and p2p calls, target <= 50), the achieved action
  durations against the planned costs, and peak activation bytes per rank of each schedule.
* ``memory``    -- the same activation-memory measurement at PP in --mem-pps (default 4 and 8,
  m = 2 PP; timing-insensitive).
* ``emulated``  -- emulated cluster, P=4 and 8 processes: each stage's compute is a calibrated
  sleep of the zero-bubble paper's 1.5B costs divided by --emu-scales, real runtime, real p2p;
  measured iteration time versus the simulator's isolated-iteration time.
* ``postval``   -- megatron-core's synchronous optimizer step versus post-validation
  (megatron_zb.optimizer.PostValidationOptimizer), same zero-bubble schedule, same run.
* ``dp``        -- emulated PP=4 x DP=2 with data-parallel gradient-reduce overlap off and on,
  beside the simulator's prediction (megatron_zb.bench.dp, its docstring); only when asked for.

The sections live in megatron_zb.bench (sections_real, sections_emulated); this module holds
the command line and the results file (``python -m megatron_zb.bench cpu``; scripts/benchmark.py calls it).

Progress goes to stderr, one line per round (variant times, elapsed, ETA); the tables to stdout and to --out DIR (results.md, results.csv, PNGs).
Target columns (PASS/FAIL) are reported, never enforced: the exit status is 0 whenever the
benchmark ran.

Usage: python scripts/benchmark.py [--quick] [--out DIR] [--sections real,memory,emulated,postval,dp]
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import megatron_zb  # noqa: F401  (CPU shim)
from megatron_zb.bench.machine import LoadSampler, loadavg, machine
from megatron_zb.bench.progress import log
from megatron_zb.bench.report import Row, write_csv
from megatron_zb.bench.sections_emulated import section_emulated
from megatron_zb.bench.sections_real import section_memory, section_postval, section_real

SECTIONS = ("real", "memory", "emulated", "postval", "dp")  # dp: megatron_zb.bench.dp (its docstring)
DEFAULT_SECTIONS = SECTIONS[:4]  # dp runs only when asked for (8 processes, 1-2 minutes even with --quick)


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


# ---------------------------------------------------------------------- main
def main(argv: list[str] | None = None, *, invoked_as: tuple[str, ...] = ("scripts/benchmark.py",)) -> int:
    """The benchmark on ``argv`` (default ``sys.argv[1:]``); ``invoked_as``: what follows ``python`` in
    the command line the results record (``scripts/benchmark.py``, or ``-m megatron_zb.bench.cpu``)."""
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
    ap.add_argument("--timeout", type=float, default=3600.0,
                    help="hard limit per distributed run, seconds (default 3600: a hang guard; the real section "
                    "at hidden 512 / seq 256 runs about 15 min)")
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
    command = "python " + shlex.join([*invoked_as] + (argv if argv is not None else sys.argv[1:]))
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
        from megatron_zb.bench.dp_report import dp_section
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
    sys.exit(main(invoked_as=("-m", "megatron_zb.bench.cpu")))

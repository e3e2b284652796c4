"""Is ``pretrain_gpt_zb.py`` at PP=1 bound by the host? One variant of the run per call, side by side.

``python -m megatron_zb.testing.host_bound --variant NAME --dir DIR [--timeout S] -- <pretrain flags>``

runs ``pretrain_gpt_zb.py`` on one process (:func:`megatron_zb.testing.pretrain_run.launch`) with the
given flags, the variant's own flags (:data:`VARIANTS`: the data loader as before, with worker
processes, or without the attention mask built in the loader) and ``--profile-out`` /
``--loss-log-json`` in ``DIR/NAME/``. From the run's log it reads the schedule report printed after
the profiling window -- the medians T_F / T_B / T_W (ms per micro batch), the measured idle fraction,
every other ``measured ...`` line -- the median logged iteration time after the window, and every line
that says ``host-bound`` (the trainer's diagnosis, where it prints one). It writes ``DIR/NAME.json``
and prints one table of every variant measured so far in ``DIR``, so the last variant's output shows
all of them side by side.

PASS when the run exits 0 with finite losses and its report has measured costs (the window ended);
the numbers are for reading, not a verdict. At PP=1 the trainer measures but does not write
``--profile-out`` (the planner models pipelines of PP >= 2): that is a note in the output, not a
failure. The last line is ``host-bound NAME: PASS: ...`` or ``host-bound NAME: FAIL: ...``; exit 0 /
1, 2 for a bad command line. Runs on CPU too (gloo, tiny sizes; ``tests/bench/test_gpu_selftest.py``).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

__all__ = ["VARIANTS", "Variant", "main", "read_report", "side_by_side", "variant_flags"]


@dataclass(frozen=True)
class Variant:
    """One way of running the same model: what it changes and its flags."""

    what: str
    flags: tuple[str, ...]


VARIANTS: dict[str, Variant] = {
    "before": Variant("as before: no data workers, attention mask built in the loader", ("--num-workers", "0")),
    "workers": Variant("2 data workers, mask built in the loader", ("--num-workers", "2")),
    "no-mask": Variant("no data workers, no attention mask in the loader",
                       ("--num-workers", "0", "--no-create-attention-mask-in-dataloader")),
}
"""The variants, in the order they are shown."""

_COSTS = re.compile(r"measured costs \(ms\): (.*)$")
_PAIR = re.compile(r"(\w+)=([-+0-9.eE]+)")


def variant_flags(name: str, common: Sequence[str], run_dir: Path) -> list[str]:
    """The ``pretrain_gpt_zb.py`` flags of variant ``name``, its files in ``run_dir``."""
    return [*common, *VARIANTS[name].flags, "--profile-out", str(run_dir / "profile.json"),
            "--loss-log-json", str(run_dir / "loss.json")]


def read_report(log_lines: Sequence[str], window_end: int) -> dict[str, Any]:
    """From a run's output: ``costs`` (ms; the last ``measured costs`` line), ``measured`` (every
    ``measured ...`` line of the report that holds it), ``iteration_ms`` (median of the iterations from
    ``window_end`` on, else None) and ``host_bound`` (every line saying ``host-bound``)."""
    from ..training.logging_utils import parse_iteration_line

    costs: dict[str, float] = {}
    measured: list[str] = []
    block: list[str] = []
    times, host = [], []
    for raw in log_lines:
        line = raw.rstrip("\n")
        if line.startswith("> schedule report"):
            block = []
        elif line.startswith("    measured"):
            block.append(line.strip())
        m = _COSTS.search(line)
        if m:
            costs = {k: float(v) for k, v in _PAIR.findall(m.group(1))}
            measured = block
        if "host-bound" in line.lower():
            host.append(line.strip())
        try:
            rec = parse_iteration_line(line)
        except ValueError:
            continue
        if rec["iteration"] >= window_end and "elapsed time per iteration (ms)" in rec:
            times.append(float(rec["elapsed time per iteration (ms)"]))
    return {"costs": costs, "measured": measured, "host_bound": host,
            "iteration_ms": statistics.median(times) if times else None}


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def side_by_side(results: dict[str, dict[str, Any]]) -> str:
    """One table: a row per variant (T_F / T_B / T_W medians and iteration, ms), then their host-bound lines."""
    lines = ["| variant  | T_F ms | T_B ms | T_W ms | iteration ms | result | what",
             "|----------|--------|--------|--------|--------------|--------|-----"]
    for name in VARIANTS:
        r = results.get(name)
        if r is None:
            lines.append(f"| {name:<8} | {'-':>6} | {'-':>6} | {'-':>6} | {'-':>12} | {'-':<6} | "
                         f"{VARIANTS[name].what} (not run yet)")
            continue
        c = r["report"]["costs"]
        lines.append(f"| {name:<8} | {_fmt(c.get('T_F')):>6} | {_fmt(c.get('T_B')):>6} | {_fmt(c.get('T_W')):>6} | "
                     f"{_fmt(r['report']['iteration_ms']):>12} | {r['status']:<6} | {VARIANTS[name].what}")
    for name in VARIANTS:
        r = results.get(name)
        for line in (r or {}).get("report", {}).get("host_bound", []):
            lines.append(f"{name}: {line}")
    return "\n".join(lines)


def _load(dir_: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for name in VARIANTS:
        path = dir_ / f"{name}.json"
        if path.is_file():
            out[name] = json.loads(path.read_text())
    return out


def _verdict(name: str, res: dict[str, Any], report: dict[str, Any]) -> str:
    problems = list(res["problems"])
    if res["exit"] == 0 and not report["costs"]:
        problems.append("no measured costs in the log (the profiling window did not end)")
    if problems:
        return f"host-bound {name}: FAIL: {'; '.join(problems)}"
    c = report["costs"]
    parts = [", ".join(f"{k} {c[k]:.1f}" for k in ("T_F", "T_B", "T_W") if k in c) + " ms",
             f"iteration {_fmt(report['iteration_ms'])} ms after the window", f"{res['seconds']:g} s"]
    parts += [ln for ln in report["measured"] if "idle" in ln] + res["notes"]
    return f"host-bound {name}: PASS: {'; '.join(parts)}"


def main(argv: Sequence[str] | None = None) -> int:
    """Command line (see the module docstring)."""
    from .cli_args import split_passthrough
    from .pretrain_run import check_run, flag_value, launch

    parts = split_passthrough(sys.argv[1:] if argv is None else argv, prog="host_bound",
                              what="the pretrain_gpt_zb.py flags common to every variant")
    if parts is None:
        return 2
    own, common = parts
    ap = argparse.ArgumentParser(prog="python -m megatron_zb.testing.host_bound", description=__doc__.split("\n")[0])
    ap.add_argument("--variant", required=True, choices=list(VARIANTS))
    ap.add_argument("--dir", required=True, help="directory of the variants' runs and results")
    ap.add_argument("--timeout", type=float, default=600.0, help="hard limit of the run, seconds")
    ap.add_argument("--kill-grace", type=float, default=5.0, help="seconds torchrun gets to stop after the timeout")
    args = ap.parse_args(own)
    dir_ = Path(args.dir)
    run_dir = dir_ / args.variant
    flags = variant_flags(args.variant, common, run_dir)
    print(f"host-bound {args.variant}: {VARIANTS[args.variant].what}", flush=True)
    run = launch(flags, nproc=1, out=run_dir, timeout=args.timeout, kill_grace=args.kill_grace)
    res = check_run(run_dir, flags, nproc=1, exit_code=run.exit_code, seconds=run.seconds, timeout=args.timeout,
                    label=f"host-bound {args.variant}", log_lines=run.log_lines, profile_required=False)
    end = int(flag_value(flags, "--zero-bubble-pipeline-timers-end-iter") or 4)
    report = read_report(run.log_lines, end)
    line = _verdict(args.variant, res, report)
    status = line.split(": ", 2)[1]
    (dir_ / f"{args.variant}.json").write_text(json.dumps({"status": status, "report": report, "result": res}) + "\n")
    print(side_by_side(_load(dir_)), flush=True)
    print(line, flush=True)
    return 0 if status == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())

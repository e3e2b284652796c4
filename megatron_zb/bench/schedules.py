"""Compare our schedules with PyTorch's pipelining schedules under one cost model.

Every registered schedule of ours (``megatron_zb.schedules.registry``) and every PyTorch schedule
class we can import (``megatron_zb.schedules.torch_import``) is built, validated and simulated with
the project's simulator under the SAME costs. One markdown table per setting:

* ``unit``: T_F = T_B = T_W = 1 per full stage (one rank's share of the model), a chunk of a
  rank with v chunks costs 1/v of that; M_W = M_B / 2; T_comm = 0; m = 3p for p = 4 and 8.
* ``paper``: the zero-bubble paper's profiled rows (p = 8, m = 24/32/64; T per full stage, T_comm
  between ranks), M_B = s*b*(34h + 5as), M_W = 32*s*b*h per layer (only their ratio matters here).

Columns: bubble = the project's metric (``SimResult.bubble_rate``: (max per-rank span - max busy)
/ max span, the paper's definition); "isolated" = (time of one isolated iteration - max busy) /
that time, which also counts the ranks' staggered starts (what the shared notes measured);
peak = per-rank maximum of held activation memory in units of one full stage's M_B (a chunk holds
M_B / v); "ours-best <= mem" = our lowest-bubble schedule whose peak is at most this row's peak;
ratio = this row's bubble / that one's (1.00 = as good as our best at no more memory).

PyTorch shape constraints (torch 2.13) are listed under each table; every setting here uses
m a multiple of p, which all PyTorch classes accept (DualPipeV also needs m >= 2p, true for m = 3p).
A PyTorch schedule that fails to convert or validate is a table row marked invalid with the reason.

Usage: python scripts/bench_schedules.py [--out FILE.md] [--settings unit,paper] [--skip NAMES]
(or ``python -m megatron_zb.bench schedules ...``: the same, from an installed package)
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_zb.planning.memory import mem_w_ratio
from megatron_zb.schedules import CostModel, Placement, ScheduleError, simulate
from megatron_zb.schedules.registry import build_schedule, get_spec, schedule_names
from megatron_zb.schedules.torch_import import (TORCH_SCHEDULES, TorchImportError, import_torch_schedule,
                                                torch_schedule_names)

ROOT = Path(__file__).resolve().parents[2]
"""The source checkout this module runs from, if it is one: its ``tests/data/zb_paper_costs.json`` is
read when present (an installed package has no ``tests/``: the embedded copy below is used)."""

NUM_CHUNKS = 2
"""Chunks per rank for the interleaved placements (ours and PyTorch's)."""

# Fallback copy of the zero-bubble paper's numbers (arXiv 2401.10241, Tables 3, 5 and 9), used only
# when tests/data/zb_paper_costs.json is absent (an installed package; the tables then lack the paper's
# bubble rates). Per row: model, m, T_F, T_B, T_W, T_comm (ms).
_PAPER_MODELS = {"1.5B": {"hidden": 2304, "heads": 24, "seq": 1024, "p": 8},
                 "6.2B": {"hidden": 4096, "heads": 32, "seq": 1024, "p": 8}}
_PAPER_ROWS = [
    ("1.5B", 24, 18.522, 18.086, 9.337, 0.601), ("1.5B", 32, 18.513, 18.086, 9.331, 0.626),
    ("1.5B", 64, 18.546, 18.097, 9.321, 0.762), ("6.2B", 24, 29.718, 29.444, 19.927, 0.527),
    ("6.2B", 32, 29.802, 29.428, 19.530, 0.577), ("6.2B", 64, 29.935, 29.621, 19.388, 0.535),
]
_PAPER_NAMES = {"1f1b": "1F1B", "interleaved-1f1b": "1F1B-I", "zb-h1": "ZB-H1", "zb-h2": "ZB-H2",
                "zb-1p": "ZB-1p", "zb-2p": "ZB-2p"}
"""Our name -> the paper's column, to show the paper's reported bubble rate next to ours."""


@dataclass
class Setting:
    title: str
    p: int
    m: int
    t_f: float
    t_b: float
    t_w: float
    t_comm: float
    mem_w_ratio: float
    paper: dict[str, float] | None = None

    def costs(self, chunks: int) -> CostModel:
        """Per-stage costs when each rank holds ``chunks`` stages (a stage is 1/chunks of a rank's share)."""
        v = float(chunks)
        return CostModel(t_f=self.t_f / v, t_b=self.t_b / v, t_w=self.t_w / v, t_comm=self.t_comm,
                         mem_b=1.0 / v, mem_w=self.mem_w_ratio / v)


@dataclass
class Row:
    name: str
    source: str
    placement: str
    bubble: float | None = None
    isolated: float | None = None
    peak: float | None = None
    error: str = ""
    note: str = ""
    paper: float | None = None


class _Timeout(Exception):
    pass


def _on_alarm(signum, frame):  # noqa: ARG001
    raise _Timeout()


def _run_limited(fn, seconds: float):
    """Run ``fn()``, raising _Timeout after ``seconds`` (pure-Python code only; 0 = no limit)."""
    if seconds <= 0 or not hasattr(signal, "setitimer"):
        return fn()
    old = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _measure(row: Row, sched, costs: CostModel) -> Row:
    res = simulate(sched, costs, enforce_memory=False)
    row.bubble = res.bubble_rate
    row.isolated = (res.total_time - max(res.busy)) / res.total_time if res.total_time else 0.0
    row.peak = res.max_peak_memory
    return row


def _placement_label(kind: Placement, chunks: int) -> str:
    return {Placement.PLAIN: "plain", Placement.V: "V", Placement.INTERLEAVED: f"interleaved v={chunks}"}[kind]


def _short(msg: str, limit: int = 200) -> str:
    msg = " ".join(str(msg).split()).replace("|", "/")
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def run_setting(st: Setting, ours: list[str], theirs: list[str], time_limit: float, log) -> list[Row]:
    rows: list[Row] = []
    for name in ours:
        spec = get_spec(name)
        v = spec.chunks_per_rank(NUM_CHUNKS)
        row = Row(name, "ours", _placement_label(spec.placement, v),
                  paper=(st.paper or {}).get(_PAPER_NAMES.get(name, "")))
        t0 = time.perf_counter()
        try:
            costs = st.costs(v)
            sched = _run_limited(lambda: build_schedule(name, num_ranks=st.p, num_microbatches=st.m, costs=costs,
                                                        num_chunks=NUM_CHUNKS), time_limit)
            _measure(row, sched, costs)
        except _Timeout:
            row.error = f"not built: exceeded the {time_limit:g}s limit (--time-limit)"
        except Exception as e:  # a generator's failure is a table row, not a crash
            row.error = f"not built: {type(e).__name__}: {e}"
        log(f"  ours    {name:32s} {time.perf_counter() - t0:6.2f}s {row.error and 'ERROR ' + _short(row.error, 80)}")
        rows.append(row)
    for cls_name in theirs:
        info = TORCH_SCHEDULES[cls_name]
        v = info.chunks(NUM_CHUNKS)
        variants = [(cls_name, False)] + ([(f"{cls_name} (repaired)", True)] if cls_name == "Schedule1F1B" else [])
        for label, repair in variants:
            row = Row(label, "PyTorch", _placement_label(info.placement, v))
            t0 = time.perf_counter()
            try:
                sched = import_torch_schedule(cls_name, num_ranks=st.p, num_microbatches=st.m,
                                              num_chunks=NUM_CHUNKS, repair=repair)
                _measure(row, sched, st.costs(v))
                if sched.meta.get("repaired"):
                    row.note = ("Schedule1F1B (repaired): PyTorch's list for the last rank numbers its forwards "
                                "1..m; renumbered to 0..m-1 (import_torch_schedule(..., repair=True)).")
            except TorchImportError as e:
                row.error = f"invalid: {e}"
            except ScheduleError as e:
                row.error = f"invalid: {type(e).__name__}: {e}"
            log(f"  PyTorch {label:32s} {time.perf_counter() - t0:6.2f}s "
                f"{row.error and 'INVALID ' + _short(row.error, 80)}")
            rows.append(row)
    return rows


def _fmt(x: float | None, nd: int = 4) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def render(st: Setting, rows: list[Row]) -> str:
    ours_ok = [r for r in rows if r.source == "ours" and r.bubble is not None]
    has_paper = st.paper is not None
    head = ["schedule", "source", "placement", "bubble", "isolated", "peak mem (M_B)", "ours-best <= mem", "ratio"]
    if has_paper:
        head.insert(5, "paper")
    out = [f"### {st.title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    eps = 1e-9
    for r in rows:
        if r.bubble is None:
            cells = [r.name, r.source, r.placement, "invalid" if r.source == "PyTorch" else "error", "-", "-",
                     "-", _short(r.error)]
            if has_paper:
                cells.insert(5, _fmt(r.paper))
            out.append("| " + " | ".join(cells) + " |")
            continue
        fit = [o for o in ours_ok if o.peak <= r.peak * (1 + eps) + eps]
        if fit:
            best = min(fit, key=lambda o: (o.bubble, o.peak))
            best_s = f"{best.name} ({best.bubble:.4f})"
            if best.bubble > eps:
                ratio = f"{r.bubble / best.bubble:.2f}"
            else:
                ratio = "1.00" if r.bubble <= eps else "inf (ours 0)"
        else:
            best_s, ratio = "none fits", "-"
        name = r.name + ("*" if r.note else "")
        cells = [name, r.source, r.placement, _fmt(r.bubble), _fmt(r.isolated), _fmt(r.peak, 2), best_s, ratio]
        if has_paper:
            cells.insert(5, _fmt(r.paper))
        out.append("| " + " | ".join(cells) + " |")
    notes = sorted({r.note for r in rows if r.note})
    if notes:
        out += [""] + [f"\\* {n}" for n in notes]
    return "\n".join(out) + "\n"


def load_paper() -> tuple[list[Setting], str]:
    path = ROOT / "tests" / "data" / "zb_paper_costs.json"
    rows: list[tuple] = []
    models = _PAPER_MODELS
    paper_cols: list[dict[str, float]] = [{} for _ in _PAPER_ROWS]
    source = "embedded copy in megatron_zb/bench/schedules.py"
    try:
        d = json.loads(path.read_text())
        models = {k: {"hidden": v["hidden"], "heads": v["heads"], "seq": v["seq"], "p": v["p"]}
                  for k, v in d["models"].items()}
        rows = [(r["model"], r["m"], r["TF"], r["TB"], r["TW"], r["Tcomm"]) for r in d["rows"]]
        paper_cols = [{k: v for k, v in r.items() if k in _PAPER_NAMES.values()} for r in d["rows"]]
        source = str(path.relative_to(ROOT))
    except (OSError, KeyError, TypeError, ValueError):
        rows = list(_PAPER_ROWS)
    settings = []
    for (model, m, tf, tb, tw, tc), cols in zip(rows, paper_cols):
        md = models[model]
        h, a, s = md["hidden"], md["heads"], md["seq"]
        ratio = mem_w_ratio(hidden_size=h, num_attention_heads=a, seq_length=s)
        settings.append(Setting(
            f"(b) paper {model}, p={md['p']}, m={m}: T_F={tf}, T_B={tb}, T_W={tw}, T_comm={tc} ms per stage, "
            f"M_W/M_B={ratio:.3f}", md["p"], m, tf, tb, tw, tc, ratio, paper=cols or None))
    return settings, source


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="also write the tables to this markdown file")
    ap.add_argument("--settings", default="unit,paper", help="comma list of: unit, paper (default both)")
    ap.add_argument("--skip", default="", help="comma list of our schedule names to leave out")
    ap.add_argument("--time-limit", type=float, default=20.0,
                    help="seconds allowed for building one of our schedules (0 = none; default 20)")
    args = ap.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    t_start = time.perf_counter()
    which = {s.strip() for s in args.settings.split(",") if s.strip()}
    bad = which - {"unit", "paper"}
    if bad:
        ap.error(f"unknown setting(s) {sorted(bad)}; choose from unit, paper")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    ours = [n for n in schedule_names() if n not in skip]
    theirs = torch_schedule_names()

    settings: list[Setting] = []
    if "unit" in which:
        for p in (4, 8):
            settings.append(Setting(f"(a) unit costs, p={p}, m={3 * p}: T_F=T_B=T_W=1 per full stage, "
                                    f"M_W=M_B/2, T_comm=0", p, 3 * p, 1.0, 1.0, 1.0, 0.0, 0.5))
    paper_source = ""
    if "paper" in which:
        paper_settings, paper_source = load_paper()
        settings += paper_settings

    command = "python " + shlex.join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:]))
    parts = [f"`{command}`", "",
             f"Ours: {', '.join(ours)}. PyTorch: {', '.join(theirs) or 'not available'}; "
             f"interleaved placements use v={NUM_CHUNKS} chunks per rank."
             + (f" Paper costs from {paper_source}." if paper_source else ""), "",
             "bubble = (max per-rank span - max busy) / max span (SimResult.bubble_rate, the paper's); "
             "isolated = same with one isolated iteration's length instead of the max span; peak in units of "
             "one full stage's M_B; ratio = bubble / bubble of ours-best at <= equal peak memory; "
             "paper = the paper's reported bubble rate.", ""]
    print("\n".join(parts), flush=True)
    for st in settings:
        log(f"[{st.title.split(':')[0]}]")
        rows = run_setting(st, ours, theirs, args.time_limit, log)
        table = render(st, rows)
        print(table, flush=True)
        parts.append(table)
    notes = ["PyTorch shape constraints (torch 2.13, checked by their constructors): "
             + "; ".join(f"{n}: {TORCH_SCHEDULES[n].constraints}" for n in theirs) + ".", ""]
    print("\n".join(notes), flush=True)
    parts += notes
    if args.out:
        Path(args.out).write_text("\n".join(parts))
        log(f"wrote {args.out}")
    log(f"done in {time.perf_counter() - t_start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

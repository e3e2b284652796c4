"""Pure helpers of the benchmark: iteration times, medians, ratios, CSV rows, markdown, plots.

Nothing here measures anything; the sections (:mod:`megatron_zb.bench.sections_real`,
:mod:`megatron_zb.bench.sections_emulated`) feed it the per-rank results of
:mod:`megatron_zb.bench.real` and :mod:`megatron_zb.bench.emulated`.
"""

from __future__ import annotations

import csv
import math
import statistics
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from ..schedules.ir import Op

__all__ = [
    "LABEL", "PAPER_15B", "achieved_costs", "comm_range", "fmt_ratio", "ms", "Row", "action_gaps", "hop_latencies", "iteration_times", "median", "paired_ratios", "ratios", "verdict",
    "markdown_table", "write_csv", "read_csv", "plot_ratio_bars", "plot_measured_vs_simulated",
]


LABEL = {"megatron-1f1b": "megatron-core 1F1B", "1f1b": "1F1B", "zb-h1": "ZB-H1", "zb-2p": "ZB-2p",
         "zbv": "ZB-V", "v-half": "V-Half"}
"""How the tables name each variant."""

PAPER_15B = dict(t_f=18.522, t_b=18.086, t_w=9.337, hidden=2304, heads=24, seq=1024)
"""The zero-bubble paper's 1.5B model, p=8, m=24 row (ms per stage; arXiv 2401.10241 Table 9)."""


def ms(x: float) -> str:
    """Seconds as milliseconds with one decimal (``-`` for nan)."""
    return f"{x * 1e3:.1f}" if x == x else "-"


def comm_range(samples: list[float]) -> str:
    """Median, min, max of p2p latency samples (ms)."""
    if not samples:
        return "not sampled"
    return f"median {median(samples):.3f} ms (min {min(samples):.3f}, max {max(samples):.3f}, {len(samples)} samples)"


def fmt_ratio(x: float) -> str:
    return f"{x:.3f}" if x == x else "-"


def achieved_costs(per_rank: Sequence[Mapping[Op, Mapping[int, Sequence[float]]]], c: Any, num_stages: int) -> Any:
    """``c`` (a CostModel, ms) with each stage's T_F / T_B / T_W replaced by the achieved median
    action durations: ``per_rank`` holds, per rank, ``{op: {stage: [seconds, ...]}}`` of the
    timed iterations (``ActionTiming.durations``; ``op`` an :class:`~megatron_zb.schedules.Op` or its
    string value, which compares and hashes equal). With a fused ``BW`` T_B is kept and the rest of
    the achieved BW goes into T_W."""
    from ..schedules import CostModel

    ach: dict[Op, dict[int, float]] = {}
    for r in per_rank:
        for op, d in r.items():
            for st, xs in d.items():
                if xs:
                    ach.setdefault(Op(op), {})[st] = statistics.median(xs) * 1e3
    sc = c.resolve(num_stages)
    tf = [ach.get(Op.F, {}).get(st, sc.t_f[st]) for st in range(num_stages)]
    if Op.BW in ach:  # fused backward: keep T_B, put the rest of the achieved BW into T_W
        tb = list(sc.t_b)
        tw = [max(0.0, ach[Op.BW].get(st, tb[st] + sc.t_w[st]) - tb[st]) for st in range(num_stages)]
    else:
        tb = [ach.get(Op.B, {}).get(st, sc.t_b[st]) for st in range(num_stages)]
        tw = [ach.get(Op.W, {}).get(st, sc.t_w[st]) for st in range(num_stages)]
    return CostModel(t_f=tf, t_b=tb, t_w=tw, t_comm=c.t_comm, mem_b=c.mem_b, mem_w=c.mem_w)


@dataclass(frozen=True)
class Row:
    """One number of the results, as a line of ``results.csv`` (tidy format).

    ``section``: ``real-timing``, ``real-targets``, ``emulated``, ``memory``, ``post-validation``;
    ``p``: pipeline ranks; ``m``: microbatches; ``variant``: schedule or variant name;
    ``metric``: what ``value`` is (e.g. ``median_ms``, ``ratio_vs_megatron_1f1b``); ``unit``.
    """

    section: str
    p: int
    m: int
    variant: str
    metric: str
    value: float
    unit: str = ""


def iteration_times(per_rank: Sequence[Sequence[tuple[float, float]]]) -> list[float]:
    """Per iteration, ``max(end over ranks) - min(start over ranks)`` (seconds).

    ``per_rank[r][i]`` is ``(start, end)`` of iteration ``i`` on rank ``r``, all on the same
    machine-wide monotonic clock (``time.perf_counter`` on Linux). Every rank must report the
    same number of iterations.
    """
    if not per_rank:
        return []
    n = len(per_rank[0])
    if any(len(x) != n for x in per_rank):
        raise ValueError(f"ranks reported different numbers of iterations: {[len(x) for x in per_rank]}")
    return [max(r[i][1] for r in per_rank) - min(r[i][0] for r in per_rank) for i in range(n)]


def median(xs: Iterable[float]) -> float:
    """The median (``nan`` for no values)."""
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def ratios(values: Mapping[str, float], baseline: str) -> dict[str, float]:
    """``values[k] / values[baseline]`` for every key (the baseline's own ratio is 1.0)."""
    if baseline not in values:
        raise KeyError(f"baseline {baseline!r} not among {sorted(values)}")
    b = values[baseline]
    if not b:
        raise ZeroDivisionError(f"baseline {baseline!r} is {b}")
    return {k: v / b for k, v in values.items()}


def _action_waits(records: Sequence[Sequence[tuple[Op, int, int, float, float]]],
                  stage_to_rank: Sequence[int]) -> Iterator[tuple[float, float | None, float | None]]:
    """Per compute action, rank by rank in execution order: ``(start, previous end, producer end)``.

    ``previous end`` is the end of the rank's previous action (``None`` for its first one);
    ``producer end`` is the end of the action on another rank it takes its input from -- ``F(mb,
    s - 1)`` for ``F(mb, s)``, ``B``/``BW(mb, s + 1)`` for ``B``/``BW(mb, s)`` -- or ``None`` when
    that stage is on the same rank or the producer is not in ``records``.
    """
    end: dict[tuple[Op, int, int], float] = {}  # a BW ends its B: recorded under Op.B
    for recs in records:
        for op, mb, st, _, t1 in recs:
            end[(Op.B if Op(op) is Op.BW else Op(op), mb, st)] = t1
    last = len(stage_to_rank) - 1
    for recs in records:
        prev = None
        for op, mb, st, t0, t1 in recs:
            op, dep = Op(op), None
            if op is Op.F and st > 0 and stage_to_rank[st - 1] != stage_to_rank[st]:
                dep = end.get((Op.F, mb, st - 1))
            elif op in (Op.B, Op.BW) and st < last and stage_to_rank[st + 1] != stage_to_rank[st]:
                dep = end.get((Op.B, mb, st + 1))
            yield t0, prev, dep
            prev = t1


def hop_latencies(records: Sequence[Sequence[tuple[Op, int, int, float, float]]],
                  stage_to_rank: Sequence[int]) -> list[float]:
    """Observed latency (seconds) of cross-rank dependencies the receiver was waiting for.

    ``records[r]`` are rank ``r``'s compute actions of one iteration, ``(op, mb, stage, start,
    end)`` in execution order, on a machine-wide clock. For each ``F(mb, s)`` whose input comes
    from another rank (and each ``B``/``BW(mb, s)`` whose output gradient does), when the rank's
    previous action ended before that producer did -- the rank sat waiting -- the latency is
    ``start - end of the producer``: what the simulator's ``t_comm`` stands for, here including
    the runtime's send/receive work and the receiver's wake-up.
    """
    return [t0 - dep for t0, prev, dep in _action_waits(records, stage_to_rank)
            if dep is not None and prev is not None and prev < dep]


def action_gaps(records: Sequence[Sequence[tuple[Op, int, int, float, float]]],
                stage_to_rank: Sequence[int]) -> list[float]:
    """Idle time (seconds) between consecutive compute actions of a rank that did not wait for data.

    Same ``records`` as :func:`hop_latencies`. For each compute action after the first on a rank
    whose cross-rank input (if any) was already produced when the rank's previous action ended,
    the gap ``start - previous end`` is the runtime's own work between compute actions (sends,
    receive bookkeeping, the executor loop): what the simulator assumes to be zero.
    """
    return [t0 - prev for t0, prev, dep in _action_waits(records, stage_to_rank)
            if prev is not None and (dep is None or dep <= prev)]


def paired_ratios(values: Sequence[float], baseline: Sequence[float]) -> list[float]:
    """Per repeat ``values[i] / baseline[i]`` (both measured in the same round of an interleaved run)."""
    if len(values) != len(baseline):
        raise ValueError(f"{len(values)} values but {len(baseline)} baseline values")
    return [v / b for v, b in zip(values, baseline)]


def median_interval(xs: Sequence[float], confidence: float = 0.9) -> tuple[float, float]:
    """Distribution-free confidence interval of the median: the order statistics ``(x_(k),
    x_(n+1-k))`` (1-based, sorted) with the largest ``k`` whose coverage ``1 - 2 P(Bin(n, 1/2) <= k-1)``
    is at least ``confidence``; ``(nan, nan)`` when even ``(min, max)`` covers less (n < 5 at 0.9)."""
    n, ys = len(xs), sorted(xs)
    tail, k = 0.0, 0  # tail = P(Bin(n, 1/2) <= k - 1) for the next k
    while k < n // 2:
        nxt = tail + math.comb(n, k) / 2 ** n
        if 1 - 2 * nxt < confidence:
            break
        tail, k = nxt, k + 1
    return (float("nan"), float("nan")) if k == 0 else (ys[k - 1], ys[n - k])


def verdict(ok: bool | None) -> str:
    """``PASS`` / ``FAIL`` (``n/a`` when the check could not be made)."""
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; floats keep the formatting the caller gave them (pass strings)."""
    def cell(x: Any) -> str:
        return str(x).replace("|", "/")
    out = ["| " + " | ".join(cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    for r in rows:
        if len(r) != len(headers):
            raise ValueError(f"row {r!r} has {len(r)} cells, table has {len(headers)} columns")
        out.append("| " + " | ".join(cell(x) for x in r) + " |")
    return "\n".join(out) + "\n"


_FIELDS = [f.name for f in fields(Row)]


def write_csv(rows: Iterable[Row], path: str | Path) -> None:
    """Write rows to ``path`` with a header line (columns: the fields of :class:`Row`)."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(_FIELDS)
        for r in rows:
            w.writerow([getattr(r, k) if k != "value" else repr(float(r.value)) for k in _FIELDS])


def read_csv(path: str | Path) -> list[Row]:
    """Read what :func:`write_csv` wrote."""
    with open(path, newline="") as f:
        rd = csv.DictReader(f)
        return [Row(section=d["section"], p=int(d["p"]), m=int(d["m"]), variant=d["variant"], metric=d["metric"],
                    value=float(d["value"]), unit=d["unit"]) for d in rd]


# ---------------------------------------------------------------------- plots
def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        return None


def plot_ratio_bars(ratio_by_m: Mapping[int, Mapping[str, float]], path: str | Path, *, title: str,
                    baseline_label: str) -> bool:
    """Grouped bars: for each ``m``, each variant's time ratio. False if matplotlib is missing."""
    plt = _pyplot()
    if plt is None:
        return False
    ms = sorted(ratio_by_m)
    variants = list(dict.fromkeys(v for m in ms for v in ratio_by_m[m]))
    width = 0.8 / max(1, len(variants))
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, v in enumerate(variants):
        xs = [j + (i - (len(variants) - 1) / 2) * width for j in range(len(ms))]
        ys = [ratio_by_m[m].get(v, float("nan")) for m in ms]
        bars = ax.bar(xs, ys, width, label=v)
        for b, y in zip(bars, ys):
            ax.annotate(f"{y:.2f}", (b.get_x() + b.get_width() / 2, y), ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(ms)), [f"m={m}" for m in ms])
    ax.set_ylabel(f"iteration time / {baseline_label}")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, ncols=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_measured_vs_simulated(data: Mapping[int, Mapping[str, tuple[float, float]]], path: str | Path, *,
                               title: str) -> bool:
    """Per ``p`` a panel; per schedule two bars: (measured ms, simulated ms). False without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return False
    ps = sorted(data)
    fig, axes = plt.subplots(1, len(ps), figsize=(5.5 * len(ps), 4), squeeze=False)
    for ax, p in zip(axes[0], ps):
        names = list(data[p])
        meas = [data[p][n][0] for n in names]
        sim = [data[p][n][1] for n in names]
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], meas, 0.4, label="measured (median)")
        ax.bar([x + 0.2 for x in xs], sim, 0.4, label="simulated (isolated iteration)")
        for x, a, b in zip(xs, meas, sim):
            ax.annotate(f"{a / b:.2f}x", (x - 0.2, a), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(xs), names, rotation=20)
        ax.set_ylabel("iteration time (ms)")
        ax.set_title(f"emulated p={p}", fontsize=10)
        ax.set_ylim(0, 1.25 * max(meas + sim))  # head room for the legend above the bars
        ax.legend(fontsize=8, ncols=2, loc="upper left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

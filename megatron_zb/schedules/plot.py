"""Timeline plots of a simulated schedule (matplotlib, no display needed).

Ranks are rows (rank 0 on top), time runs left to right, and every compute action is a box from
its simulated start to its end. Op kinds have distinct colours from the Okabe-Ito palette, which
stays distinguishable under the common colour-vision deficiencies; a rank's later chunks (the
second model chunk of an interleaved or V placement) use lighter shades of the same colours.
Vocabulary-parallel passes (``IF``, ``S``, ``T``, ``IB``) have colours of their own, in the
first chunk's shade. The output format follows the file extension (``.png``, ``.svg``, ``.pdf``).

When the simulation models the data-parallel reduce (``costs.dp_reduce``), each rank's bucket
reduces are drawn as a hatched vermillion bar in the lower part of its row, from each bucket's
start to its end -- under the last W when the reduce is overlapped, after it otherwise.

The figure is drawn on a bare :class:`matplotlib.figure.Figure`, never through ``pyplot``, so
plotting neither needs a display nor changes the caller's matplotlib backend.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from .ir import COMPUTE_OPS, VOCAB_OPS, Op
from .simulator import SimResult

OP_COLORS: dict[Op, str] = {
    Op.F: "#0072B2",   # blue
    Op.B: "#E69F00",   # orange
    Op.W: "#009E73",   # bluish green
    Op.BW: "#CC79A7",  # reddish purple
    Op.IF: "#999999",  # grey: input embedding forward (vocabulary parallel)
    Op.S: "#F0E442",   # yellow: output layer forward
    Op.T: "#56B4E9",   # sky blue: output layer backward
    Op.IB: "#555555",  # dark grey: input embedding backward
}
OP_NAMES: dict[Op, str] = {
    Op.F: "F  forward",
    Op.B: "B  input-gradient backward",
    Op.W: "W  weight-gradient backward",
    Op.BW: "BW  fused backward",
    Op.IF: "IF  embedding forward (vocab slice)",
    Op.S: "S  output layer forward (vocab slice)",
    Op.T: "T  output layer backward (vocab slice)",
    Op.IB: "IB  embedding backward (vocab slice)",
}
_LIGHTEST = 0.5  # how far the last chunk's shade is mixed towards white
REDUCE_COLOR = "#D55E00"  # vermillion (Okabe-Ito): the data-parallel reduce
REDUCE_NAME = "DP gradient reduce"


def _hex_to_rgb(color: str) -> tuple[float, float, float]:
    c = color.lstrip("#")
    return tuple(int(c[i:i + 2], 16) / 255 for i in (0, 2, 4))  # type: ignore[return-value]


def shade(color: str, chunk: int, num_chunks: int) -> tuple[float, float, float]:
    """``color`` for model chunk ``chunk`` of ``num_chunks``: chunk 0 as is, later ones lighter."""
    rgb = _hex_to_rgb(color)
    if num_chunks <= 1 or chunk <= 0:
        return rgb
    t = _LIGHTEST * chunk / (num_chunks - 1)
    return tuple(x + (1 - x) * t for x in rgb)  # type: ignore[return-value]


def _text_color(rgb: tuple[float, float, float]) -> str:
    lum = 0.2126 * rgb[0] + 0.7152 * rgb[1] + 0.0722 * rgb[2]
    return "black" if lum > 0.45 else "white"


def chunk_index(result: SimResult) -> dict[int, int]:
    """Stage -> position of that stage among its rank's stages (0 for the first chunk)."""
    sched = result.schedule
    idx: dict[int, int] = {}
    for r in range(sched.num_ranks):
        for c, s in enumerate(sched.stages_of(r)):
            idx[s] = c
    return idx


def default_title(result: SimResult, *, memory_unit: str = "M_B") -> tuple[str, str]:
    """(headline, statistics line) used when the caller gives no title."""
    sched = result.schedule
    name = sched.name or "schedule"
    head = f"{name}: p={sched.num_ranks}, m={sched.num_microbatches}"
    if sched.num_stages != sched.num_ranks:
        head += f", {sched.num_stages} stages"
    peaks = ", ".join(f"{x:g}" for x in result.peak_memory)
    stats = (f"bubble rate {100 * result.bubble_rate:.1f}%   makespan {result.makespan:.4g}   "
             f"peak memory {result.max_peak_memory:.4g} {memory_unit} (per rank {peaks})")
    if result.reduce is not None:
        stats += f"   DP reduce exposed {max(result.exposed_reduce):.4g} (compute ends {result.compute_time:.4g})"
    return head, stats


def plot_timeline(result: SimResult, path: str | Path, *, title: str | None = None,
                  memory_unit: str = "M_B", width_inches: float | None = None, dpi: int = 150) -> None:
    """Draw ``result`` as a timeline and save it to ``path`` (format from the extension).

    Args:
        result: a simulation result (:func:`megatron_zb.schedules.simulate`).
        path: output file, e.g. ``timeline.png`` or ``timeline.svg``.
        title: headline; defaults to the schedule name with ``p`` and ``m``. The bubble rate,
            makespan and peak memory are always shown below it.
        memory_unit: unit name printed after memory figures.
        width_inches: figure width; defaults to a width that grows with the number of actions.
        dpi: resolution of raster output.
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    path = Path(path)
    sched = result.schedule
    p = sched.num_ranks
    total = result.total_time if result.total_time > 0 else 1.0
    num_chunks = max((len(sched.stages_of(r)) for r in range(p)), default=1)

    n_actions = max((len(a) for a in sched.ranks), default=1)
    if width_inches is None:
        width_inches = min(24.0, max(9.0, 2.5 + 0.17 * n_actions))
    row_h = 0.5
    legend_rows = 1 + (result.reduce is not None) + (sched.vocab_barriers > 0)
    height = 1.9 + 0.25 * (legend_rows - 1) + row_h * p
    fig = Figure(figsize=(width_inches, height), dpi=dpi)
    # Fixed margins in inches, so rows keep their height whatever p is.
    left_in, right_in, top_in, bottom_in = 1.25, 1.05, 0.9, 0.95 + 0.25 * (legend_rows - 1)
    ax = fig.add_axes((left_in / width_inches, bottom_in / height,
                       1 - (left_in + right_in) / width_inches, 1 - (top_in + bottom_in) / height))

    ops_present = _draw_actions(ax, result, total=total, axes_w_pt=(width_inches - left_in - right_in) * 72)
    _draw_reduce(ax, result)
    _style_axes(ax, result, total=total, xlabel="time")

    # Per-rank peak memory on the right.
    for r in range(p):
        ax.text(1.012, r, f"peak {result.peak_memory[r]:.3g}", transform=ax.get_yaxis_transform(),
                ha="left", va="center", fontsize=8, color="#333333")
    ax.text(1.012, -0.5, f"memory ({memory_unit})", transform=ax.get_yaxis_transform(), ha="left",
            va="bottom", fontsize=7, color="#666666")

    head, stats = default_title(result, memory_unit=memory_unit)
    fig.text(left_in / width_inches, 1 - 0.2 / height, title if title is not None else head,
             ha="left", va="top", fontsize=12, fontweight="bold")
    fig.text(left_in / width_inches, 1 - 0.52 / height, stats, ha="left", va="top", fontsize=9,
             color="#333333")

    order = [op for op in COMPUTE_OPS + VOCAB_OPS if op in ops_present]
    handles = [Patch(facecolor=OP_COLORS[op], edgecolor="#333333", linewidth=0.4, label=OP_NAMES[op])
               for op in order]
    if num_chunks > 1:
        for c in range(1, num_chunks):
            handles.append(Patch(facecolor=shade("#555555", c, num_chunks), edgecolor="#333333",
                                 linewidth=0.4, label=f"lighter: chunk {c + 1} of a rank"))
    if result.reduce is not None:
        handles.append(Patch(facecolor=REDUCE_COLOR, edgecolor="#333333", linewidth=0.4, hatch="///",
                             label=REDUCE_NAME))
    handles.append(Patch(facecolor="white", edgecolor="#bbbbbb", linewidth=0.4, label="idle"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.0, -0.42 / (height - top_in - bottom_in)),
              ncol=math.ceil(len(handles) / legend_rows), fontsize=8, frameon=False, handlelength=1.6, columnspacing=1.4,
              borderaxespad=0.0)

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)


def _draw_actions(ax, result: SimResult, *, total: float, axes_w_pt: float) -> list[Op]:
    """One box per action of ``result`` on ``ax`` (rank ``r`` is row ``r``), labelled with its micro
    batch where the label fits (font from the typical box width); returns the ops drawn, in order met."""
    from matplotlib.patches import Rectangle

    sched = result.schedule
    chunks = chunk_index(result)
    num_chunks = max((len(sched.stages_of(r)) for r in range(sched.num_ranks)), default=1)
    durations = sorted(e - s for ee, ss in zip(result.end, result.start) for s, e in zip(ss, ee))
    typical = durations[len(durations) // 2] if durations else total
    font = max(5.0, min(9.0, typical / total * axes_w_pt / 1.45))
    char_w_pt = 0.62 * font
    ops_present: list[Op] = []
    for r, acts in enumerate(sched.ranks):
        for a, s, e in zip(acts, result.start[r], result.end[r]):
            if a.op not in ops_present:
                ops_present.append(a.op)
            rgb = shade(OP_COLORS[a.op], 0 if a.op.is_vocab else chunks.get(a.stage, 0), num_chunks)
            ax.add_patch(Rectangle((s, r - 0.4), e - s, 0.8, facecolor=rgb, edgecolor="#333333",
                                   linewidth=0.4))
            label = str(a.mb)
            box_pt = (e - s) / total * axes_w_pt
            if box_pt >= len(label) * char_w_pt + 1.5:
                ax.text((s + e) / 2, r, label, ha="center", va="center", fontsize=font,
                        color=_text_color(rgb))
    return ops_present


def _style_axes(ax, result: SimResult, *, total: float, xlabel: str) -> None:
    """Rank rows, the time axis from 0 to ``total``, light vertical grid."""
    sched = result.schedule
    p = sched.num_ranks
    ax.set_xlim(0, total)
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_yticks(range(p))
    ax.set_yticklabels([_rank_label(sched, r) for r in range(p)], fontsize=9)
    ax.set_xlabel(xlabel, fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_axisbelow(True)
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)


def plot_comparison(panels: Sequence[tuple[str, SimResult]], path: str | Path, *, title: str,
                    time_unit: str = "ms", width_inches: float = 14.0, dpi: int = 150) -> None:
    """Timelines stacked on one time axis, one panel per ``(headline, result)`` -- e.g. a measured
    iteration (a :class:`SimResult` holding measured start/end times) above the simulator's prediction
    -- so that where their idle time differs is seen at a glance. Each headline is followed by the
    panel's idle share per rank (``1 - busy / total_time``). No memory column (a measured timeline
    carries no memory). Format from the extension."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    path = Path(path)
    total = max((r.total_time for _, r in panels), default=1.0) or 1.0
    row_h, head_in = 0.5, 0.55
    heights = [head_in + row_h * r.schedule.num_ranks + 0.45 for _, r in panels]
    top_in, bottom_in, left_in, right_in = 0.55, 0.6, 1.25, 0.4
    height = top_in + sum(heights) + bottom_in
    fig = Figure(figsize=(width_inches, height), dpi=dpi)
    fig.text(left_in / width_inches, 1 - 0.15 / height, title, ha="left", va="top", fontsize=12, fontweight="bold")
    y_top, ops_present = height - top_in, []
    for (headline, result), h in zip(panels, heights):
        idle = ", ".join(f"{100 * f:.1f}%" for f in result.idle_fraction)
        fig.text(left_in / width_inches, (y_top - 0.05) / height, f"{headline}   idle per rank [{idle}]",
                 ha="left", va="top", fontsize=9, color="#333333")
        ax = fig.add_axes((left_in / width_inches, (y_top - h + 0.45) / height,
                           1 - (left_in + right_in) / width_inches, (h - head_in - 0.45) / height))
        for op in _draw_actions(ax, result, total=total, axes_w_pt=(width_inches - left_in - right_in) * 72):
            if op not in ops_present:
                ops_present.append(op)
        _style_axes(ax, result, total=total, xlabel=f"time ({time_unit})")
        y_top -= h
    order = [op for op in COMPUTE_OPS + VOCAB_OPS if op in ops_present]
    handles = [Patch(facecolor=OP_COLORS[op], edgecolor="#333333", linewidth=0.4, label=OP_NAMES[op]) for op in order]
    handles.append(Patch(facecolor="white", edgecolor="#bbbbbb", linewidth=0.4, label="idle (a wait or a bubble)"))
    fig.legend(handles=handles, loc="lower left", bbox_to_anchor=(left_in / width_inches, 0.02), ncol=len(handles),
               fontsize=8, frameon=False, handlelength=1.6, columnspacing=1.4)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)


def _draw_reduce(ax, result: SimResult) -> None:
    """One hatched bar per bucket reduce, in the lower part of its rank's row (over the W boxes)."""
    from matplotlib.patches import Rectangle

    for r, buckets in enumerate(result.reduce or []):
        for _stage, _ready, start, end in buckets:
            ax.add_patch(Rectangle((start, r + 0.08), end - start, 0.32, facecolor=REDUCE_COLOR,
                                   edgecolor="#333333", linewidth=0.4, hatch="///", zorder=3,
                                   label=REDUCE_NAME))


def _rank_label(sched, r: int) -> str:
    stages = sched.stages_of(r)
    if len(stages) == 1 and stages[0] == r:
        return f"rank {r}"
    return f"rank {r}\nstages {','.join(map(str, stages))}"

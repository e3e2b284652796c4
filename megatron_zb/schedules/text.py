"""Plain-text views of a simulated schedule: a per-rank timeline and a summary table.

The timeline draws one line per rank on a common time axis cut into equal columns. Each column
shows what the rank is doing at the column's midpoint: an op letter (``F``, ``B``, ``W``, or
``X`` for a fused ``BW``; ``I``, ``S``, ``T``, ``E`` for the vocabulary passes ``IF``, ``S``, ``T``,
``IB``) or the microbatch number, and ``.`` when the rank is idle. A column is
``total_time / width`` long, so an action shorter than one column may not show; the default
width gives the shortest action at least one column (up to :data:`MAX_AUTO_WIDTH` columns).
"""

from __future__ import annotations

import math
from typing import Literal

from .ir import Op
from .simulator import SimResult

OP_SYMBOLS: dict[Op, str] = {Op.F: "F", Op.B: "B", Op.W: "W", Op.BW: "X", Op.IF: "I", Op.S: "S", Op.T: "T", Op.IB: "E"}
"""One character per compute op in the ``"op"`` style. ``BW`` gets ``X``: it must not read as B or W.
The vocabulary passes: ``I`` embedding forward (``IF``), ``S`` / ``T`` output layer forward /
backward, ``E`` embedding backward (``IB``)."""
VOCAB_LEGEND = "; I embedding forward, S output layer forward, T output layer backward, E embedding backward"
"""Added to the ``"op"`` legend when the schedule has vocabulary passes."""

IDLE = "."
MAX_AUTO_WIDTH = 120
_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"

Style = Literal["op", "mb"]


def mb_symbol(mb: int) -> str:
    """One character for microbatch ``mb``: ``0-9``, then ``a-z``, wrapping after 35."""
    return _DIGITS[mb % len(_DIGITS)]


def auto_width(result: SimResult, max_width: int = MAX_AUTO_WIDTH) -> int:
    """Columns that give the shortest action about one column, capped at ``max_width``."""
    durations = [e - s for ss, ee in zip(result.start, result.end) for s, e in zip(ss, ee) if e > s]
    if not durations or result.total_time <= 0:
        return 1
    return max(1, min(max_width, math.ceil(result.total_time / min(durations) - 1e-9)))


def timeline_rows(result: SimResult, width: int | None = None, *, style: Style = "op") -> list[str]:
    """The timeline cells of each rank, ``width`` characters per rank (no labels)."""
    if style not in ("op", "mb"):
        raise ValueError(f"style must be 'op' or 'mb', got {style!r}")
    width = auto_width(result) if width is None else width
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    total = result.total_time
    rows = []
    for acts, starts, ends in zip(result.schedule.ranks, result.start, result.end):
        cells = [IDLE] * width
        if total > 0:
            dt = total / width
            for a, s, e in zip(acts, starts, ends):
                sym = OP_SYMBOLS[a.op] if style == "op" else mb_symbol(a.mb)
                # columns whose midpoint (c + 0.5) * dt lies in [s, e)
                first = max(0, math.ceil(s / dt - 0.5 - 1e-9))
                last = min(width - 1, math.ceil(e / dt - 0.5 - 1e-9) - 1)
                for c in range(first, last + 1):
                    cells[c] = sym
        rows.append("".join(cells))
    return rows


def timeline_text(result: SimResult, width: int | None = None, *, style: Style = "op",
                  legend: bool = True) -> str:
    """A compact timeline: one line per rank, ``width`` columns spanning ``[0, total_time]``.

    Args:
        result: a simulation result.
        width: number of columns; ``None`` picks one column per shortest action (at most 120).
        style: ``"op"`` shows op letters (``X`` = fused ``BW``), ``"mb"`` microbatch numbers
            (``0-9`` then ``a-z``).
        legend: add a first line saying what a column and each character mean.
    """
    width = auto_width(result) if width is None else width
    rows = timeline_rows(result, width, style=style)
    label_w = len(f"rank {len(rows) - 1}")
    lines = []
    if legend:
        dt = result.total_time / width if width else 0.0
        what = ("F forward, B input-gradient backward, W weight-gradient backward, X fused backward (BW)"
                if style == "op" else "microbatch number (0-9, then a-z)")
        if style == "op" and result.schedule.vocab_barriers:
            what += VOCAB_LEGEND
        lines.append(f"timeline: 1 column = {dt:.4g} time units; {what}; {IDLE} idle")
    for r, row in enumerate(rows):
        lines.append(f"{f'rank {r}':<{label_w}} |{row}|")
    return "\n".join(lines)


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def summary_table(result: SimResult, *, memory_unit: str = "") -> str:
    """A summary of ``result``: bubble rate, makespan, isolated-iteration time, then per rank
    busy time, span, idle fraction and peak activation memory.

    ``memory_unit`` is appended to memory figures (e.g. ``"M_B"``).
    """
    unit = f" {memory_unit}" if memory_unit else ""
    sched = result.schedule
    rows = [
        ("bubble rate", f"{result.bubble_rate:.4f} ({100 * result.bubble_rate:.2f}%)"),
        ("makespan", f"{_fmt(result.makespan)}  (largest per-rank span; the zero-bubble paper's cost)"),
        ("isolated iteration", f"{_fmt(result.total_time)}  (first start to last end over all ranks)"),
        ("peak memory", f"{_fmt(result.max_peak_memory)}{unit}  (largest over ranks)"),
    ]
    key_w = max(len(k) for k, _ in rows)
    lines = [f"{k:<{key_w}}  {v}" for k, v in rows]
    header = ("rank", "stages", "busy", "span", "idle", f"peak memory{unit}")
    body = []
    for r in range(sched.num_ranks):
        stages = ",".join(str(s) for s in sched.stages_of(r)) or "-"
        body.append((str(r), stages, _fmt(result.busy[r]), _fmt(result.span[r]),
                     f"{100 * result.idle_fraction[r]:.1f}%", _fmt(result.peak_memory[r])))
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
    lines.append("")
    lines.append("  ".join(f"{h:>{w}}" for h, w in zip(header, widths)).rstrip())
    for b in body:
        lines.append("  ".join(f"{c:>{w}}" for c, w in zip(b, widths)).rstrip())
    return "\n".join(lines)

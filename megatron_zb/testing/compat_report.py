"""docs/compatibility.md from the matrix runner's cells (:mod:`megatron_zb.testing.compat_matrix`)."""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path

from .compat_features import FAMILIES, REFERENCES, Feature, ModelShape
from .compat_matrix import Cell

__all__ = ["TEST_BUDGET", "render_report", "write_report"]

TEST_BUDGET = """\
`tests/runtime/test_compat_matrix.py` runs every cell of this table -- the full product of families and
features, no pairing of features -- through the same runner code, and asserts each cell's status
from a table written in the test (not computed by the runner). The first eleven features run one
launch per (feature, placement group), each launch running the reference and every family of
that placement in the same processes (about 2.5 minutes on 2 idle cores). The nine model features
(`llama`, `recompute-full`, `recompute-selective`, `tied`, `uneven-split`, `moe`, and issue 41's `mtp`,
`mla` and `deepseek-moe`) run *together*: one launch per placement group runs all nine (and the
`fp32` column their W-count check needs) one after another in the same processes
(`plan_launches(together=True)`), which keeps their share to about 25 s of CPU time per rank before
issue 41, a few seconds more for each of its columns (4 process groups instead of 40); the price is that an
error in one of them fails all cells of that launch, which the script's default (one launch per
feature) avoids. The test also checks that recomputation queues exactly as many weight-gradient
computations as the `fp32` column for every family (W deferred inside recomputed layers, not
skipped, not duplicated) and that MoE queues 35 per microbatch where the dense model queues 17
(each of the 4 experts' two linears in the 3 MoE layers; the router's gradient comes in B), MLA 29
(five attention projections and the MLP's two linears per layer; the q/kv layernorms' gradients come in B),
and DeepSeek's MoE 41 (layer 0 dense; the shared expert's two linears too; the router's and the
shared-expert gate's gradients in B), with every router's expert bias moved from 0 and equal to
megatron-core's after the steps (compared with the parameters). It
also compares megatron-core's execution order (instrumented forward and backward steps) with
`1f1b`'s and `interleaved-1f1b`'s at PP=2 and PP=4, and checks a refused cell (6 layers cannot
fill the V's 4 stages with the even split). Clipping is off except in the post-validation
columns: with the V the reference is PP=1, whose gradient norm sums the squares in another
grouping than any PP=2 layout, so a clip factor would differ from the reference's in its last
bit for reasons that are not the schedule's.

The `vocab-parallel` column (issue 24) runs one launch per placement group, like the first eleven
(its `fp32` W-count baseline taken from that column's run), and checks that each split-backward
family queues exactly the `fp32` column's weight-gradient computations less the output layer's
one per microbatch (its weight gradient runs in T, on the slices). The test also runs the column
at PP=4 (8 layers, 8 microbatches; the W count checked by hand: 512 for a split-backward family,
the `fp32` column's PP=4 launches are not run there); [compatibility_pp4.md](compatibility_pp4.md)
is that column (and `fp32`) at PP=4, written by `scripts/compat_matrix.py --pp 4` (megatron-core
0.16.1 only).
"""
"""The paragraph on what the test suite runs (kept next to the table it describes)."""


def _machine() -> str:
    import megatron.core
    import torch

    return (f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPU(s), {platform.system()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}, megatron-core "
            f"{getattr(megatron.core, '__version__', '?')}, gloo")


def _short(cell: Cell, notes: dict[str, str]) -> str:
    """The table text of a cell; long reasons go to numbered notes."""
    if cell.kind == "bitwise":
        return "equal (bitwise)"
    if cell.kind == "tolerance":
        reason = cell.tolerance.reason if cell.tolerance else ""
        n = notes.setdefault(reason, f"t{len(notes) + 1}")
        if cell.max_rel_after_step is not None:
            return (f"equal (<= {cell.tolerance.rtol:g}, after a step <= {cell.tolerance.after_step:g}, [{n}](#{n}); "
                    f"max {cell.max_rel:.1e}, after a step {cell.max_rel_after_step:.1e})")
        return f"equal (<= {cell.tolerance.rtol:g}, [{n}](#{n}); max {cell.max_rel:.1e})"
    if cell.kind == "refused":
        msg = cell.status.removeprefix("refused: ")
        n = notes.setdefault(msg, f"r{len(notes) + 1}")
        return f"refused ([{n}](#{n}))"
    return "**" + cell.status.replace("|", "/")[:200] + "**"


def render_report(*, cells: list[Cell], features: list[Feature], families: list[str], command: str,
                  seconds: float, model: ModelShape = ModelShape()) -> str:
    """The markdown text of docs/compatibility.md."""
    by = {(c.family, c.feature): c for c in cells}
    notes: dict[str, str] = {}
    rows = []
    for fam in families:
        rows.append(f"| `{fam}` | " + " | ".join(_short(by[(fam, f.name)], notes) for f in features) + " |")
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    failed = sum(not c.ok for c in cells)
    lines = [
        "# Compatibility matrix: schedule families x training features",
        "",
        "Generated by the matrix runner -- do not edit by hand.",
        "",
        f"* command: `{command}`",
        f"* date: {date}; wall time {seconds:.0f} s; {len(cells)} cells, {failed} failed",
        f"* machine: {_machine()}",
        f"* model: GPT, {model.num_layers} layers (unless the feature says otherwise), hidden {model.hidden}, "
        f"{model.heads} heads, sequence {model.seq}, "
        f"vocabulary {model.vocab}, micro batch {model.micro_batch}, {model.num_microbatches} microbatches per "
        f"iteration, PP={model.pp}; Adam (lr 0.01) through megatron-core's `get_megatron_optimizer`, chunks "
        "wrapped in megatron-core DDP",
        "",
        "Each cell compares megatron-zb's schedule with megatron-core's own schedule on the same "
        "configuration: the loss of every microbatch of every iteration, every rank's copy of every "
        "parameter's gradient (`main_grad`), the parameters after the optimizer steps, and every step's "
        "(update_successful, loss scale). A cell is `equal (bitwise)`, `equal (<= rtol, ...)` (max "
        "|difference| / max |reference| per tensor), or `refused` (a clear error before anything ran). "
        "A cell also fails when it would prove nothing: a split-backward schedule deferred no weight "
        "gradient, post-validation never rolled back, fp16 never overflowed, or recomputation or vocabulary "
        "parallelism queued another number of weight-gradient computations than the same family without it (the "
        "`fp32` column; with vocabulary parallelism one fewer per microbatch: the output layer's runs in T).",
        "",
        "| family | " + " | ".join(f"`{f.name}`" for f in features) + " |",
        "|---|" + "---|" * len(features),
        *rows,
        "",
        "## References",
        "",
        *[f"* {p} placement ({', '.join(f'`{n}`' for n in names)}): {REFERENCES[p]}"
          for p, names in FAMILIES.items()],
        "",
        "## Features",
        "",
        *[f"* `{f.name}`: {f.description}" for f in features],
        "",
    ]
    if notes:
        lines += ["## Notes", ""]
        lines += [f'* <a id="{n}"></a>{n}: {text}' for text, n in notes.items()]
        lines.append("")
    lines += ["## What the test suite runs", "", TEST_BUDGET]
    return "\n".join(lines)


def write_report(path: Path, **kwargs) -> None:
    """Write :func:`render_report` to ``path`` (directories created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_report(**kwargs))

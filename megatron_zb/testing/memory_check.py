"""Measured peak CUDA memory per rank against what ``megatron-zb plan`` predicts for the same run.

``python -m megatron_zb.testing.memory_check --run DIR --schedule NAME -- <plan flags>``

``DIR`` is the output directory of a :mod:`megatron_zb.testing.pretrain_run` launch (its
``result.json``: per rank ``torch.cuda.max_memory_allocated`` over the whole run). The plan flags
are Megatron's model and layout flags of that run (``--num-layers ... --pipeline-model-parallel-size
... --global-batch-size ... --bf16 --vocab-size V``); this module runs ``megatron-zb plan`` with them,
``--schedules NAME`` and ``--json DIR/plan.json`` (plus ``--gpu-memory-gib`` of the measured GPU and
nominal speeds when no ``--gpu`` is given: the memory prediction does not depend on speeds), and
prints one table, a row per rank: measured peak, predicted peak of its pipeline rank (activations +
parameters and optimizer state) and their ratio. With tensor (or data) parallelism the run has
``k`` ranks per pipeline rank; Megatron's default rank order (``tp-cp-ep-dp-pp``) puts global rank
``g`` on pipeline rank ``g // k``, and each of them is compared with that pipeline rank's prediction.

Verdict: FAIL when a rank's measured peak exceeds its prediction by more than ``--margin``
(default :data:`DEFAULT_MARGIN` = 1/0.9 - 1, about 11.1%). Why that margin: ``plan`` calls a
schedule *fitting* when the prediction is at most 90% of the GPU memory (``--memory-fraction``),
leaving 10% for what it does not count; a run exceeding its prediction by more than 1/0.9 would
overrun that headroom on its own, so a plan saying "fits" could run out of memory. The check is
lenient: ``max_memory_allocated`` leaves out the CUDA context, NCCL's buffers and the allocator's
fragmentation, which use the same 10%. A run far *below* its prediction passes (the model
over-counts, e.g. fused attention kernels); the table shows the ratio either way.

Compare a schedule whose action order does not depend on costs (``zb-h1``, ``1f1b``): the plan
simulates exactly the order the run executes, so the comparison tests the memory model rather than
the cost estimates that a cost-aware schedule's order would follow. The last line is
``memory vs plan: PASS ...`` or ``memory vs plan: FAIL: ...``; exit 0 / 1, 2 for a bad command line.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path
from typing import Any, Sequence

__all__ = ["DEFAULT_MARGIN", "compare", "main"]

DEFAULT_MARGIN = 1 / 0.9 - 1
"""Allowed excess of measured over predicted: the plan's own headroom (it plans with 90% of the GPU)."""
GIB = 2**30


def compare(measured_bytes: Sequence[int | None], plan_row: dict[str, Any], margin: float) -> tuple[str, list[str]]:
    """The table and the problems (empty: PASS) of measured peaks against one ``plan --json`` schedule row."""
    predicted = plan_row["peak_memory_per_rank_gib"]
    acts = plan_row["peak_activation_per_rank_gib"]
    params = plan_row["param_optimizer_per_rank_gib"]
    lines = [f"schedule {plan_row['name']}: measured torch.cuda.max_memory_allocated vs megatron-zb plan "
             f"(FAIL above predicted x {1 + margin:.3f})",
             "| rank | measured GiB | predicted GiB | (activations + params/optimizer) | measured / predicted "
             "| verdict |",
             "|------|--------------|---------------|----------------------------------|----------------------"
             "|---------|"]
    problems = []
    per = len(measured_bytes) // len(predicted) if predicted and len(measured_bytes) % len(predicted) == 0 else 0
    if per == 0:
        problems.append(f"{len(measured_bytes)} measured ranks but the plan has {len(predicted)} pipeline ranks "
                        f"(not a multiple)")
        per = 1
    for r, m in enumerate(measured_bytes):
        q = r // per   # the pipeline rank of global rank r (tp-cp-ep-dp-pp order)
        if q >= len(predicted):
            break
        p = predicted[q]
        if m is None:
            problems.append(f"rank {r}: no measured peak (not a CUDA run?)")
            continue
        got = m / GIB
        ratio = got / p if p > 0 else float("inf")
        ok = got <= p * (1 + margin)
        if not ok:
            problems.append(f"rank {r}: measured {got:.2f} GiB > predicted {p:.2f} GiB x {1 + margin:.3f}")
        label = f"{r}" if per == 1 else f"{r} (pp {q})"
        lines.append(f"| {label:>4} | {got:12.2f} | {p:13.2f} | {acts[q]:14.2f} + {params[q]:15.2f} | {ratio:20.3f} | "
                     f"{'ok' if ok else 'OVER':<7} |")
    return "\n".join(lines), problems


def main(argv: Sequence[str] | None = None) -> int:
    """Command line (see the module docstring)."""
    from ..cli import main as cli_main

    from .cli_args import split_passthrough

    parts = split_passthrough(sys.argv[1:] if argv is None else argv, prog="memory_check",
                              what="megatron-zb plan's model and layout flags")
    if parts is None:
        return 2
    own, plan_flags = parts
    ap = argparse.ArgumentParser(prog="python -m megatron_zb.testing.memory_check", description=__doc__.split("\n")[0])
    ap.add_argument("--run", required=True, help="output directory of a megatron_zb.testing.pretrain_run launch")
    ap.add_argument("--schedule", required=True, help="the run's schedule (registry name, e.g. zb-h1)")
    ap.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                    help=f"allowed excess of measured over predicted, relative (default {DEFAULT_MARGIN:.4f} = "
                         "1/0.9 - 1: the plan's 10%% headroom)")
    args = ap.parse_args(own)
    run = Path(args.run)
    try:
        result = json.loads((run / "result.json").read_text())
    except (OSError, ValueError) as e:
        print(f"memory vs plan: FAIL: no result of the pretrain run in {run} ({e})")
        return 1
    if result.get("status") != "PASS":
        print(f"memory vs plan: FAIL: the pretrain run did not pass ({'; '.join(result.get('problems', []))})")
        return 1
    extra = ["--schedules", args.schedule, "--json", str(run / "plan.json")]
    if "--gpu" not in plan_flags:
        totals = [r["total_bytes"] for r in result.get("ranks", []) if "total_bytes" in r]
        gib = min(totals) / GIB if totals else 80.0
        extra += ["--gpu-memory-gib", f"{gib:.2f}", "--gpu-tflops", "989", "--gpu-hbm-gbs", "3350"]
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        code = cli_main(["plan", *plan_flags, *extra])
    (run / "plan.txt").write_text(text.getvalue())
    print(text.getvalue(), end="")
    if code != 0:
        print(f"memory vs plan: FAIL: megatron-zb plan exited {code}")
        return 1
    plan = json.loads((run / "plan.json").read_text())
    rows = [s for s in plan["schedules"] if s["name"] == args.schedule]
    if not rows:
        reasons = [f"{n['name']}: {n['reason']}" for n in plan.get("not_planned", [])]
        print(f"memory vs plan: FAIL: the plan has no {args.schedule} ({'; '.join(reasons) or 'not planned'})")
        return 1
    table, problems = compare(result["peak_bytes"], rows[0], args.margin)
    print(table)
    (run / "memory_vs_plan.txt").write_text(table + "\n")
    if problems:
        print(f"memory vs plan: FAIL: {'; '.join(problems)}")
        return 1
    measured = [m / GIB for m in result["peak_bytes"]]
    predicted = rows[0]["peak_memory_per_rank_gib"]
    per = max(1, len(measured) // len(predicted))
    ratios = ", ".join(f"{m / predicted[r // per]:.2f}" for r, m in enumerate(measured))
    print(f"memory vs plan: PASS: {args.schedule}, measured / predicted per rank {ratios} "
          f"(limit {1 + args.margin:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

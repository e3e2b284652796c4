#!/usr/bin/env python
"""Run the compatibility matrix (schedule families x training features) and write its page:
docs/compatibility.md on megatron-core 0.16.1, docs/compatibility_megatron_core_0.19.md on 0.19.x.

Every cell runs real megatron-core models, optimizers and DDP on local gloo processes and is
compared with megatron-core's own schedule on the same configuration (see
``megatron_zb/testing/compat_matrix.py``). Exit status 1 if any cell is neither equal nor
refused up front.

    python scripts/compat_matrix.py                          # everything, writes the installed release's page
    python scripts/compat_matrix.py --features fp32,bf16 --families zb,zbv --out /tmp/m.md
    python scripts/compat_matrix.py --together               # fewer process start-ups (a shared machine)
    python scripts/compat_matrix.py --pp 4 --features fp32,vocab-parallel --out docs/compatibility_pp4.md
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def default_page() -> Path:
    """The installed megatron-core release's page: docs/compatibility.md for 0.16, else
    docs/compatibility_megatron_core_<release>.md."""
    from megatron_zb.megatron_compat import release

    line = release()
    return ROOT / "docs" / ("compatibility.md" if line == "0.16" else f"compatibility_megatron_core_{line}.md")


def main(argv: list[str] | None = None) -> int:
    from megatron_zb.testing.compat_features import FAMILIES, FEATURES, feature, placement_of
    from megatron_zb.testing.compat_report import write_report

    all_families = [n for names in FAMILIES.values() for n in names]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--features", default=",".join(f.name for f in FEATURES),
                    help="comma-separated feature names (default: all): " + ", ".join(f.name for f in FEATURES))
    ap.add_argument("--families", default=",".join(all_families),
                    help="comma-separated schedule families (default: all): " + ", ".join(all_families))
    ap.add_argument("--out", default=str(default_page()), help="markdown file to write (default: the installed "
                    "megatron-core release's page, %(default)s)")
    ap.add_argument("--pp", type=int, default=2,
                    help="pipeline size of the megatron-zb arms (default 2); the model then has 2 x PP layers and "
                         "2 x PP microbatches per iteration (the default shape at 2; features with their own layer "
                         "count, uneven-split and moe, are for PP=2)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per launch (default 300)")
    ap.add_argument("--together", action="store_true",
                    help="features of equal world size share one launch per placement group (fewer process "
                         "start-ups; an error then fails every cell of its launch)")
    args = ap.parse_args(argv)
    try:
        features = [feature(n) for n in args.features.split(",") if n]
        families = [n for n in args.families.split(",") if n and placement_of(n)]
    except ValueError as e:
        ap.error(str(e))

    if args.pp < 2:
        ap.error(f"--pp {args.pp}: the pipeline size must be at least 2")
    from megatron_zb.testing.compat_features import ModelShape
    from megatron_zb.testing.compat_matrix import run_matrix

    model = ModelShape(pp=args.pp, num_layers=2 * args.pp, num_microbatches=2 * args.pp)
    t0 = time.monotonic()
    cells = run_matrix(features=features, families=families, model=model, timeout=args.timeout,
                       together=args.together, progress=lambda line: print(line, file=sys.stderr, flush=True))
    command = "python scripts/compat_matrix.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    out = Path(args.out)
    write_report(out, cells=cells, features=features, families=families, command=command,
                 seconds=time.monotonic() - t0, model=model)
    failed = [c for c in cells if not c.ok]
    for c in failed:
        print(f"{c.family} x {c.feature}: {c.status}", file=sys.stderr)
    print(f"{len(cells)} cells, {len(failed)} failed; wrote {out}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

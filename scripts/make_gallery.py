#!/usr/bin/env python
"""Draw every registered schedule and write docs/schedules.md.

For each name in the schedule registry this builds the schedule at p=4, m=8 with unit costs
(tf = tb = tw = 1, tcomm = 0, mem-b = 1, mem-w = mem-b/2) through the CLI's own functions, saves
``docs/gallery/<name>.png`` and writes ``docs/schedules.md`` (schedule table, gallery with bubble
rate and peak memory, units convention, adding a generator, JSON format). A schedule whose generator cannot be built
here is listed as missing instead of failing the whole run.

Usage: python scripts/make_gallery.py [--pp 4] [--microbatches 8] [--docs DIR] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_zb.cli import CLIError, Costs, build_and_simulate, schedule_table  # noqa: E402
from megatron_zb.schedules.plot import plot_timeline  # noqa: E402

DP_REDUCE = """\
Off by default. `--dp-reduce-bytes BYTES --dp-bandwidth BYTES_PER_T` add the data-parallel
gradient reduce to every predicted time (`--dp-bucket-bytes` splits each stage's gradients into
buckets, default one per stage; `--dp-latency T` is the fixed time of one bucket's collective;
`--no-dp-overlap` reduces after each rank's last compute action, as without
`--overlap-grad-reduce`). `BYTES` are one rank's share, split alike over its chunks. In Python
the same model is `CostModel(..., dp_reduce=DPReduceModel(stage_bytes=..., bucket_bytes=...,
bandwidth=..., latency=..., overlap=True))` (`megatron_zb.schedules.dp_reduce`; `stage_bytes` and
`bucket_bytes` take one value per stage or one for all, `None` buckets = one bucket, as
megatron-core keeps on every pipeline rank but the first).

The rule (one place: `megatron_zb.schedules.timing.Timeline`, used by the simulator and by every
generator that times candidates): a stage's buckets become ready during its last weight-gradient
action (its last `W`, or `BW`), in order and in proportion to their bytes -- the runtime reports
each weight ready right after its last W entry (`docs/runtime.md`); each rank reduces its ready
buckets one after the other on one channel (`latency + bytes / bandwidth` each). A rank's
iteration ends when its compute and its reduce are done, so the isolated iteration, the makespan
and the bubble rate include the exposed reduce; the report adds a `DP reduce:` line (where
compute ends, where the iteration ends, the exposed reduce per rank) and `--plot` draws each
bucket's reduce as a hatched vermillion bar in the lower half of its rank's row.

Reduce-aware scheduling: the greedy generator (`zb`, `zb-1p`, `zb-2p`) scores its candidate
variants through the same kernel, so with the reduce in the costs it keeps the variant with the
shortest iteration *including* the exposed reduce -- for example (`tests/schedules/test_dp_reduce_model.py`,
worked by hand) at p=2, m=3, `T_W` = (1, 2) and 4 units of reduce on stage 0 only, it defers the
last rank's W's to its tail so that stage 0's last W, and with it its reduce, ends one unit
earlier: 14 instead of 15. On the plain placement a rank holds one stage, so the order of its own
tail W's does not change when its buckets are ready; on V and interleaved ranks
`megatron_zb.schedules.dp_reduce.reduce_aware_tail(schedule, costs)` regroups each rank's trailing
W's chunk by chunk when that shortens the predicted iteration (a Python function; not called by
the V list scheduler or the CLI). Measured against the runtime: `docs/benchmarks.md`, section
"Data-parallel reduce".
"""

UNITS = """\
All commands take the costs of **one microbatch through one rank's share of the model** -- what a
plain (non-interleaved) pipeline stage holds:

| flag | meaning | default |
| --- | --- | --- |
| `--tf` | forward time | 1 |
| `--tb` | input-gradient backward time (B) | 1 |
| `--tw` | weight-gradient backward time (W); a fused backward BW takes `tb + tw` | 1 |
| `--tcomm` | latency of one transfer between two different ranks (whatever the placement) | 0 |
| `--mem-b` | activation memory a forward allocates and B (or BW) frees, `M_B` | 1 |
| `--mem-w` | the part of it still held after B until W, `M_W` | `mem-b / 2` |
| `--memory-limit X` | per-rank activation memory limit, in units of **one stage's** `M_B` | each schedule's own |

When a rank holds several model chunks (interleaved placements with `--chunks v`; the V placement
always has 2), the rank's share is split into `v` stages and **each stage takes `1/v` of the time
and of the memory**. So `1f1b`, `interleaved-1f1b` and `zbv` given the same flags describe the same
model on the same number of GPUs, and their bubble rates and peak memories compare directly: every
rank does `m * (tf + tb + tw)` of work in all three.

`--memory-limit X` counts in units of one stage's `M_B`, that is a chunk's `M_B` (`mem-b / v`) when
a rank holds `v` chunks. For example with `--mem-b 1`, `--schedule zb --memory-limit 4` allows
4 `M_B` per rank, while `--schedule zbv --memory-limit 4` allows 4 chunks' worth, 2 `M_B`. No
schedule fits below 1. A cost-aware schedule plans under the limit; any other schedule is checked
against it, and a limit that is too small is an error (exit status 2) naming `--memory-limit`.

Without `--memory-limit`, the V schedules use a limit relative to `R`, 1F1B's peak for the same
layers (`megatron_zb.schedules.generators.vshape.one_f_one_b_memory`; `R = p` stage `M_B` for
uniform stages): `zbv` R, `v-half` (p/2 + 1)/p x R (the published V-Half memory, (p+2)//2 of 1F1B's
p microbatches), `v-min` (p/3 + 1.5)/p x R, never below what one microbatch needs. With per-chunk
memory measured on a real GPT (the last chunk holds the logits, and the V puts it on rank 0 next
to the first chunk) this keeps ZB-V within 1F1B's peak: docs/benchmarks.md measures 0.94-1.005.

Reported peak memory is always in the unit of `--mem-b` (`M_B` of a whole rank's share), so the
peaks of all schedules compare directly. Bubble rate is `(makespan - busiest rank's work) /
makespan`, and the makespan is the largest per-rank span (first start to last end on one rank), the
zero-bubble paper's cost; the report also shows the isolated-iteration time (first start to last
end over all ranks), which is larger when ranks start or finish at different times.
"""

ADDING = """\
Generators live in `megatron_zb/schedules/generators/`, one module per family (`baselines`,
`handcrafted`, `greedy`, `vshape` with `list_scheduler` and `search`, `interleaved_zb`, `exact`).
A module registers each schedule it makes with the `register` decorator of
`megatron_zb.schedules.catalog`; the builder takes exactly the keyword arguments `num_ranks`,
`num_microbatches`, `costs` (a `CostModel`, per stage), `memory_limit` (`None`: the schedule's
default; unit of `costs.mem_b`) and `num_chunks`, and returns a validated `Schedule`
(`make_schedule`). Add the module's import to `generators/__init__.py`: its position there is the
name's position in `megatron-zb list`. Timing always comes from the kernel in
`megatron_zb.schedules.timing` (`Timeline`: the simulator's dependency, duration and memory rules),
which `simulate`, the greedy scheduler and the list scheduler share; a cost-aware generator that
builds orders step by step places each action with `Timeline.run` so its times are the simulator's.
tests/schedules/test_schedules_layout.py registers a toy schedule this way and checks that the package has no
import cycle.
"""

JSON_FORMAT = """\
`megatron-zb schedule ... --json FILE` writes, and `megatron-zb simulate FILE` reads, one JSON
object:

```json
{"num_microbatches": m, "stage_to_rank": [...], "ranks": [[{"op": "F", "mb": 0, "stage": 0}, ...], ...]}
```

* `num_microbatches`: microbatches per iteration, `m >= 1`.
* `stage_to_rank`: the rank that runs each pipeline stage; its length is the number of stages.
  Plain placement `[0, 1, ..., p-1]`; interleaved `[0, ..., p-1, 0, ..., p-1, ...]` (stage `s` on
  rank `s % p`); V `[0, ..., p-1, p-1, ..., 0]` (rank `r` holds stages `r` and `2p-1-r`).
* `ranks[r]`: the actions rank `r` runs, in order. `op` is `F` (forward), `B` (input-gradient
  backward), `W` (weight-gradient backward) or `BW` (fused backward); `mb` the microbatch, `stage`
  the pipeline stage (which must belong to rank `r`). Every (microbatch, stage) needs one `F` and
  either one `BW` or one `B` and one `W`, in the order F before B before W on its rank.
* Communication ops `SEND_F`, `RECV_F`, `SEND_B`, `RECV_B` carry an extra `"peer"` (the other
  rank) and appear only in **lowered** schedules (`--json FILE --lowered`); `stage` is the
  producing stage. Generators never write them: lowering derives them from the compute order.

`megatron-zb simulate FILE` validates the file and exits with status 2 and the validator's message
naming the first bad action (for example a missing `W`, or a `W` before its `B`), checks that every
send has its matching receive (given in the file, or derived by lowering), then prints the report.
"""


def _fmt_peaks(peaks: list[float]) -> str:
    return ", ".join(f"{x:g}" for x in peaks)


def make(docs: Path, pp: int, microbatches: int, only: list[str] | None = None) -> tuple[list[dict], list[str]]:
    """Draw every (or each ``only``) registered schedule into ``docs/gallery``; return (done, missing)."""
    gallery = docs / "gallery"
    gallery.mkdir(parents=True, exist_ok=True)
    done: list[dict] = []
    missing: list[str] = []
    for name, placement, split, aware, desc in schedule_table():
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        try:
            sched, res = build_and_simulate(name, pp=pp, microbatches=microbatches, costs=Costs())
        except CLIError as e:
            print(f"skipped {name}: {e}", file=sys.stderr)
            missing.append(f"{name} ({e})")
            continue
        png = gallery / f"{name}.png"
        plot_timeline(res, png)
        dt = time.perf_counter() - t0
        print(f"{name:18s} bubble {100 * res.bubble_rate:6.2f}%  makespan {res.makespan:6.4g}  "
              f"peak {res.max_peak_memory:g}  ({dt:.1f} s) -> {png.relative_to(docs.parent)}")
        done.append(dict(name=name, placement=placement, stages=sched.num_stages, bubble=res.bubble_rate,
                         makespan=res.makespan, total=res.total_time, peak=res.max_peak_memory,
                         peaks=list(res.peak_memory), png=png.relative_to(docs).as_posix()))
    return done, missing


def write_markdown(docs: Path, pp: int, microbatches: int, done: list[dict], missing: list[str]) -> Path:
    rows = schedule_table()
    out = ["# Schedules", "",
           "Every schedule below is available by name through the registry: "
           "`megatron-zb schedule --schedule NAME`, `build_schedule(NAME, ...)` in Python, and "
           "`megatron-zb list`. This page is generated by `python scripts/make_gallery.py`; edit the "
           "script, not the page.", "",
           "## Supported schedules", "",
           "| name | placement | split backward (B/W) | cost aware | description |",
           "| --- | --- | --- | --- | --- |"]
    for name, placement, split, aware, desc in rows:
        out.append(f"| `{name}` | {placement} | {split} | {aware} | {desc.replace('|', '/')} |")
    out += ["",
            "*Placement*: `plain` puts stage `s` on rank `s`; `interleaved` puts `v` chunks on every "
            "rank (`--chunks v`, default 2), stage `s` on rank `s % p`; `v` puts two chunks on every "
            "rank in a V (rank `r` holds stages `r` and `2p-1-r`). *Cost aware* generators use the "
            "cost model and `--memory-limit`.", "",
            "## Command line", "",
            "```",
            "megatron-zb list",
            "megatron-zb schedule --schedule zb-h1 --pp 4 --microbatches 8 [--tf 1 --tb 1 --tw 1 --tcomm 0]",
            "                     [--mem-b 1 --mem-w 0.5] [--memory-limit X] [--chunks V]",
            "                     [--json zb-h1.json [--lowered]] [--plot zb-h1.png|.svg] [--no-timeline]",
            "                     [--dp-reduce-bytes B --dp-bandwidth BW [--dp-bucket-bytes B] [--dp-latency T]",
            "                      [--no-dp-overlap]]",
            "megatron-zb simulate zb-h1.json [same cost flags] [--plot FILE] [--no-timeline]",
            "python -m megatron_zb ...   # the same",
            "```", "",
            "`schedule` and `simulate` print the bubble rate, makespan, isolated-iteration time, peak "
            "activation memory per rank and a text timeline (one line per rank; `F`, `B`, `W`, `X` = fused "
            "`BW`, `.` idle; `--timeline-style mb` shows microbatch numbers instead, `--width N` sets the "
            "columns). User errors print one line `megatron-zb: error: ...` naming the flag or file and exit "
            "with status 2.", "",
            "## Units", "", UNITS.rstrip(), "",
            "## Data-parallel reduce", "", DP_REDUCE.rstrip(), "",
            f"## Gallery (p={pp}, m={microbatches}, unit costs)", "",
            f"Each schedule at `--pp {pp} --microbatches {microbatches}` with the default costs "
            "(`tf = tb = tw = 1`, `tcomm = 0`, `mem-b = 1`, `mem-w = mem-b/2`; interleaved placements with "
            "the default 2 chunks). Rows are ranks, boxes are actions at their simulated times with the "
            "microbatch number inside; colours: F blue, B orange, W green, fused BW purple; a rank's second "
            "chunk in a lighter shade. Peak memory is in `M_B` of a whole rank's share.", "",
            "| schedule | bubble rate | makespan | isolated iteration | peak memory (max) | peak per rank |",
            "| --- | --- | --- | --- | --- | --- |"]
    for d in done:
        out.append(f"| [`{d['name']}`](#{d['name'].replace('.', '')}) | {100 * d['bubble']:.2f}% | "
                   f"{d['makespan']:.4g} | {d['total']:.4g} | {d['peak']:g} | {_fmt_peaks(d['peaks'])} |")
    if missing:
        out += ["", "Not drawn (the generator could not be built when this page was made): "
                + "; ".join(missing) + "."]
    for d in done:
        out += ["", f"### {d['name']}", "",
                f"Bubble rate {100 * d['bubble']:.2f}%, makespan {d['makespan']:.4g}, peak memory "
                f"{d['peak']:g} M_B (per rank {_fmt_peaks(d['peaks'])}).", "",
                f"![{d['name']} timeline, p={pp}, m={microbatches}]({d['png']})"]
    out += ["", "## Adding a generator", "", ADDING.rstrip()]
    out += ["", "## JSON format", "", JSON_FORMAT.rstrip(), ""]
    path = docs / "schedules.md"
    path.write_text("\n".join(out))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--docs", type=Path, default=ROOT / "docs")
    ap.add_argument("--only", nargs="*", default=None, help="draw only these names (the page lists them only)")
    args = ap.parse_args(argv)
    done, missing = make(args.docs, args.pp, args.microbatches, args.only)
    path = write_markdown(args.docs, args.pp, args.microbatches, done, missing)
    print(f"wrote {path} ({len(done)} schedules drawn, {len(missing)} missing)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

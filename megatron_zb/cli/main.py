"""The ``megatron-zb`` command line: build, load, simulate, print and plot pipeline schedules.

Subcommands::

    megatron-zb schedule --schedule NAME --pp P --microbatches M [cost flags] [--json F] [--plot F]
                         [--torch-csv F]
    megatron-zb simulate FILE.json [cost flags] [--plot F]
    megatron-zb list

Units (the same for every schedule, so schedules of one model compare fairly): ``--tf``, ``--tb``,
``--tw``, ``--mem-b`` and ``--mem-w`` are the costs of one microbatch through ONE RANK'S SHARE of
the model, i.e. what a plain pipeline stage holds. A placement with ``v`` chunks per rank
(interleaved with ``--chunks v``; the V placement has 2) splits that share into ``v`` stages, each
taking ``1/v`` of the time and memory. ``--memory-limit X`` is in units of ONE STAGE's ``M_B``
(a chunk's ``M_B`` when a rank holds several chunks). Peak memory is reported in the unit of
``--mem-b``. ``--tcomm`` is the latency of one transfer between two ranks, whatever the placement.
``--dp-reduce-bytes`` (off by default) adds the data-parallel gradient reduce: bytes of one rank's
share (split alike over its chunks), reduced at ``--dp-bandwidth`` bytes per time unit in buckets
of ``--dp-bucket-bytes``, overlapped with the pipeline unless ``--no-dp-overlap``.

Every user error prints one line ``megatron-zb: error: ...`` on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import math
import sys
import textwrap
from typing import NoReturn, Sequence

from ..schedules import registry
from ..schedules.ir import Placement, dump
from ..schedules.lowering import lower
from .ops import (CLIError, Costs, build_and_simulate, one_line, plot_to, report, schedule_table, simulate_file,
                  torch_csv_to)
from .plan import add_plan_parser

__all__ = ["EXIT_USAGE", "PROG", "build_parser", "main"]

PROG = "megatron-zb"
EXIT_USAGE = 2


def _wrap(text: str) -> str:
    return textwrap.fill(text, 79, break_on_hyphens=False)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the units paragraph as written and never breaks a schedule name at its hyphen."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, ``megatron-zb: error: ...``, exit status 2."""

    def error(self, message: str) -> NoReturn:
        hint = f" (see '{self.prog} --help')"
        self.exit(EXIT_USAGE, f"{PROG}: error: {one_line(message)}{hint}\n")


# ------------------------------------------------------------------------------------ flag types
def _number(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return x


def _positive_int(text: str) -> int:
    try:
        x = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if x < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {x}")
    return x


def _positive(text: str) -> float:
    x = _number(text)
    if x <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return x


def _non_negative(text: str) -> float:
    x = _number(text)
    if x < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return x


def _costs_from_args(args: argparse.Namespace) -> Costs:
    return Costs(tf=args.tf, tb=args.tb, tw=args.tw, tcomm=args.tcomm, mem_b=args.mem_b, mem_w=args.mem_w,
                 memory_limit=args.memory_limit, dp_bytes=args.dp_reduce_bytes, dp_bandwidth=args.dp_bandwidth,
                 dp_bucket_bytes=args.dp_bucket_bytes, dp_latency=args.dp_latency, dp_overlap=not args.no_dp_overlap)


# ------------------------------------------------------------------------------------ commands
def _cmd_schedule(args: argparse.Namespace) -> int:
    costs = _costs_from_args(args)
    spec = registry.get_spec(args.schedule)
    if args.chunks is not None and spec.placement is not Placement.INTERLEAVED:
        print(f"{PROG}: note: --chunks is ignored by {args.schedule} ({spec.placement} placement, "
              f"{spec.chunks_per_rank(args.chunks)} chunk(s) per rank)", file=sys.stderr)
    sched, result = build_and_simulate(args.schedule, pp=args.pp, microbatches=args.microbatches,
                                       chunks=args.chunks, costs=costs)
    if args.json:
        out = lower(sched) if args.lowered else sched
        try:
            dump(out, args.json)
        except OSError as e:
            raise CLIError(f"--json {args.json}: cannot write the file: {e.strerror or e}") from None
    torch_note = torch_csv_to(sched, args.torch_csv) if args.torch_csv else ""
    if args.plot:
        plot_to(result, args.plot)
    print(report(result, costs, timeline=not args.no_timeline, width=args.width, style=args.timeline_style))
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            print(f"wrote {path} ({flag})")
    if torch_note:
        print(f"wrote {args.torch_csv} (--torch-csv: {torch_note})")
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    costs = _costs_from_args(args)
    _, result, note = simulate_file(args.file, costs)
    if args.plot:
        plot_to(result, args.plot)
    print(report(result, costs, timeline=not args.no_timeline, width=args.width, style=args.timeline_style,
                 note=note))
    if args.plot:
        print(f"wrote {args.plot} (--plot)")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    header = ("name", "placement", "split backward", "cost aware", "description")
    rows = schedule_table()
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header[:-1])]
    for row in [header, tuple("-" * w for w in widths) + ("-" * 11,)] + rows:
        print("  ".join(f"{c:<{w}}" for c, w in zip(row[:-1], widths)) + "  " + row[-1])
    return 0


UNITS_HELP = """\
units: --tf/--tb/--tw/--mem-b/--mem-w are the costs of one microbatch through ONE RANK'S SHARE
of the model (what a plain pipeline stage holds). With several chunks per rank (interleaved
with --chunks v; V schedules have 2) each stage gets 1/v of the time and memory, so schedules
of the same model compare fairly. --memory-limit X is in units of ONE STAGE's M_B (a chunk's
M_B when a rank holds several chunks). Peak memory is reported in the unit of --mem-b (M_B).
"""


def _add_cost_flags(p: argparse.ArgumentParser, *, limit_help: str) -> None:
    g = p.add_argument_group("costs (per rank's share of the model; see 'units' below)")
    g.add_argument("--tf", type=_positive, default=1.0, metavar="T", help="forward time (default 1)")
    g.add_argument("--tb", type=_positive, default=1.0, metavar="T",
                   help="input-gradient backward time (default 1)")
    g.add_argument("--tw", type=_non_negative, default=1.0, metavar="T",
                   help="weight-gradient backward time (default 1); fused BW takes tb+tw")
    g.add_argument("--tcomm", type=_non_negative, default=0.0, metavar="T",
                   help="latency of one transfer between two ranks (default 0)")
    g.add_argument("--mem-b", type=_positive, default=1.0, metavar="M",
                   help="activation memory F allocates and B frees (default 1)")
    g.add_argument("--mem-w", type=_non_negative, default=None, metavar="M",
                   help="memory held from B until W (default mem-b/2); above mem-b, B allocates the difference")
    g.add_argument("--memory-limit", type=_positive, default=None, metavar="X", help=limit_help)
    d = p.add_argument_group("data-parallel gradient reduce (off unless --dp-reduce-bytes is given)")
    d.add_argument("--dp-reduce-bytes", type=_non_negative, default=None, metavar="BYTES",
                   help="gradient bytes of one rank's share (split alike over its chunks); turns the reduce on")
    d.add_argument("--dp-bandwidth", type=_positive, default=None, metavar="BYTES_PER_T",
                   help="bytes per time unit of the data-parallel collective (needed with --dp-reduce-bytes)")
    d.add_argument("--dp-bucket-bytes", type=_positive, default=None, metavar="BYTES",
                   help="bucket size (default: one bucket per stage)")
    d.add_argument("--dp-latency", type=_non_negative, default=0.0, metavar="T",
                   help="fixed time of one bucket's collective (default 0)")
    d.add_argument("--no-dp-overlap", action="store_true",
                   help="reduce after each rank's last compute action (no --overlap-grad-reduce)")


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--plot", metavar="FILE", help="draw the timeline to FILE (.png, .svg or .pdf)")
    g.add_argument("--no-timeline", action="store_true", help="do not print the text timeline")
    g.add_argument("--width", type=_positive_int, default=None, metavar="N",
                   help="columns of the text timeline (default: one per shortest action, at most 120)")
    g.add_argument("--timeline-style", choices=("op", "mb"), default="op",
                   help="text timeline shows op letters (op, default; X = fused BW) or microbatch numbers (mb)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (schedule choices are read from the registry now)."""
    from .. import __version__
    names = registry.schedule_names()
    parser = _Parser(prog=PROG, description=_wrap("Build, simulate, print and plot pipeline-parallel schedules "
                     "(zero-bubble and baselines)."), epilog=UNITS_HELP,
                     formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    ps = sub.add_parser("schedule", help="build a registered schedule, simulate it and report",
                        description=_wrap("Build the schedule NAME for --pp ranks and --microbatches microbatches, "
                        "simulate one iteration and print bubble rate, makespan, peak memory per rank and a "
                        "text timeline."), epilog=UNITS_HELP, formatter_class=_Formatter)
    ps.add_argument("--schedule", required=True, choices=names, metavar="NAME",
                    help="one of: " + ", ".join(names) + " ('megatron-zb list' describes them)")
    ps.add_argument("--pp", type=_positive_int, required=True, metavar="P", help="pipeline-parallel size (ranks)")
    ps.add_argument("--microbatches", type=_positive_int, required=True, metavar="M",
                    help="microbatches per iteration")
    ps.add_argument("--chunks", type=_positive_int, default=None, metavar="V",
                    help="model chunks per rank for interleaved placements (default 2)")
    _add_cost_flags(ps, limit_help="per-rank activation memory limit, in units of one stage's M_B "
                    "(a chunk's M_B with several chunks per rank); cost-aware schedules plan under it, "
                    "others are checked against it (default: each schedule's own)")
    g = ps.add_argument_group("schedule file")
    g.add_argument("--json", metavar="FILE", help="write the schedule to FILE in the IR's JSON form")
    g.add_argument("--lowered", action="store_true",
                   help="with --json: write the lowered schedule (with SEND_*/RECV_* actions)")
    g.add_argument("--torch-csv", metavar="FILE",
                   help="write the schedule as the compute-only CSV of PyTorch's pipeline runtime "
                        "(torch.distributed.pipelining's _load_csv; the file torchtitan's "
                        "pipeline_parallel_schedule_csv names, not tested with torchtitan); docs/torch_pipelining.md")
    _add_output_flags(ps)
    ps.set_defaults(func=_cmd_schedule)

    pm = sub.add_parser("simulate", help="validate and simulate a schedule JSON file",
                        description=_wrap("Load a schedule JSON file, validate it, check its lowering (the "
                        "send/recv pairs, given or derived), simulate it and print the same report as "
                        "'schedule'. An invalid schedule exits with status 2 and the validator's message."),
                        epilog=UNITS_HELP, formatter_class=_Formatter)
    pm.add_argument("file", metavar="FILE.json", help="schedule in the IR's JSON form")
    _add_cost_flags(pm, limit_help="per-rank activation memory limit to check, in units of one stage's "
                    "M_B (the smallest stage's, if ranks hold different numbers of stages)")
    _add_output_flags(pm)
    pm.set_defaults(func=_cmd_simulate)

    pl = sub.add_parser("list", help="list the registered schedules",
                        description=_wrap("Print the registered schedules: name, placement, whether backward is "
                        "split into B and W, whether the generator uses the cost model, description."))
    pl.set_defaults(func=_cmd_list)
    add_plan_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI on ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except SystemExit as e:  # argparse: --help, --version, usage errors
        return e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_USAGE)
    except CLIError as e:
        print(f"{PROG}: error: {one_line(str(e))}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # e.g. `megatron-zb list | head`
        return 0


if __name__ == "__main__":
    raise SystemExit(main())

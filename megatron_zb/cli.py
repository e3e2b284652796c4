"""The ``megatron-zb`` command line: build, load, simulate, print and plot pipeline schedules.

Subcommands::

    megatron-zb schedule --schedule NAME --pp P --microbatches M [cost flags] [--json F] [--plot F]
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
import json
import math
import sys
import textwrap
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, Sequence

from .planning.command import add_plan_parser
from .schedules import registry
from .schedules.costs import CostModel
from .schedules.dp_reduce import DPReduceModel
from .schedules.ir import Placement, Schedule, ScheduleError, dump, validate
from .schedules.lowering import check_lowered, lower
from .schedules.simulator import DeadlockError, MemoryLimitError, SimResult, simulate
from .schedules.text import summary_table, timeline_text

PROG = "megatron-zb"
MEMORY_UNIT = "M_B"  # the unit of --mem-b: one rank's share of the model
EXIT_USAGE = 2


class CLIError(Exception):
    """A user error: the message is printed as ``megatron-zb: error: <message>``."""


def _one_line(msg: str) -> str:
    """Join a multi-line message into one line (``"a:\n b\n c"`` -> ``"a: b; c"``)."""
    out = ""
    for part in (p.strip() for p in str(msg).splitlines()):
        if part:
            out += ("" if not out else " " if out.endswith(":") else "; ") + part
    return out


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
        self.exit(EXIT_USAGE, f"{PROG}: error: {_one_line(message)}{hint}\n")


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


# ------------------------------------------------------------------------------------ cost model
@dataclass(frozen=True)
class Costs:
    """The cost flags as the user gave them (per rank's share; memory limit in stage M_B)."""

    tf: float = 1.0
    tb: float = 1.0
    tw: float = 1.0
    tcomm: float = 0.0
    mem_b: float = 1.0
    mem_w: float | None = None  # default mem_b / 2
    memory_limit: float | None = None  # units of one stage's M_B
    dp_bytes: float | None = None  # gradient bytes of one rank's share; None: no DP reduce
    dp_bandwidth: float | None = None  # bytes per time unit
    dp_bucket_bytes: float | None = None  # None: one bucket per stage
    dp_latency: float = 0.0
    dp_overlap: bool = True

    def _dp(self, chunks: int | Sequence[int]) -> DPReduceModel | None:
        """The reduce model for stages whose ranks hold ``chunks`` (per stage, or for all) stages
        (None: not asked for)."""
        if self.dp_bytes is None:
            if self.dp_bandwidth is not None or self.dp_bucket_bytes is not None:
                raise CLIError("--dp-bandwidth and --dp-bucket-bytes need --dp-reduce-bytes (the gradient bytes "
                               "of one rank's share)")
            return None
        if self.dp_bandwidth is None:
            raise CLIError("--dp-reduce-bytes needs --dp-bandwidth (bytes per time unit of the data-parallel "
                           "collective)")
        per_stage = self.dp_bytes / chunks if isinstance(chunks, int) else [self.dp_bytes / k for k in chunks]
        return DPReduceModel(stage_bytes=per_stage, bucket_bytes=self.dp_bucket_bytes,
                             bandwidth=self.dp_bandwidth, latency=self.dp_latency, overlap=self.dp_overlap)

    def check(self) -> None:
        """Reject values no schedule can use, naming the flag."""
        for flag, value, positive in (("--tf", self.tf, True), ("--tb", self.tb, True), ("--tw", self.tw, False),
                                      ("--tcomm", self.tcomm, False), ("--mem-b", self.mem_b, True)):
            if not math.isfinite(value) or value < 0 or (positive and value == 0):
                raise CLIError(f"{flag} must be finite and {'> 0' if positive else '>= 0'}, got {value:g}")
        if self.mem_w is not None and not 0 <= self.mem_w <= self.mem_b:
            raise CLIError(f"--mem-w must be between 0 and --mem-b ({self.mem_b:g}): the part of the activations "
                           f"held until W is a part of what F allocated; got {self.mem_w:g}")
        if self.memory_limit is not None:
            if not self.memory_limit > 0:
                raise CLIError(f"--memory-limit must be > 0, got {self.memory_limit:g}")
            if self.memory_limit < 1:
                raise CLIError(f"--memory-limit {self.memory_limit:g} is too small: it is in units of one stage's "
                               f"M_B, and every forward holds one stage's M_B, so no schedule fits below 1")

    @property
    def mem_w_value(self) -> float:
        return self.mem_b / 2 if self.mem_w is None else self.mem_w

    def for_uniform(self, chunks: int) -> tuple[CostModel, float | None]:
        """Per-stage cost model (and absolute memory limit) for ``chunks`` stages on every rank."""
        self.check()
        v = float(chunks)
        limit = None if self.memory_limit is None else self.memory_limit * self.mem_b / v
        return CostModel(t_f=self.tf / v, t_b=self.tb / v, t_w=self.tw / v, t_comm=self.tcomm,
                         mem_b=self.mem_b / v, mem_w=self.mem_w_value / v, memory_limit=limit,
                         dp_reduce=self._dp(chunks)), limit

    def for_placement(self, stage_to_rank: Sequence[int]) -> CostModel:
        """Per-stage cost model for any placement: a stage gets ``1/k`` of its rank's share when its
        rank holds ``k`` stages; the memory limit counts in the smallest stage's ``M_B``."""
        self.check()
        per_rank = Counter(stage_to_rank)
        k = [per_rank[r] for r in stage_to_rank]
        mem_b = [self.mem_b / n for n in k]
        limit = None if self.memory_limit is None else self.memory_limit * min(mem_b)
        return CostModel(t_f=[self.tf / n for n in k], t_b=[self.tb / n for n in k], t_w=[self.tw / n for n in k],
                         t_comm=self.tcomm, mem_b=mem_b, mem_w=[self.mem_w_value / n for n in k],
                         memory_limit=limit, dp_reduce=self._dp(k))


def _costs_from_args(args: argparse.Namespace) -> Costs:
    return Costs(tf=args.tf, tb=args.tb, tw=args.tw, tcomm=args.tcomm, mem_b=args.mem_b, mem_w=args.mem_w,
                 memory_limit=args.memory_limit, dp_bytes=args.dp_reduce_bytes, dp_bandwidth=args.dp_bandwidth,
                 dp_bucket_bytes=args.dp_bucket_bytes, dp_latency=args.dp_latency, dp_overlap=not args.no_dp_overlap)


# ------------------------------------------------------------------------------------ operations
def build_and_simulate(name: str, *, pp: int, microbatches: int, chunks: int | None = None,
                       costs: Costs | None = None) -> tuple[Schedule, SimResult]:
    """Build the registered schedule ``name`` and simulate it, in the CLI's units.

    Raises :class:`CLIError` with a message naming the offending flag.
    """
    costs = costs if costs is not None else Costs()
    names = registry.schedule_names()
    if name not in names:
        raise CLIError(f"--schedule: unknown schedule {name!r}; choose one of: {', '.join(names)}")
    for flag, value in (("--pp", pp), ("--microbatches", microbatches), ("--chunks", chunks)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise CLIError(f"{flag} must be an integer >= 1, got {value!r}")
    spec = registry.get_spec(name)
    num_chunks = chunks if chunks is not None else 2
    v = spec.chunks_per_rank(num_chunks)
    model, limit = costs.for_uniform(v)
    where = f"--schedule {name} --pp {pp} --microbatches {microbatches}"
    if spec.placement is Placement.INTERLEAVED:
        where += f" --chunks {num_chunks}"
    try:
        sched = registry.build_schedule(name, num_ranks=pp, num_microbatches=microbatches, costs=model,
                                        memory_limit=limit, num_chunks=num_chunks)
    except ImportError as e:
        raise CLIError(f"--schedule {name}: its generator cannot be imported in this installation ({e})") from None
    except ValueError as e:  # ScheduleError and plain ValueErrors of a generator
        msg = _one_line(str(e))
        if costs.memory_limit is not None and "memory" in msg.lower():
            raise CLIError(f"--memory-limit {costs.memory_limit:g} (units of one stage's M_B) does not work "
                           f"for {where}: {msg}") from None
        raise CLIError(f"cannot build {where}: {msg}") from None
    try:
        result = simulate(sched, model)
    except MemoryLimitError as e:
        raise CLIError(f"--memory-limit {costs.memory_limit:g} (units of one stage's M_B) is too small for "
                       f"{where}: {_one_line(str(e))}") from None
    except ScheduleError as e:
        raise CLIError(f"{where} produced an invalid schedule (a generator bug): {_one_line(str(e))}") from None
    return sched, result


def load_schedule(path: str | Path) -> Schedule:
    """Read a schedule JSON file; malformed files raise :class:`CLIError` naming the file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise CLIError(f"cannot read schedule file {str(p)!r}: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise CLIError(f"{p}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise CLIError(f"{p}: expected a JSON object with keys num_microbatches, stage_to_rank, ranks; "
                       f"got a {type(data).__name__}")
    try:
        if not isinstance(data.get("ranks"), list) or not all(isinstance(r, list) for r in data["ranks"]):
            raise ScheduleError("'ranks' must be a list of lists of actions")
        if not isinstance(data.get("stage_to_rank"), list):
            raise ScheduleError("'stage_to_rank' must be a list of rank numbers")
        for r, acts in enumerate(data["ranks"]):
            for i, a in enumerate(acts):
                if not isinstance(a, dict):
                    raise ScheduleError(f"rank {r} action #{i} {a!r} is not an object like "
                                        f'{{"op": "F", "mb": 0, "stage": 0}}')
                for key in ("op", "mb", "stage"):
                    if key not in a:
                        raise ScheduleError(f"rank {r} action #{i} {json.dumps(a)} lacks the key {key!r}")
                for key in ("mb", "stage", "peer"):
                    if key in a and (type(a[key]) is not int) and not (key == "peer" and a[key] is None):
                        raise ScheduleError(f"rank {r} action #{i} {json.dumps(a)}: {key!r} must be an integer")
        return Schedule.from_dict(data, name=p.stem)
    except (ValueError, TypeError, KeyError) as e:  # ScheduleError is a ValueError
        raise CLIError(f"{p}: malformed schedule: {_one_line(str(e))}") from None


def check_schedule(schedule: Schedule, source: str) -> str:
    """Validate ``schedule`` and its lowering; return a one-line note on the communication."""
    try:
        validate(schedule)
    except ScheduleError as e:
        raise CLIError(f"{source}: invalid schedule: {_one_line(str(e))}") from None
    n_comm = sum(1 for _, _, a in schedule.actions() if not a.is_compute)
    try:
        if n_comm:
            check_lowered(schedule)
            return f"lowering: {n_comm // 2} send/recv pairs given in the file, all matched"
        lowered = lower(schedule)
    except ScheduleError as e:
        raise CLIError(f"{source}: invalid communication: {_one_line(str(e))}") from None
    pairs = sum(1 for _, _, a in lowered.actions() if not a.is_compute) // 2
    return f"lowering: ok ({pairs} send/recv pairs derived)"


def simulate_file(path: str | Path, costs: Costs | None = None) -> tuple[Schedule, SimResult, str]:
    """Load, validate, check lowering and simulate a schedule file (CLI units)."""
    costs = costs if costs is not None else Costs()
    sched = load_schedule(path)
    note = check_schedule(sched, str(path))
    model = costs.for_placement(sched.stage_to_rank)
    try:
        result = simulate(sched, model)
    except MemoryLimitError as e:
        raise CLIError(f"--memory-limit {costs.memory_limit:g} (units of one stage's M_B) is too small for "
                       f"{path}: {_one_line(str(e))}") from None
    except DeadlockError as e:
        raise CLIError(f"{path}: {_one_line(str(e))}") from None
    except ScheduleError as e:
        raise CLIError(f"{path}: {_one_line(str(e))}") from None
    return sched, result, note


def report(result: SimResult, costs: Costs, *, timeline: bool = True, width: int | None = None,
           style: str = "op", note: str | None = None) -> str:
    """The text printed by ``schedule`` and ``simulate``."""
    sched = result.schedule
    per_rank = Counter(sched.stage_to_rank)
    chunks = sorted(set(per_rank.values()))
    chunk_txt = "/".join(map(str, chunks))
    lines = [f"schedule {sched.name or '?'}: p={sched.num_ranks} ranks, m={sched.num_microbatches} microbatches, "
             f"{sched.num_stages} stages ({chunk_txt} per rank), "
             f"{'split' if sched.splits_backward else 'fused'} backward"]
    if costs.memory_limit is None:
        limit = "none"
    else:
        stage_mb = min(costs.mem_b / per_rank[r] for r in sched.stage_to_rank)
        limit = f"{costs.memory_limit:g} x one stage's M_B (= {costs.memory_limit * stage_mb:g} {MEMORY_UNIT})"
    lines.append(f"costs per rank's share: tf={costs.tf:g} tb={costs.tb:g} tw={costs.tw:g} tcomm={costs.tcomm:g} "
                 f"mem-b={costs.mem_b:g} mem-w={costs.mem_w_value:g}; memory limit: {limit}")
    if note:
        lines.append(note)
    if result.reduce is not None:
        lines.append(_dp_line(result, costs))
    lines.append("")
    lines.append(summary_table(result, memory_unit=MEMORY_UNIT))
    if timeline:
        lines.append("")
        lines.append(timeline_text(result, width, style=style))  # type: ignore[arg-type]
    return "\n".join(lines)


def _dp_line(result: SimResult, costs: Costs) -> str:
    """The report's line on the data-parallel reduce (the times include it)."""
    buckets = "one per stage" if costs.dp_bucket_bytes is None else f"{costs.dp_bucket_bytes:g} bytes"
    exposed = ", ".join(f"{x:.4g}" for x in result.exposed_reduce)
    return (f"DP reduce: {costs.dp_bytes:g} bytes per rank's share at {costs.dp_bandwidth:g} bytes/unit, buckets "
            f"{buckets}, latency {costs.dp_latency:g}, {'overlapped' if costs.dp_overlap else 'after the compute'}; "
            f"compute ends at {result.compute_time:.4g}, iteration at {result.total_time:.4g}; exposed per rank "
            f"[{exposed}] (the times below include it)")


def _plot(result: SimResult, path: str) -> None:
    from .schedules.plot import plot_timeline
    if Path(path).suffix.lower() not in (".png", ".svg", ".pdf"):
        raise CLIError(f"--plot {path}: the file name must end in .png, .svg or .pdf")
    try:
        plot_timeline(result, path)
    except OSError as e:
        raise CLIError(f"--plot {path}: cannot write the file: {e.strerror or e}") from None


def schedule_table() -> list[tuple[str, str, str, str, str]]:
    """(name, placement, split backward, cost aware, description) for every registered schedule."""
    rows = []
    for name in registry.schedule_names():
        s = registry.get_spec(name)
        rows.append((name, s.placement.value, "yes" if s.split_backward else "no", "yes" if s.cost_aware else "no",
                     s.description))
    return rows


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
    if args.plot:
        _plot(result, args.plot)
    print(report(result, costs, timeline=not args.no_timeline, width=args.width, style=args.timeline_style))
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            print(f"wrote {path} ({flag})")
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    costs = _costs_from_args(args)
    _, result, note = simulate_file(args.file, costs)
    if args.plot:
        _plot(result, args.plot)
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
                   help="part of it still held after B until W (default mem-b/2)")
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
    from . import __version__
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
        print(f"{PROG}: error: {_one_line(str(e))}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # e.g. `megatron-zb list | head`
        return 0


if __name__ == "__main__":
    raise SystemExit(main())

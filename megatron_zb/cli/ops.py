"""What the ``megatron-zb`` command line computes, in its units, callable from Python.

The cost flags as given (:class:`Costs`, per rank's share of the model; the units are explained in
:mod:`megatron_zb.cli`) become per-stage cost models; :func:`build_and_simulate` builds and
simulates a registered schedule, :func:`simulate_file` loads, validates, checks the lowering of
and simulates a schedule JSON file, :func:`report` is the text both subcommands print and
:func:`schedule_table` the rows of ``list``. Every user error raises :class:`CLIError` with a
one-line message naming the flag or file; :mod:`megatron_zb.cli` parses the arguments, prints
and sets the exit status.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..schedules import registry
from ..schedules.costs import CostModel
from ..schedules.dp_reduce import DPReduceModel
from ..schedules.ir import Placement, Schedule, ScheduleError, validate
from ..schedules.lowering import check_lowered, lower
from ..schedules.simulator import DeadlockError, MemoryLimitError, SimResult, simulate
from ..schedules.text import summary_table, timeline_text

MEMORY_UNIT = "M_B"  # the unit of --mem-b: one rank's share of the model


class CLIError(Exception):
    """A user error: the message is printed as ``megatron-zb: error: <message>``."""


def one_line(msg: str) -> str:
    """Join a multi-line message into one line (``"a:\n b\n c"`` -> ``"a: b; c"``)."""
    out = ""
    for part in (p.strip() for p in str(msg).splitlines()):
        if part:
            out += ("" if not out else " " if out.endswith(":") else "; ") + part
    return out


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
        if self.mem_w is not None and not (math.isfinite(self.mem_w) and self.mem_w >= 0):
            raise CLIError(f"--mem-w must be finite and >= 0, got {self.mem_w:g} (above --mem-b, B allocates the "
                           f"difference: what each W keeps outgrows what F saved)")
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
        msg = one_line(str(e))
        if costs.memory_limit is not None and "memory" in msg.lower():
            raise CLIError(f"--memory-limit {costs.memory_limit:g} (units of one stage's M_B) does not work "
                           f"for {where}: {msg}") from None
        raise CLIError(f"cannot build {where}: {msg}") from None
    try:
        result = _simulate(sched, model, costs, where)
    except ScheduleError as e:
        raise CLIError(f"{where} produced an invalid schedule (a generator bug): {one_line(str(e))}") from None
    return sched, result


def _simulate(sched: Schedule, model: CostModel, costs: Costs, where: str) -> SimResult:
    """:func:`simulate`; a schedule over the memory limit is the user's error naming ``--memory-limit``."""
    try:
        return simulate(sched, model)
    except MemoryLimitError as e:
        raise CLIError(f"--memory-limit {costs.memory_limit:g} (units of one stage's M_B) is too small for "
                       f"{where}: {one_line(str(e))}") from None


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
        raise CLIError(f"{p}: malformed schedule: {one_line(str(e))}") from None


def check_schedule(schedule: Schedule, source: str) -> str:
    """Validate ``schedule`` and its lowering; return a one-line note on the communication."""
    try:
        validate(schedule)
    except ScheduleError as e:
        raise CLIError(f"{source}: invalid schedule: {one_line(str(e))}") from None
    n_comm = sum(1 for _, _, a in schedule.actions() if not a.is_compute)
    try:
        if n_comm:
            check_lowered(schedule)
            return f"lowering: {n_comm // 2} send/recv pairs given in the file, all matched"
        lowered = lower(schedule)
    except ScheduleError as e:
        raise CLIError(f"{source}: invalid communication: {one_line(str(e))}") from None
    pairs = sum(1 for _, _, a in lowered.actions() if not a.is_compute) // 2
    return f"lowering: ok ({pairs} send/recv pairs derived)"


def simulate_file(path: str | Path, costs: Costs | None = None) -> tuple[Schedule, SimResult, str]:
    """Load, validate, check lowering and simulate a schedule file (CLI units)."""
    costs = costs if costs is not None else Costs()
    sched = load_schedule(path)
    note = check_schedule(sched, str(path))
    model = costs.for_placement(sched.stage_to_rank)
    try:
        result = _simulate(sched, model, costs, str(path))
    except (DeadlockError, ScheduleError) as e:
        raise CLIError(f"{path}: {one_line(str(e))}") from None
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


def plot_to(result: SimResult, path: str) -> None:
    """Draw ``result``'s timeline to ``path`` (``--plot``: .png, .svg or .pdf)."""
    from ..schedules.plot import plot_timeline

    if Path(path).suffix.lower() not in (".png", ".svg", ".pdf"):
        raise CLIError(f"--plot {path}: the file name must end in .png, .svg or .pdf")
    try:
        plot_timeline(result, path)
    except OSError as e:
        raise CLIError(f"--plot {path}: cannot write the file: {e.strerror or e}") from None


def torch_csv_to(schedule: Schedule, path: str) -> str:
    """``--torch-csv FILE``: write PyTorch's compute-only CSV; return the report's note on its placement."""
    from ..torch_pipelining import write_csv

    try:
        return write_csv(schedule, path)
    except ValueError as e:
        raise CLIError(f"--torch-csv {path}: {one_line(str(e))}") from None


def schedule_table() -> list[tuple[str, str, str, str, str]]:
    """(name, placement, split backward, cost aware, description) for every registered schedule."""
    rows = []
    for name in registry.schedule_names():
        s = registry.get_spec(name)
        rows.append((name, s.placement.value, "yes" if s.split_backward else "no", "yes" if s.cost_aware else "no",
                     s.description))
    return rows

"""Export a megatron-zb schedule to PyTorch's pipeline runtime (``torch.distributed.pipelining``).

Tested with PyTorch 2.13 (CPU, gloo; :data:`TESTED_TORCH`). Every public function first calls
:func:`check_torch_version`, which refuses any other release by name: the runtime's entry points
used here (``_Action``, ``_validate_schedule``, ``_PipelineScheduleRuntime._prepare_schedule_with_comms``
and ``_load_csv``) are private to PyTorch and may change in any release.

What is written
---------------
* **Actions.** One compute-only list per rank (:func:`to_torch_actions`), PyTorch's letters:
  our ``F`` -> ``F``; our input-gradient ``B`` -> ``I`` (``BACKWARD_INPUT``); our ``W`` -> ``W``;
  our fused ``BW`` -> ``B`` (``FULL_BACKWARD``); the table is
  :data:`~megatron_zb.schedules.torch_import.TORCH_COMPUTE_OPS`, shared with the import. An ``I``
  directly followed on its rank by the ``W`` of the same microbatch and stage is written as one
  ``B``: PyTorch runs what it is given and never calls its ``_merge_bw``, so the pair would cost a
  second autograd pass for nothing. Idle slots (``None``) are never written.
* **Stage numbers** are ours unchanged, because PyTorch numbers stages the same way:
  :func:`torch_placement` finds the style of PyTorch's own ``generate_stage_to_rank_mapping``
  (``"loop"``: stage ``s`` on rank ``s % p``, plain and interleaved; ``"v"``: rank ``r`` holds
  stages ``r`` and ``2p-1-r``) that gives the schedule's ``stage_to_rank``, and refuses a
  placement PyTorch has no style for. The PyTorch schedule classes that build their stages that
  way (torchtitan's ``pipeline_parallel_schedule`` decides the placement from one of them) come
  from :data:`~megatron_zb.schedules.torch_import.TORCH_SCHEDULES`.
* **CSV** (:func:`torch_csv_text`, :func:`write_torch_csv`): one row per rank in rank order, one
  cell per action, ``{stage}{F|I|W|B}{microbatch}`` -- the ``format="compute_only"`` file of
  ``_load_csv``. ``_Action.from_str`` matches a *prefix* (``"1F0x"`` reads as ``1F0``), so a
  malformed cell would be misread silently: every cell is re-read here by a full match
  (:func:`parse_cell`) and by PyTorch's own parser and must give back exactly the action written;
  :func:`write_torch_csv` re-reads the file from disk.
* **PyTorch's checks, offline** (:func:`torch_lowering`): the actions go through PyTorch's own
  ``_PipelineScheduleRuntime._prepare_schedule_with_comms`` -- ``_validate_schedule``, then the
  UNSHARD/RESHARD, REDUCE_GRAD and send/receive passes -- on stand-in stages (no process group),
  and the result through ``_simulate_comms_compute`` without its UNSHARD/RESHARD/REDUCE_GRAD
  (which that simulator does not know). :func:`write_torch_csv` runs them before writing, so a
  file it writes is one PyTorch's runtime accepts unchanged.

Running: :func:`prepare_runtime` loads a schedule into a ``_PipelineScheduleRuntime`` built from
the user's ``PipelineStage``s, after checking that the runtime's shape and local stages are the
schedule's. What PyTorch's runtime does differently from ours (stage 0's ``I`` does nothing and
its ``W`` runs the whole backward) is in docs/torch_pipelining.md.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch.distributed.pipelining import schedules as _ts
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

from ..schedules.fusion import as_run
from ..schedules.ir import Placement, Schedule, ScheduleError, validate, vocab_passes_unsupported
from ..schedules.torch_import import TORCH_COMPUTE_OPS, TORCH_SCHEDULES, StandInStage

__all__ = ["TESTED_TORCH", "TorchExportError", "TorchPlacement", "check_torch_version", "parse_cell",
           "prepare_runtime", "read_torch_csv", "to_torch_actions", "torch_csv_text", "torch_lowering",
           "torch_placement", "write_torch_csv"]

TESTED_TORCH: tuple[str, ...] = ("2.13",)
"""PyTorch releases (major.minor) this export was tested with; others are refused."""

_TORCH_TYPE = {op: _ts._ComputationType[name] for name, op in TORCH_COMPUTE_OPS.items()}
"""Our compute op -> PyTorch's ``_ComputationType`` (the import's table, inverted)."""

_CELL = re.compile(r"(0|[1-9][0-9]*)(F|I|W|B)(0|[1-9][0-9]*)")
"""One compute-only cell, matched in full: stage, PyTorch letter, microbatch (no leading zeros)."""

_NOT_COMPUTED_BY_SIMULATOR = ("UNSHARD", "RESHARD", "REDUCE_GRAD")
"""Actions PyTorch's lowering inserts that its ``_simulate_comms_compute`` does not model."""


class TorchExportError(ScheduleError):
    """The schedule (or the installed PyTorch) cannot be exported; the message says why and what to do."""


def check_torch_version(version: str | None = None) -> str:
    """Return the installed (or given) PyTorch version; refuse one not in :data:`TESTED_TORCH`."""
    v = str(torch.__version__ if version is None else version)
    if ".".join(v.split("+")[0].split(".")[:2]) not in TESTED_TORCH:
        raise TorchExportError(
            f"the export to torch.distributed.pipelining was tested with PyTorch {', '.join(TESTED_TORCH)} only, "
            f"and this is PyTorch {v}: install torch {TESTED_TORCH[-1]}.* (its private schedule API changes "
            f"between releases), or write the schedule with --json instead")
    return v


@dataclass(frozen=True)
class TorchPlacement:
    """How PyTorch places the schedule's stages.

    Attributes:
        style: the ``style`` of PyTorch's ``generate_stage_to_rank_mapping`` that gives the
            schedule's ``stage_to_rank`` (``"loop"`` or ``"v"``).
        placement: our :class:`~megatron_zb.schedules.ir.Placement` of the same map.
        stages_per_rank: pipeline stages (``PipelineStage`` objects) each rank builds.
        torch_classes: PyTorch schedule classes whose constructor places stages this way (for
            torchtitan's ``pipeline_parallel_schedule``, the class name without ``Schedule``).
    """

    style: str
    placement: Placement
    stages_per_rank: int
    torch_classes: tuple[str, ...]

    def describe(self) -> str:
        """One line for the command line's report."""
        titan = " or ".join(c.removeprefix("Schedule") for c in self.torch_classes)
        return (f"PyTorch stage placement '{self.style}', {self.stages_per_rank} stage(s) per rank; "
                f"torchtitan pipeline_parallel_schedule: {titan}")


def torch_placement(schedule: Schedule) -> TorchPlacement:
    """PyTorch's numbering of ``schedule``'s stages; refuse a placement PyTorch cannot build."""
    check_torch_version()
    p, n, s2r = schedule.num_ranks, schedule.num_stages, list(schedule.stage_to_rank)
    if n % p:
        raise TorchExportError(f"{_name(schedule)} has {n} stages on {p} ranks: PyTorch's runtime gives every "
                               f"rank the same number of stages")
    for style in ("loop", "v"):
        mapping = generate_stage_to_rank_mapping(p, n, style=style)
        if [mapping[s] for s in range(n)] == s2r:
            break
    else:
        raise TorchExportError(f"{_name(schedule)} places stages on ranks as {s2r}, which neither of PyTorch's "
                               f"stage placements ('loop': stage s on rank s % p; 'v') gives")
    placement = next((pl for pl in Placement if pl.stage_to_rank(p, n // p) == s2r), None)
    if placement is None:  # PyTorch's 'v' style with more than 2 stages per rank (a zigzag)
        raise TorchExportError(f"{_name(schedule)} places {n // p} stages per rank in PyTorch's '{style}' style, "
                               f"which no PyTorch schedule class builds (its V classes take 2 per rank)")
    classes = tuple(c for c, info in TORCH_SCHEDULES.items() if info.placement is placement)
    return TorchPlacement(style, placement, n // p, classes)


def to_torch_actions(schedule: Schedule, *, merge_iw: bool = True) -> dict[int, list[Any]]:
    """``schedule`` as PyTorch's compute-only actions, ``{rank: [_Action, ...]}`` (module doc).

    ``merge_iw=False`` keeps an ``I`` directly followed by its own ``W`` as two actions (the
    profiler of :mod:`.runtime` runs so, to time ``I`` and ``W`` on every stage); the default
    writes the pair as one ``B`` -- unless the schedule's backwards are written as they run
    (:data:`~megatron_zb.schedules.fusion.AS_WRITTEN`, ``auto``'s choices), which are written as they are.
    """
    check_torch_version()
    refusal = vocab_passes_unsupported(schedule)
    if refusal is not None:
        raise TorchExportError(refusal)
    if any(not a.is_compute for _, _, a in schedule.actions()):
        raise TorchExportError(f"{_name(schedule)} carries send/receive actions: PyTorch's runtime derives its "
                               f"own, so export the compute-only schedule (schedule.compute_only())")
    try:
        validate(schedule)
    except ScheduleError as e:
        raise TorchExportError(f"{_name(schedule)} is not a valid schedule: {e}") from None
    torch_placement(schedule)  # refuses a placement PyTorch has no numbering for
    written = as_run(schedule) if merge_iw else schedule  # I + its W -> B, unless written as run
    return {r: [_ts._Action(a.stage, _TORCH_TYPE[a.op], a.mb) for a in acts] for r, acts in enumerate(written.ranks)}


def parse_cell(text: str) -> Any:
    """Read one compute-only cell by a full match (PyTorch's ``from_str`` matches a prefix)."""
    m = _CELL.fullmatch(text)
    if m is None:
        raise TorchExportError(f"{text!r} is not a compute-only action cell (stage, one of F I W B, microbatch; "
                               f"e.g. 2F0)")
    return _ts._Action(int(m.group(1)), _ts._ComputationType(m.group(2)), int(m.group(3)))


def torch_csv_text(schedule: Schedule) -> str:
    """The compute-only CSV of ``schedule``, every cell checked by an exact round trip."""
    actions = to_torch_actions(schedule)
    buf = io.StringIO()
    writer = csv.writer(buf)  # as PyTorch's _dump_csv writes it
    for r in range(schedule.num_ranks):
        writer.writerow([str(a) for a in actions[r]])
    text = buf.getvalue()
    _check_round_trip(_parse_rows(text, "the CSV text"), actions, "the CSV text")
    return text


def read_torch_csv(path: str | Path) -> dict[int, list[Any]]:
    """A compute-only CSV as ``{rank: [_Action or None, ...]}``, every cell read by a full match
    (an empty cell is an idle slot, ``None``, as PyTorch's ``_dump_csv`` writes it)."""
    check_torch_version()
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise TorchExportError(f"cannot read {path}: {e.strerror or e}") from None
    return _parse_rows(text, str(path))


def write_torch_csv(schedule: Schedule, path: str | Path) -> TorchPlacement:
    """Write ``schedule``'s compute-only CSV to ``path`` after PyTorch's own checks; re-read it.

    Raises:
        TorchExportError: the schedule cannot be expressed, PyTorch's validation or lowering
            refuses it, the file cannot be written, or it does not read back exactly.
    """
    text = torch_csv_text(schedule)
    torch_lowering(schedule)
    try:
        Path(path).write_text(text, newline="")
    except OSError as e:
        raise TorchExportError(f"cannot write {path}: {e.strerror or e}") from None
    _check_round_trip(read_torch_csv(path), to_torch_actions(schedule), str(path))
    return torch_placement(schedule)


def torch_lowering(schedule: Schedule) -> dict[int, list[Any]]:
    """PyTorch's own lowering of the exported actions (module doc), run offline; returns it.

    ``_prepare_schedule_with_comms`` validates (``_validate_schedule``) and lowers; its
    ``stage_index_to_group_rank`` must equal the schedule's placement; the lowered lists, less
    UNSHARD/RESHARD/REDUCE_GRAD, must run to the end in ``_simulate_comms_compute``.
    """
    actions = to_torch_actions(schedule)
    p, n, m = schedule.num_ranks, schedule.num_stages, schedule.num_microbatches
    runtime = _ts._PipelineScheduleRuntime([StandInStage(n, p) for _ in range(n // p)], m)
    try:
        runtime._prepare_schedule_with_comms({r: list(acts) for r, acts in actions.items()})
        s2r = runtime.stage_index_to_group_rank
        if [s2r[s] for s in range(n)] != list(schedule.stage_to_rank):
            raise AssertionError(f"PyTorch maps stages to ranks as {s2r}, the schedule as {schedule.stage_to_rank}")
        lowered = runtime.pipeline_order_with_comms
        _ts._simulate_comms_compute(
            {r: [a for a in acts if a.computation_type.name not in _NOT_COMPUTED_BY_SIMULATOR]
             for r, acts in lowered.items()}, lambda s: s2r[s], n)
    except (AssertionError, ValueError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TorchExportError(f"PyTorch's runtime refuses {_name(schedule)}: {first}") from None
    return lowered


def prepare_runtime(runtime: Any, schedule: Schedule, *, merge_iw: bool = True) -> None:
    """Load ``schedule`` into ``runtime``, a ``_PipelineScheduleRuntime`` of this rank's stages.

    Checked first: the runtime's microbatches, number of stages and pipeline size are the
    schedule's, and this rank's ``PipelineStage`` indices are the stages the schedule places on it.
    ``merge_iw``: as in :func:`to_torch_actions`.
    """
    check_torch_version()
    if not isinstance(runtime, _ts._PipelineScheduleRuntime):
        raise TorchExportError(f"expected a torch.distributed.pipelining _PipelineScheduleRuntime, got "
                               f"{type(runtime).__name__}: only it runs a loaded action list")
    checks: Sequence[tuple[str, int, int]] = (
        ("n_microbatches", runtime._n_microbatches, schedule.num_microbatches),
        ("stages", runtime._num_stages, schedule.num_stages),
        ("pipeline ranks", runtime.pp_group_size, schedule.num_ranks))
    for what, got, want in checks:
        if got != want:
            raise TorchExportError(f"the runtime has {what}={got}, {_name(schedule)} has {want}: build the "
                                   f"PipelineStages and the runtime for the schedule's shape")
    mine = sorted(st.stage_index for st in runtime._stages)
    want_stages = schedule.stages_of(runtime.rank)
    if mine != want_stages:
        style = torch_placement(schedule).style
        raise TorchExportError(f"rank {runtime.rank} holds stages {mine}, but {_name(schedule)} places stages "
                               f"{want_stages} on it: build its PipelineStages with those stage indices "
                               f"(PyTorch's '{style}' placement)")
    runtime._prepare_schedule_with_comms(to_torch_actions(schedule, merge_iw=merge_iw))


# ---------------------------------------------------------------------- helpers
def _name(schedule: Schedule) -> str:
    return f"schedule {schedule.name!r}" if schedule.name else "the schedule"


def _parse_rows(text: str, source: str) -> dict[int, list[Any]]:
    """Every row of a compute-only CSV, each cell by :func:`parse_cell` and by PyTorch's parser."""
    out: dict[int, list[Any]] = {}
    for r, row in enumerate(csv.reader(io.StringIO(text, newline=""))):
        acts = []
        for i, cell in enumerate(row):
            if cell == "":  # an idle slot, as PyTorch's _dump_csv writes None
                acts.append(None)
                continue
            try:
                a = parse_cell(cell)
            except TorchExportError as e:
                raise TorchExportError(f"{source}: rank {r} cell #{i}: {e}") from None
            if _ts._Action.from_str(cell) != a:
                raise TorchExportError(f"{source}: rank {r} cell #{i} {cell!r}: PyTorch reads it as "
                                       f"{_ts._Action.from_str(cell)!r}, not {a!r}")
            acts.append(a)
        out[r] = acts
    return out


def _check_round_trip(got: dict[int, list[Any]], want: dict[int, list[Any]], source: str) -> None:
    """``got`` (read back) must be ``want`` (written), rank by rank, cell by cell."""
    if sorted(got) != sorted(want):
        raise TorchExportError(f"{source}: read back ranks {sorted(got)}, wrote ranks {sorted(want)}")
    for r in want:
        for i, (g, w) in enumerate(zip(got[r], want[r])):
            if g != w:
                raise TorchExportError(f"{source}: rank {r} cell #{i} reads back as {g!r}, was written as {w!r}")
        if len(got[r]) != len(want[r]):
            raise TorchExportError(f"{source}: rank {r} reads back {len(got[r])} cells, {len(want[r])} written")

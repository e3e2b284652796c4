"""The measured-cost profile: what ``pretrain_gpt_zb.py --profile-out FILE`` writes, ``plan --profile`` reads.

Format (JSON object, version 1)::

    {
      "format": "megatron-zb-profile",
      "version": 1,
      "model":    {...every field of PlanModel: "num_layers": 22, "hidden_size": 2304, ...},
      "parallel": {"pipeline_model_parallel_size": 8, "tensor_model_parallel_size": 1,
                   "data_parallel_size": 1, "num_microbatches": 24, "sequence_parallel": false,
                   "use_distributed_optimizer": false, "allow_padding_num_layers": true,
                   "num_virtual_stages_per_pipeline_rank": null,
                   "decoder_first_pipeline_num_layers": null,     # the uneven-split flags
                   "decoder_last_pipeline_num_layers": null,      # (optional: files written before
                   "account_for_embedding_in_pipeline_split": false,  # they existed read as unset)
                   "account_for_loss_in_pipeline_split": false},
      "schedule": "1f1b",            # schedule the costs were measured under
      "placement": "plain",          # "plain" | "interleaved" | "v"
      "stage_to_rank": [0, 1, ..., 7],
      "t_comm_ms": 0.6,              # one stage-to-stage transfer (activation or gradient)
      "stages": [                    # one entry per pipeline stage, stage order
        {"t_f_ms": 12.1, "t_b_ms": 11.9, "t_w_ms": 6.2,
         "mem_b_bytes": 2.5e9, "mem_w_bytes": 2.1e9},
        ...
      ],
      "device": "NVIDIA A100-SXM4-80GB",  # optional, free text
      "step_ms": 21.4,               # optional: measured time per iteration outside the schedule
      "action_overhead_ms": 0.35,    # optional: measured runtime time per compute action
      "duration_spread": {           # optional: how one action's duration varies around its median
        "F": [0.78, 0.86, ..., 1.31], "B": [...], "W": [...]},
      "action_times": {              # optional: every compute op's host and device time per stage
        "clock": "cuda_events",      # "host": CPU, the device time is the host time; "cuda_events"
        "host_bound_fraction": 0.5,  # an op is host-bound when waited_ms > this x device_ms
        "ops": [{"op": "F", "stage": 0, "host_ms": 36.0, "device_ms": 38.9, "waited_ms": 31.2,
                 "host_bound": true, "causes": ["data loading in the main thread (--num-workers 0)", ...]},
                ...]}
    }

Units: times in milliseconds per microbatch through the stage (``--profile-out`` writes the median
over the profiled microbatches; the compute alone, the runtime's overhead is ``action_overhead_ms``), ``t_b`` the input-gradient backward and ``t_w`` the weight-gradient backward (for a
fused backward, measure ``B`` + ``W`` and split it, or profile a zero-bubble schedule);
``mem_b_bytes`` the activation memory one microbatch's forward leaves allocated until its ``B``,
``mem_w_bytes`` the part still allocated from ``B`` until ``W``, bytes on one GPU.
``step_ms`` (optional, ``null`` or absent: not measured) is the median time per iteration a rank spends
outside the execution of the schedule's action list -- from the end of one iteration's actions to
the start of the next: ``finalize_model_grads`` (the tied-embedding and data-parallel gradient
all-reduces), the optimizer step, zeroing the gradients, the loss reduction and the log line --
the minimum over pipeline ranks (the rank that finishes the pipeline last waits least). The planner
uses it in place of its optimizer and data-parallel estimates when the plan keeps the profile's DP
size and optimizer. ``action_overhead_ms`` (optional, same rule) is the runtime's own time per
compute action outside the compute: the executor loop and bookkeeping plus the ``isend`` calls,
the receive posting and the end-of-iteration drain of sends, i.e. the part of the p2p calls that is
not waiting for a peer's data (that wait is what the simulator's ``T_comm`` and dependencies
model); mean over pipeline ranks. The planner adds it to the duration of every compute action.
``duration_spread`` (optional, same rule) holds per compute op the quantiles of ``duration /
median`` of the profiled actions (each action divided by the median of its op and stage, pooled
over the stages) at levels ``(k + 0.5) / n``, ascending, dimensionless: the planner draws every
action's duration from it and predicts the median iteration of those draws
(:mod:`megatron_zb.schedules.spread`), which is longer than the iteration of the median durations.
``action_times`` (optional, ``null`` or absent: not written) holds, per compute op (``F``, ``B``,
``W``, ``BW``, the vocabulary passes ``IF``/``S``/``T``/``IB`` where they ran) and stage, the median
host time of one action (``host_ms``: from its start to the return of its code, host ``perf_counter``)
and the median device time (``device_ms``: CUDA events; on CPU, ``clock: "host"``, the same clock as
``host_ms``), ms; ``waited_ms`` the median of each action's upper bound on the time the device waited
for the host inside it (``null`` on CPU, where nothing can be observed;
:func:`megatron_zb.runtime.action_timing.device_waits` derives the bound), ``host_bound`` whether
``waited_ms > host_bound_fraction x device_ms``, and ``causes`` the likely causes the run saw in its
own configuration (empty unless host-bound; :mod:`megatron_zb.training.host_bound`). The planner does
not read it. The CUDA numbers are verified with a mocked CUDA clock on CPU only, never on a GPU.
These four keys were added after version 1's first files; files without them are still read
(version stays 1).

``model`` and ``parallel`` use Megatron's argument names (:mod:`.model`); the planner plans for
them, so the plan's model flags may be omitted and must agree when given. A writer builds them
with :func:`~.model.make_model` / :func:`~.model.make_parallel` from its own arguments and calls
:func:`write_profile`.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Sequence

from megatron_zb.schedules import Op, Placement, ScheduleError
from megatron_zb.schedules.spread import DurationSpread
from .model import PlanError, PlanLayout, PlanModel, check_model

FORMAT = "megatron-zb-profile"
VERSION = 1
PLACEMENTS = ("plain", "interleaved", "v")
CLOCKS = ("host", "cuda_events")  # action_times.clock: CPU (host = device) or CUDA events


@dataclass(frozen=True)
class StageProfile:
    """Measured costs of one stage (units in the module doc)."""

    t_f_ms: float
    t_b_ms: float
    t_w_ms: float
    mem_b_bytes: float
    mem_w_bytes: float


@dataclass(frozen=True)
class OpTime:
    """One compute op's medians on one stage and its host-bound flag (``action_times`` in the module doc)."""

    op: str
    stage: int
    host_ms: float
    device_ms: float
    waited_ms: float | None
    host_bound: bool
    causes: tuple[str, ...] = ()


@dataclass(frozen=True)
class ActionTimes:
    """``action_times``: the clock of the device times, the host-bound threshold, one :class:`OpTime`
    per op and stage (module doc)."""

    clock: str
    host_bound_fraction: float
    ops: tuple[OpTime, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"clock": self.clock, "host_bound_fraction": self.host_bound_fraction,
                "ops": [dict(asdict(o), causes=list(o.causes)) for o in self.ops]}

    @classmethod
    def from_dict(cls, raw: Any) -> "ActionTimes | None":
        """The parsed ``action_times`` (``None`` stays ``None``; ``ValueError`` on a malformed value)."""
        if raw is None:
            return None
        if not isinstance(raw, dict) or set(raw) != {"clock", "host_bound_fraction", "ops"} \
                or raw["clock"] not in CLOCKS or not isinstance(raw["ops"], list):
            raise ValueError(f"action_times must be {{\"clock\": one of {CLOCKS}, \"host_bound_fraction\", "
                             f"\"ops\": [...]}}, got {raw!r}")
        ops = [_build(OpTime, o, f"action_times.ops[{i}]") for i, o in enumerate(raw["ops"])]
        return cls(clock=raw["clock"], host_bound_fraction=float(raw["host_bound_fraction"]),
                   ops=tuple(replace(o, causes=tuple(o.causes)) for o in ops))


@dataclass(frozen=True)
class Profile:
    """A profile file's content.

    Attributes:
        model: the model it was measured with.
        parallel: the parallel layout it was measured with.
        schedule: schedule name it was measured under.
        placement: ``"plain"``, ``"interleaved"`` or ``"v"``.
        stage_to_rank: rank of each stage.
        t_comm_ms: one stage-to-stage transfer, ms.
        stages: per-stage costs, stage order.
        device: free-text device name, or ``None``.
        step_ms: measured time per iteration outside the schedule's actions, ms, or ``None``.
        action_overhead_ms: measured runtime time per compute action beyond the compute, ms, or
            ``None`` (module doc for both).
        duration_spread: measured variation of the action durations, or ``None`` (module doc).
        action_times: host and device time per op and stage, host-bound flags, or ``None`` (module doc).
    """

    model: PlanModel
    parallel: PlanLayout
    schedule: str
    placement: str
    stage_to_rank: tuple[int, ...]
    t_comm_ms: float
    stages: tuple[StageProfile, ...]
    device: str | None = None
    step_ms: float | None = None
    action_overhead_ms: float | None = None
    duration_spread: DurationSpread | None = None
    action_times: ActionTimes | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "model": self.model.to_flags(),
                "parallel": self.parallel.to_flags(), "schedule": self.schedule, "placement": self.placement,
                "stage_to_rank": list(self.stage_to_rank), "t_comm_ms": self.t_comm_ms,
                "stages": [asdict(s) for s in self.stages], "device": self.device, "step_ms": self.step_ms,
                "action_overhead_ms": self.action_overhead_ms,
                "duration_spread": None if self.duration_spread is None else {
                    op.value: list(q) for op, q in self.duration_spread.quantiles.items()},
                "action_times": None if self.action_times is None else self.action_times.to_dict()}


def write_profile(path: str | Path, *, model: PlanModel, parallel: PlanLayout, schedule: str, placement: str,
                  stage_to_rank: Sequence[int], t_comm_ms: float, stages: Sequence[StageProfile],
                  device: str | None = None, step_ms: float | None = None,
                  action_overhead_ms: float | None = None,
                  duration_spread: DurationSpread | None = None, action_times: ActionTimes | None = None) -> Profile:
    """Check and write a profile to ``path`` (JSON); returns what was written.

    Raises:
        PlanError: inconsistent content (same checks as :func:`read_profile`).
        OSError: the file cannot be written.
    """
    try:
        optional = {k: _optional_float(k, v) for k, v in (("step_ms", step_ms),
                                                          ("action_overhead_ms", action_overhead_ms))}
    except ValueError as e:
        raise PlanError("--profile", f"{path}: {e}") from None
    prof = Profile(model=model, parallel=parallel, schedule=schedule, placement=placement,
                   stage_to_rank=tuple(int(r) for r in stage_to_rank), t_comm_ms=float(t_comm_ms),
                   stages=tuple(stages), device=device, duration_spread=duration_spread, action_times=action_times,
                   **optional)
    _check(prof, str(path))
    Path(path).write_text(json.dumps(prof.to_dict(), indent=1) + "\n")
    return prof


def read_profile(path: str | Path) -> Profile:
    """Read and check a profile file.

    Raises:
        PlanError: unreadable file, wrong format or version, missing or invalid values; the
            ``flag`` is ``--profile`` and the message names the file and key.
    """
    where = str(path)
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise PlanError("--profile", f"cannot read {where}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise PlanError("--profile", f"{where}: not valid JSON: {e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise PlanError("--profile", f"{where}: not a megatron-zb profile (needs \"format\": \"{FORMAT}\")")
    if data.get("version") != VERSION:
        raise PlanError("--profile",
                        f"{where}: version {data.get('version')!r} is not supported (this reads {VERSION})")
    try:
        prof = Profile(model=_build(PlanModel, data["model"], "model"),
                       parallel=_parallel(data["parallel"]), schedule=str(data["schedule"]),
                       placement=str(data["placement"]), stage_to_rank=tuple(data["stage_to_rank"]),
                       t_comm_ms=float(data["t_comm_ms"]),
                       stages=tuple(_build(StageProfile, s, f"stages[{i}]") for i, s in enumerate(data["stages"])),
                       device=data.get("device"), step_ms=_optional_float("step_ms", data.get("step_ms")),
                       action_overhead_ms=_optional_float("action_overhead_ms", data.get("action_overhead_ms")),
                       duration_spread=_spread(data.get("duration_spread")),
                       action_times=ActionTimes.from_dict(data.get("action_times")))
    except KeyError as e:
        raise PlanError("--profile", f"{where}: missing key {e}") from None
    except (TypeError, ValueError) as e:
        raise PlanError("--profile", f"{where}: {e}") from None
    _check(prof, where)
    return prof


def _build(cls: type, raw: Any, what: str) -> Any:
    """``cls(**raw)`` for a dataclass, naming unknown or missing keys."""
    if not isinstance(raw, dict):
        raise ValueError(f"{what} must be an object")
    unknown = sorted(set(raw) - {f.name for f in fields(cls)})
    missing = sorted(f.name for f in fields(cls) if f.name not in raw and f.default is MISSING)
    if unknown or missing:
        raise ValueError(f"{what}: " + "; ".join(([f"unknown keys {unknown}"] if unknown else [])
                                                  + ([f"missing keys {missing}"] if missing else [])))
    return cls(**raw)


def _optional_float(key: str, v: Any) -> float | None:
    """An optional number: ``None`` stays ``None``, numbers become floats, anything else raises ``ValueError``."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{key} must be a number or null, got {v!r}")
    return float(v)


def _spread(raw: Any) -> DurationSpread | None:
    """``duration_spread``: ``None``, or ``{"F" | "B" | "W": [ascending quantiles > 0]}`` (``ValueError`` otherwise)."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or not set(raw) <= {Op.F, Op.B, Op.W} or any(
            not isinstance(q, list) or any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in q)
            for q in raw.values()):
        raise ValueError(f"duration_spread must map F, B, W to lists of numbers, got {raw!r}")
    try:
        return DurationSpread({Op(k): tuple(float(x) for x in q) for k, q in raw.items()})
    except ScheduleError as e:
        raise ValueError(str(e)) from None


def _parallel(raw: Any) -> PlanLayout:
    if not isinstance(raw, dict):
        raise ValueError("parallel must be an object")
    return PlanLayout.from_flags(raw)


def _check(prof: Profile, where: str) -> None:
    def bad(msg: str) -> PlanError:
        return PlanError("--profile", f"{where}: {msg}")
    try:
        check_model(prof.model)
    except PlanError as e:
        raise bad(f"model: {e}") from None
    if prof.placement not in PLACEMENTS:
        raise bad(f"placement {prof.placement!r} is not one of {', '.join(PLACEMENTS)}")
    n, pp = len(prof.stages), prof.parallel.pp
    if n < 2 or len(prof.stage_to_rank) != n:
        raise bad(f"needs >= 2 stages and one stage_to_rank entry per stage (got {n} stages, "
                  f"{len(prof.stage_to_rank)} entries)")
    chunks = n // pp
    if n % pp or list(prof.stage_to_rank) != Placement(prof.placement).stage_to_rank(pp, chunks):
        raise bad(f"stage_to_rank {list(prof.stage_to_rank)} is not the {prof.placement} placement of {n} stages "
                  f"on {pp} ranks")
    if not (math.isfinite(prof.t_comm_ms) and prof.t_comm_ms >= 0):
        raise bad(f"t_comm_ms must be finite and >= 0, got {prof.t_comm_ms}")
    for key in ("step_ms", "action_overhead_ms"):
        v = getattr(prof, key)
        if v is not None and not (math.isfinite(v) and v >= 0):
            raise bad(f"{key} must be a finite number >= 0 or null, got {v!r}")
    for i, s in enumerate(prof.stages):
        for key in ("t_f_ms", "t_b_ms", "t_w_ms", "mem_b_bytes", "mem_w_bytes"):
            v = getattr(s, key)
            positive = key in ("t_f_ms", "t_b_ms")
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (positive and v == 0):
                raise bad(f"stages[{i}].{key} must be a finite number {'> 0' if positive else '>= 0'}, got {v!r}")
    for i, o in enumerate(prof.action_times.ops if prof.action_times is not None else ()):
        for key in ("host_ms", "device_ms", "waited_ms"):
            v = getattr(o, key)
            if (v is None and key != "waited_ms") or (v is not None and not (
                    isinstance(v, (int, float)) and math.isfinite(v) and v >= 0)):
                raise bad(f"action_times.ops[{i}].{key} must be a finite number >= 0"
                          f"{' or null' if key == 'waited_ms' else ''}, got {v!r}")

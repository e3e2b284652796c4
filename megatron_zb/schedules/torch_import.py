"""Import PyTorch's pipelining schedules (``torch.distributed.pipelining``) into our IR.

PyTorch's schedule classes compute every rank's compute-only action list in their constructor
(``pipeline_order: dict[rank, list[_Action | None]]``). Building them needs no process group and
no GPU: the constructors only read ``num_stages``, ``group_size``, ``group_rank`` and ``submod``
from the stage objects, so :class:`StandInStage` carries just those. ``group_rank`` is irrelevant
because the constructor computes all ranks.

Conversion (:func:`convert_pipeline_order`):

* ``FORWARD -> F``, ``BACKWARD_INPUT -> B``, ``BACKWARD_WEIGHT -> W``, ``FULL_BACKWARD -> BW``;
* ``OVERLAP_F_B`` (DualPipeV) -> its ``sub_actions`` in their given order (the F, then the
  backward), each converted by the rules above;
* ``None`` idle slots, and the non-compute ``REDUCE_GRAD`` (plus any UNSHARD/RESHARD/SEND/RECV,
  should a lowered order be passed) are dropped; their counts go to ``schedule.meta["dropped"]``.

``stage_to_rank`` comes from the class's documented placement (:data:`TORCH_SCHEDULES`): plain for
the single-stage classes, stage ``s`` on rank ``s % p`` for the looped/interleaved ones, the V for
ZBV and DualPipeV. For the multi-stage classes it is cross-checked against the mapping the
constructed object reports (``stage_index_to_group_rank``), so a placement change in a later
PyTorch is an error rather than a silently wrong import.

The ``Schedule1F1B`` defect (torch 2.13): the action list of the last rank has forwards for
microbatches ``1..m`` instead of ``0..m-1`` (it starts counting forwards at 1 when that rank has
no warm-up forward), so it lacks ``F(0)`` and names a nonexistent microbatch ``m``; PyTorch's
runtime does not execute that list, which is why it goes unnoticed there. What we do:

* by default :func:`import_torch_schedule` validates the converted schedule and raises
  :class:`TorchImportError` naming the first bad action -- the defect is *reported*, never
  papered over;
* with ``repair=True`` the last rank's forward microbatch indices are shifted down by one when, and
  only when, the list has exactly that defect's signature (forwards ``1..m`` in order, backwards
  ``0..m-1``); the result is the plain 1F1B order for that rank (``F0 BW0 F1 BW1 ...``), which we
  validate again. ``schedule.meta["repaired"]`` says what was changed. Any other kind of invalid
  list is still reported, not guessed at.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .ir import V_CHUNKS_PER_RANK, Action, Op, Placement, Schedule, ScheduleError, validate


class TorchImportError(ScheduleError):
    """A PyTorch schedule could not be built, converted, or does not validate in our IR."""


TORCH_COMPUTE_OPS: dict[str, Op] = {
    "FORWARD": Op.F,
    "BACKWARD_INPUT": Op.B,
    "BACKWARD_WEIGHT": Op.W,
    "FULL_BACKWARD": Op.BW,
}
"""PyTorch ``_ComputationType`` name -> our compute op: the one table for both directions (the export,
:mod:`megatron_zb.torch_pipelining.export`, reads it inverted). PyTorch's letters differ from ours:
its ``I`` is our ``B``, its ``B`` our fused ``BW``."""


@dataclass(frozen=True)
class TorchScheduleInfo:
    """What we know about one PyTorch schedule class.

    Attributes:
        cls_name: attribute name in ``torch.distributed.pipelining.schedules``.
        placement: :class:`~.ir.Placement` (``INTERLEAVED``: stage ``s`` on rank ``s % p``).
        multi_stage: whether the constructor takes a list of local stages (else one stage).
        fixed_chunks: chunks per rank the class requires (2 for the V ones), or ``None`` when it
            takes any number (``num_chunks`` argument).
        constraints: the shape constraints its constructor enforces (torch 2.13), for reports.
    """

    cls_name: str
    placement: Placement
    multi_stage: bool
    fixed_chunks: int | None
    constraints: str

    def chunks(self, num_chunks: int) -> int:
        return self.placement.chunks_per_rank(self.fixed_chunks if self.fixed_chunks is not None else num_chunks)


TORCH_SCHEDULES: dict[str, TorchScheduleInfo] = {
    info.cls_name: info for info in [
        TorchScheduleInfo("ScheduleGPipe", Placement.PLAIN, False, None, "any m >= 1"),
        TorchScheduleInfo("Schedule1F1B", Placement.PLAIN, False, None,
                          "m >= p; last rank's list lacks F(mb=0) (see module doc)"),
        TorchScheduleInfo("ScheduleInterleaved1F1B", Placement.INTERLEAVED, True, None,
                          "m % max(1, m // p) == 0"),
        TorchScheduleInfo("ScheduleLoopedBFS", Placement.INTERLEAVED, True, None, "any m >= 1"),
        TorchScheduleInfo("ScheduleInterleavedZeroBubble", Placement.INTERLEAVED, True, None,
                          "m % max(1, m // p) == 0"),
        TorchScheduleInfo("ScheduleZBVZeroBubble", Placement.V, True, V_CHUNKS_PER_RANK, "exactly 2 stages per rank"),
        TorchScheduleInfo("ScheduleDualPipeV", Placement.V, True, V_CHUNKS_PER_RANK, "exactly 2 stages per rank; m >= 2p"),
    ]
}
"""The PyTorch schedule classes we import, by class name."""


def torch_schedule_names() -> list[str]:
    """Names accepted by :func:`import_torch_schedule` that the installed PyTorch provides."""
    try:
        mod = _torch_schedules_module()
    except TorchImportError:
        return []
    return [n for n in TORCH_SCHEDULES if hasattr(mod, n)]


def placement_of(cls_name: str, num_ranks: int, num_chunks: int = 2) -> list[int]:
    """Our ``stage_to_rank`` for PyTorch schedule class ``cls_name``."""
    info = _info(cls_name)
    return info.placement.stage_to_rank(num_ranks, info.chunks(num_chunks))


class StandInStage:
    """The four attributes PyTorch's schedule constructors read from a pipeline stage (also used
    by the export, :mod:`megatron_zb.torch_pipelining.export`, to run PyTorch's lowering offline).

    The multi-stage constructors also *assign* ``stage_index_to_group_rank`` on it; a plain
    object accepts that.
    """

    def __init__(self, num_stages: int, group_size: int, group_rank: int = 0) -> None:
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = group_rank
        self.submod = None


def build_torch_order(cls_name: str, *, num_ranks: int, num_microbatches: int,
                      num_chunks: int = 2) -> tuple[dict[int, list[Any]], dict[int, int] | None]:
    """Construct PyTorch's ``cls_name`` offline; return its ``pipeline_order`` and stage->rank map.

    The map is the object's ``stage_index_to_group_rank`` (``None`` for single-stage classes).
    PyTorch's own refusals (``ValueError`` for unsupported shapes) become :class:`TorchImportError`.
    """
    info = _info(cls_name)
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise TorchImportError(f"num_ranks must be an integer >= 1, got {num_ranks!r}")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise TorchImportError(f"num_microbatches must be an integer >= 1, got {num_microbatches!r}")
    mod = _torch_schedules_module()
    cls = getattr(mod, cls_name, None)
    if cls is None:
        raise TorchImportError(f"this PyTorch has no {cls_name}")
    v = info.chunks(num_chunks)
    if v < 1:
        raise TorchImportError(f"num_chunks must be >= 1, got {num_chunks}")
    n_stages = num_ranks * v
    try:
        if info.multi_stage:
            obj = cls([StandInStage(n_stages, num_ranks) for _ in range(v)], num_microbatches)
        else:
            obj = cls(StandInStage(n_stages, num_ranks), num_microbatches)
    except (ValueError, AssertionError, RuntimeError) as e:
        raise TorchImportError(f"PyTorch's {cls_name} refuses p={num_ranks}, m={num_microbatches}"
                               f"{f', {v} chunks per rank' if v > 1 else ''}: {e}") from None
    order = getattr(obj, "pipeline_order", None)
    if not order:
        raise TorchImportError(f"PyTorch's {cls_name} built no pipeline_order")
    s2r = getattr(obj, "stage_index_to_group_rank", None) if info.multi_stage else None
    return {int(r): list(acts) for r, acts in order.items()}, (dict(s2r) if s2r is not None else None)


def convert_pipeline_order(order: Mapping[int, Sequence[Any]], *, num_microbatches: int,
                           stage_to_rank: Sequence[int], name: str = "") -> Schedule:
    """Convert a PyTorch ``pipeline_order`` into a :class:`Schedule` (not validated).

    Every rank ``0..p-1`` must be present (``p = max(stage_to_rank) + 1`` or ``len(order)``,
    whichever is larger). Per-rank order is kept; see the module doc for the mapping.
    """
    p = max(len(order), max(stage_to_rank, default=-1) + 1)
    missing = [r for r in range(p) if r not in order]
    if missing:
        raise TorchImportError(f"pipeline_order lacks ranks {missing}")
    extra = sorted(set(order) - set(range(p)))
    if extra:
        raise TorchImportError(f"pipeline_order has unexpected rank keys {extra}")
    dropped: dict[str, int] = {}
    ranks: list[list[Action]] = []
    for r in range(p):
        row: list[Action] = []
        for i, a in enumerate(order[r]):
            if a is None:
                dropped["None"] = dropped.get("None", 0) + 1
                continue
            kind = a.computation_type.name
            if kind == "OVERLAP_F_B":
                if not a.sub_actions:
                    raise TorchImportError(f"rank {r} slot #{i}: OVERLAP_F_B without sub-actions")
                for sub in a.sub_actions:
                    row.append(_convert_one(sub, r, i))
            elif kind in TORCH_COMPUTE_OPS:
                row.append(_convert_one(a, r, i))
            else:
                dropped[kind] = dropped.get(kind, 0) + 1
        ranks.append(row)
    return Schedule(num_microbatches, list(stage_to_rank), ranks, name, {"source": "pytorch", "dropped": dropped})


def import_torch_schedule(cls_name: str, *, num_ranks: int, num_microbatches: int, num_chunks: int = 2,
                          repair: bool = False) -> Schedule:
    """Build PyTorch's ``cls_name`` for ``p`` ranks and ``m`` microbatches and convert it.

    Args:
        cls_name: a key of :data:`TORCH_SCHEDULES` (e.g. ``"ScheduleZBVZeroBubble"``).
        num_ranks, num_microbatches: pipeline shape.
        num_chunks: chunks per rank for the interleaved classes (the V classes always use 2).
        repair: reconstruct the documented ``Schedule1F1B`` last-rank defect (module doc);
            without it such a schedule is reported as invalid.

    Returns:
        a validated :class:`Schedule` named ``"torch:<cls_name>"``; ``meta`` holds ``source``,
        ``torch_class``, ``placement``, ``dropped`` and, when something was changed, ``repaired``.

    Raises:
        TorchImportError: PyTorch refuses the shape, the placement disagrees with the object's,
            or the converted schedule does not validate (the message gives the reason).
    """
    info = _info(cls_name)
    order, torch_s2r = build_torch_order(cls_name, num_ranks=num_ranks, num_microbatches=num_microbatches,
                                         num_chunks=num_chunks)
    s2r = placement_of(cls_name, num_ranks, num_chunks)
    if torch_s2r is not None and [torch_s2r.get(s) for s in range(len(s2r))] != s2r:
        raise TorchImportError(f"{cls_name}: expected placement {s2r}, but PyTorch's object maps stages to "
                               f"ranks as {[torch_s2r.get(s) for s in range(len(s2r))]}")
    sched = convert_pipeline_order(order, num_microbatches=num_microbatches, stage_to_rank=s2r,
                                   name=f"torch:{cls_name}")
    sched.meta.update(torch_class=cls_name, placement=info.placement)
    if repair and cls_name == "Schedule1F1B":
        note = repair_1f1b_last_rank(sched)
        if note:
            sched.meta["repaired"] = note
    try:
        validate(sched)
    except ScheduleError as e:
        hint = (" (known Schedule1F1B defect: its last rank's forwards are numbered 1..m; "
                "pass repair=True to reconstruct)") if cls_name == "Schedule1F1B" and not repair else ""
        raise TorchImportError(f"PyTorch's {cls_name} (p={num_ranks}, m={num_microbatches}) is invalid: "
                               f"{e}{hint}") from None
    return sched


# ---------------------------------------------------------------------- helpers
def _info(cls_name: str) -> TorchScheduleInfo:
    try:
        return TORCH_SCHEDULES[cls_name]
    except KeyError:
        raise TorchImportError(f"unknown PyTorch schedule {cls_name!r}; known: {', '.join(TORCH_SCHEDULES)}") \
            from None


def _torch_schedules_module() -> Any:
    try:
        import torch.distributed.pipelining.schedules as mod
    except Exception as e:  # torch missing, or built without distributed support
        raise TorchImportError(f"torch.distributed.pipelining is not available: {e}") from None
    return mod


def _convert_one(a: Any, rank: int, slot: int) -> Action:
    kind = a.computation_type.name
    if kind not in TORCH_COMPUTE_OPS:
        raise TorchImportError(f"rank {rank} slot #{slot}: {kind} is not a compute action")
    if a.microbatch_index is None or a.stage_index is None or a.stage_index < 0:
        raise TorchImportError(f"rank {rank} slot #{slot}: {a!r} lacks a stage or microbatch index")
    return Action(TORCH_COMPUTE_OPS[kind], int(a.microbatch_index), int(a.stage_index))


def repair_1f1b_last_rank(sched: Schedule) -> str:
    """Undo Schedule1F1B's off-by-one on its last rank, in place; return what was done ('' if nothing).

    Acts only on the exact signature: the last rank's forwards are ``1..m`` in order and its
    backwards ``BW 0..m-1`` in order. Then ``F(k)`` becomes ``F(k-1)``.
    """
    m, last = sched.num_microbatches, sched.num_ranks - 1
    acts = sched.ranks[last]
    fwd = [a.mb for a in acts if a.op is Op.F]
    bwd = [a.mb for a in acts if a.op is Op.BW]
    if fwd != list(range(1, m + 1)) or bwd != list(range(m)) or len(fwd) + len(bwd) != len(acts):
        return ""
    sched.ranks[last] = [Action(Op.F, a.mb - 1, a.stage) if a.op is Op.F else a for a in acts]
    return (f"rank {last}: forward microbatch indices 1..{m} renumbered to 0..{m - 1} "
            f"(PyTorch's list lacked F(mb=0) and named F(mb={m}))")

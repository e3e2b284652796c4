"""A megatron-zb schedule loaded into PyTorch's pipeline runtime for the user's ``PipelineStage``s.

Tested with PyTorch 2.13 (CPU, gloo); any other release is refused by
:func:`~.export.check_torch_version`. :func:`build_pipeline` takes this rank's
``torch.distributed.pipelining.PipelineStage`` objects, a megatron-zb schedule name, a
:class:`~megatron_zb.schedules.costs.CostModel` (or none: unit costs) and a memory limit, builds the
schedule, and returns a :class:`TorchPipeline` whose ``runtime`` is PyTorch's
``_PipelineScheduleRuntime`` loaded with it (:func:`~.export.prepare_runtime`: PyTorch's own
validation and lowering). ``TorchPipeline.step`` is the runtime's ``step``.
:func:`~.profiling.profile_and_replan` measures the stages' times inside that runtime and reloads
it with the schedule rebuilt from them.

What PyTorch's runtime spends, in the cost model
------------------------------------------------
Two facts of PyTorch 2.13's split backward, read from ``torch/distributed/pipelining/stage.py``
and ``_backward.py`` and measured by the tests (``tests/torch_pipelining/test_torch_runtime.py``):

* **Stage 0's ``I`` computes nothing** (``backward_one_chunk(full_backward=False)`` skips the
  first stage: it has no input gradient to send) and its ``W`` (``backward_weight_one_chunk``)
  runs the stage's *whole* backward. The schedule stays valid (nothing waits for stage 0's input
  gradient), but on stage 0 the time of ``B`` is spent in ``W``.
* **``I`` frees no activations** (but on the last stage what the loss saved):
  ``stage_backward_input`` runs ``torch.autograd.grad`` with ``retain_graph=True`` and keeps the
  graph's weight-side nodes for ``W``, so what a forward saved stays held until that microbatch's
  ``W`` -- ``M_W = M_B``, not the smaller ``M_W`` of megatron-zb's own runtime. Measured on the
  test model: the net change of saved bytes over an ``I`` is exactly 0 on every stage but the
  last, whose ``I`` frees the loss's part (its log-softmax of the logits; 14% of ``M_B`` there).

:func:`runtime_costs` puts both into the cost model the schedule is built from: stage 0's ``t_b``
becomes a negligible ``1e-6 x (t_b + t_w)`` (the cost model needs ``t_b > 0``) and its ``t_w`` the
rest of ``t_b + t_w``; every stage's ``mem_w`` becomes its ``mem_b``. :func:`build_pipeline`
applies it to the costs it is given (the model's own ``T_B``/``T_W``); costs measured inside the
runtime (:mod:`.profiling`) have both already.

Refused up front (:func:`check_stage_modules`, one line naming the cause and the fix) for a
schedule that splits the backward (``I``/``W``):

* a stage module that is, or contains, ``DistributedDataParallel``: PyTorch's split backward
  computes gradients with ``torch.autograd.grad`` on parts of the graph and writes ``.grad``
  itself, which bypasses the gradient hooks DDP's reducer relies on (pytorch issue 144530);
* a compiled stage module (``torch.compile(module)``, which returns a
  ``torch._dynamo.eval_frame.OptimizedModule``, or ``module.compile()``, which sets the private
  ``nn.Module._compiled_call_impl``; both private names of PyTorch 2.13, read here and nowhere
  else): the backward of a compiled region is one autograd node, which PyTorch's split backward
  cannot separate into ``I`` and ``W`` (PyTorch's own zero-bubble classes refuse ``OptimizedModule``);
* ``fully_shard``-ed submodules inside a stage module: under a split backward PyTorch 2.13 loses
  or corrupts their gradients (measured, :mod:`.fsdp`). A stage module ``fully_shard``-ed as one
  unit is taken, and its gradient reduce is modelled (:mod:`.fsdp`).

A schedule with fused backwards (``1f1b``, ``interleaved-1f1b``) takes such stages; that is
PyTorch's own path and not tested here.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.pipelining import schedules as _ts
from torch.nn.parallel import DistributedDataParallel

from ..schedules.catalog import ScheduleSpec
from ..schedules.costs import CostModel
from ..schedules.ir import Placement, Schedule
from ..schedules.registry import build_schedule, get_spec
from .choice import AUTO, choose_schedule, placement_of
from .export import TorchExportError, check_torch_version, prepare_runtime, to_torch_actions
from .fsdp import nested_fsdp

__all__ = ["STAGE0_TB_FRACTION", "TorchPipeline", "build_pipeline", "check_stage_modules", "runtime_costs",
           "stages_for_rank"]

STAGE0_TB_FRACTION = 1e-6
"""Stage 0's ``t_b`` in PyTorch's runtime, as a fraction of its ``t_b + t_w`` (module doc)."""


def stages_for_rank(schedule_name: str, *, num_ranks: int, rank: int, num_chunks: int = 2) -> list[int]:
    """The stage indices whose ``PipelineStage`` ``rank`` builds for ``schedule_name`` (the family's
    placement; ``num_chunks``: stages per rank of the interleaved families), ascending."""
    s2r = get_spec(schedule_name).placement.stage_to_rank(num_ranks, num_chunks)
    return [s for s, r in enumerate(s2r) if r == rank]


def runtime_costs(costs: CostModel, num_stages: int) -> CostModel:
    """``costs`` (the model's own per-stage times and memory) as PyTorch's runtime spends them:
    stage 0's backward time moved from ``t_b`` into ``t_w``, and every stage's ``mem_w`` set to its
    ``mem_b`` (module doc). Units are kept; the other stages' times, and ``t_bw`` (a fused
    backward's time; on stage 0 too: PyTorch's ``B`` is the whole backward there), are unchanged."""
    res = costs.resolve(num_stages)
    whole = res.t_b[0] + res.t_w[0]
    t_b, t_w = list(res.t_b), list(res.t_w)
    t_b[0] = STAGE0_TB_FRACTION * whole
    t_w[0] = whole - t_b[0]
    return replace(costs, t_f=list(res.t_f), t_b=t_b, t_w=t_w, mem_b=list(res.mem_b), mem_w=list(res.mem_b))


def _compiled(module: torch.nn.Module) -> bool:
    from torch._dynamo.eval_frame import OptimizedModule  # private: pinned with TESTED_TORCH
    return isinstance(module, OptimizedModule) or getattr(module, "_compiled_call_impl", None) is not None


def check_stage_modules(stages: Sequence[Any], schedule_name: str) -> None:
    """Refuse stage modules PyTorch's split backward cannot honour (module doc); a schedule with
    fused backwards only (``split_backward=False`` in the registry) takes any module; ``auto`` may
    choose a split one, so it refuses them too."""
    if schedule_name != AUTO and not get_spec(schedule_name).split_backward:
        return
    for st in stages:
        for name, mod in st.submod.named_modules():
            where = f"stage {st.stage_index}'s module" + (f" ({name})" if name else "")
            if isinstance(mod, DistributedDataParallel):
                raise TorchExportError(
                    f"{where} is wrapped in DistributedDataParallel, whose gradient hooks PyTorch's split backward "
                    f"(I/W) of {schedule_name!r} bypasses (pytorch issue 144530): pass the unwrapped module, or use "
                    f"a fused-backward schedule (1f1b, interleaved-1f1b)")
            if _compiled(mod):
                raise TorchExportError(
                    f"{where} is compiled (torch.compile), and PyTorch cannot split a compiled graph's backward into "
                    f"the I and W of {schedule_name!r}: pass the module uncompiled, or use a fused-backward schedule "
                    f"(1f1b, interleaved-1f1b)")
        nested = nested_fsdp(st)
        if nested:
            raise TorchExportError(
                f"stage {st.stage_index}'s module has fully_shard-ed submodules ({', '.join(nested[:3])}"
                f"{', ...' if len(nested) > 3 else ''}), whose gradients PyTorch 2.13 loses or gets wrong when the "
                f"backward is split into I and W, as {schedule_name!r} does: fully_shard each stage's module as one "
                f"unit, or use a fused-backward schedule (1f1b, interleaved-1f1b)")


def _agree_on_stage_modules(stages: Sequence[Any], schedule_name: str) -> None:
    """:func:`check_stage_modules` on every pipeline rank, agreed (an all-gather over the stages'
    group): a rank whose stages are fine raises another rank's refusal too, instead of waiting for
    it in the schedule's load."""
    try:
        check_stage_modules(stages, schedule_name)
        mine = None
    except TorchExportError as e:
        mine = str(e)
    group = stages[0].group
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    if mine is not None:
        raise TorchExportError(mine)
    for rank, msg in enumerate(every):
        if msg is not None:
            raise TorchExportError(f"pipeline rank {rank}: {msg}")


class _TimedLoss:
    """The user's loss function; while a :class:`~.profiling.StageTimer` is set, its time is added
    to the forward of the last stage that just ran (the runtime computes the loss right after it)."""

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        self.fn = fn
        self.timer: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.timer is None:
            return self.fn(*args, **kwargs)
        with self.timer.loss():
            return self.fn(*args, **kwargs)


@dataclass
class TorchPipeline:
    """PyTorch's runtime for this rank's stages, loaded with a megatron-zb schedule.

    Attributes:
        runtime: the ``_PipelineScheduleRuntime`` (``step(...)`` as PyTorch documents it).
        stages: this rank's ``PipelineStage`` objects.
        schedule_name: the registered megatron-zb family, or ``"auto"`` (:mod:`.choice`).
        schedule: the schedule loaded now (for ``auto``: the chosen family's, ``schedule.name``).
        costs: the cost model it was built from, as PyTorch's runtime spends it
            (:func:`runtime_costs`; after a re-plan, the measured one: milliseconds).
        memory_limit: per-rank activation limit, unit of ``costs.mem_b`` (``None``: the family's default).
        num_chunks: stages per rank for the interleaved families.
        loss: the loss function as the runtime calls it (timed while profiling), or ``None``.
        placement: the stages' placement (for ``auto``: read from them; else the family's).
        candidates: for ``auto``, every candidate's ``(name, predicted iteration time, simulated
            peak)`` at the last choice, best first (units of the costs); else ``None``.
    """

    runtime: Any
    stages: list[Any]
    schedule_name: str
    schedule: Schedule
    costs: CostModel
    memory_limit: float | None
    num_chunks: int
    loss: _TimedLoss | None
    placement: Placement = Placement.PLAIN
    candidates: list[tuple] | None = None

    @property
    def spec(self) -> ScheduleSpec:
        """The loaded schedule's family (for ``auto``: the chosen one; a PyTorch order, ``torch:<class>``,
        has none: :func:`~megatron_zb.schedules.registry.get_spec` raises)."""
        return get_spec(self.schedule.name or self.schedule_name)

    @property
    def group(self) -> Any:
        """The stages' process group (``None``: the default group)."""
        return self.stages[0].group

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """One iteration: PyTorch's ``_PipelineScheduleRuntime.step`` (the first stage takes the
        inputs, the last ``target=`` and ``losses=``)."""
        return self.runtime.step(*args, **kwargs)

    def load(self, schedule: Schedule, *, merge_iw: bool = True) -> None:
        """Load ``schedule`` into the runtime (PyTorch's validation and lowering), after checking
        that every pipeline rank built the same one (an all-gather of its digest over the stages' group)."""
        actions = to_torch_actions(schedule, merge_iw=merge_iw)
        digest = hashlib.sha256(repr(sorted((r, [str(a) for a in acts]) for r, acts in actions.items()))
                                .encode()).hexdigest()
        digests: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(digests, digest, group=self.group)
        if len(set(digests)) != 1:
            raise TorchExportError(f"pipeline ranks built different {self.schedule_name!r} schedules (costs or memory "
                                   f"limit differ between ranks): give every rank the same inputs")
        prepare_runtime(self.runtime, schedule, merge_iw=merge_iw)
        self.schedule = schedule

    def rebuild(self, costs: CostModel) -> Schedule:
        """Build the family's schedule from ``costs`` (already as PyTorch's runtime spends them, e.g.
        measured by :func:`~.profiling.profile_and_replan`) and :attr:`memory_limit`, load it, return it
        (``auto``: chosen again, :attr:`candidates` updated)."""
        sched, self.candidates = _build(self.schedule_name, self.placement, num_ranks=self.schedule.num_ranks,
                                        num_microbatches=self.schedule.num_microbatches, costs=costs,
                                        memory_limit=self.memory_limit, num_chunks=self.num_chunks)
        self.load(sched)
        self.costs = costs
        return sched


def _build(name: str, placement: Placement, *, num_ranks: int, num_microbatches: int, costs: CostModel,
           memory_limit: float | None, num_chunks: int) -> tuple[Schedule, list[tuple] | None]:
    """The family's schedule, or ``auto``'s choice and its candidates (:func:`~.choice.choose_schedule`)."""
    if name == AUTO:
        return choose_schedule(placement, num_ranks=num_ranks, num_microbatches=num_microbatches, costs=costs,
                               memory_limit=memory_limit, num_chunks=num_chunks)
    return build_schedule(name, num_ranks=num_ranks, num_microbatches=num_microbatches, costs=costs,
                          memory_limit=memory_limit, num_chunks=num_chunks), None


def build_pipeline(stages: Sequence[Any], schedule_name: str, *, num_microbatches: int,
                   loss_fn: Callable[..., torch.Tensor] | None, costs: CostModel | None = None,
                   memory_limit: float | None = None, **runtime_kwargs: Any) -> TorchPipeline:
    """PyTorch's ``_PipelineScheduleRuntime`` for ``stages`` loaded with megatron-zb's ``schedule_name``.

    Args:
        stages: this rank's ``PipelineStage`` objects, with the stage indices the family places on
            this rank (one for the plain families; ``v`` stages ``r, r+p, ...`` for the interleaved
            ones; stages ``r`` and ``2p-1-r`` for the V families), all of the same pipeline.
        schedule_name: a registered family (``megatron-zb list``), or ``"auto"``: the fastest
            candidate of the stages' placement within the memory limit, predicted from the costs
            (:mod:`.choice`; ``pipe.candidates`` lists them).
        num_microbatches: microbatches per ``step``.
        loss_fn: as PyTorch's schedules take it (``None``: forward only).
        costs: the model's per-stage costs (times in any one unit, ``t_b`` the input-gradient
            backward; memory in bytes or units of ``mem_b``); ``None``: unit costs. What PyTorch's
            runtime spends differently is applied here (:func:`runtime_costs`).
        memory_limit: per-rank activation limit in the unit of ``costs.mem_b`` (``None``: the
            family's default).
        runtime_kwargs: passed to ``_PipelineScheduleRuntime`` (e.g. ``scale_grads``).

    Raises:
        TorchExportError: another PyTorch release, stages PyTorch's split backward cannot run
            (:func:`check_stage_modules`), stages that do not match the family's placement, or a
            schedule PyTorch's validation refuses.
    """
    check_torch_version()
    if not stages:
        raise TorchExportError("no PipelineStage given: pass this rank's stages")
    n, p = stages[0].num_stages, stages[0].group_size
    if schedule_name == AUTO:
        placement = placement_of([st.stage_index for st in stages], n, p, stages[0].group_rank)
    else:
        placement = get_spec(schedule_name).placement
    _agree_on_stage_modules(stages, schedule_name)
    num_chunks = len(stages) if placement is Placement.INTERLEAVED else 2
    base = runtime_costs(costs if costs is not None else CostModel(), n)
    sched, candidates = _build(schedule_name, placement, num_ranks=p, num_microbatches=num_microbatches, costs=base,
                               memory_limit=memory_limit, num_chunks=num_chunks)
    loss = _TimedLoss(loss_fn) if loss_fn is not None else None
    runtime = _ts._PipelineScheduleRuntime(list(stages), num_microbatches, loss_fn=loss, **runtime_kwargs)
    pipe = TorchPipeline(runtime, list(stages), schedule_name, sched, base, memory_limit, num_chunks, loss,
                         placement, candidates)
    pipe.load(sched)
    return pipe

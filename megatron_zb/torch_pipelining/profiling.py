"""Measure T_F, T_I (our B), T_W per stage inside PyTorch's pipeline runtime and re-plan from them.

Tested with PyTorch 2.13 (CPU, gloo). What is timed (:class:`StageTimer`, wall-clock
``time.perf_counter``; on CUDA with ``torch.cuda.synchronize`` before and after each call --
not run on a GPU): the public methods of PyTorch's ``PipelineStage`` that the runtime calls for
each compute action, wrapped on the stage *objects* (instance attributes, removed again when the
timer closes; PyTorch's classes and private code are not touched):

* ``forward_one_chunk`` -> ``F``, plus the loss the runtime computes right after it on the last
  stage (the loss function given to :func:`~.runtime.build_pipeline` is wrapped for that);
* ``backward_one_chunk(full_backward=False)`` -> ``B`` (PyTorch's ``I``; on stage 0 it computes
  nothing, see :mod:`.runtime`); with ``full_backward=True`` -> ``BW`` (PyTorch's ``B``);
* ``backward_weight_one_chunk`` -> ``W`` (on stage 0 the whole backward);
* ``perform_reduce_grad`` -> ``R``: the stage's ``REDUCE_GRAD`` after its last ``W`` (FSDP's
  gradient reduce-scatter for a ``fully_shard``-ed stage, :mod:`.fsdp`; else the gradient scaling alone).

The waits for a peer's activation or gradient are *outside* these calls (the runtime waits on its
receives before calling them), so a duration is the stage's own compute. Not measured: ``T_comm``
(the re-planned cost model keeps the ``t_comm`` of the pipeline's costs; with unit costs that is 0).
The runtime's own time between actions is measured as one **overhead per compute action**
(:func:`action_overhead_ms`): each timed ``pipe.step`` (the slowest rank's median per timed form, the
first step after loading a form left out when more were timed)
minus the simulator's prediction of that form from the measured costs, over the busiest rank's count
of actions, floored at 0; the re-planned costs carry it
(:meth:`~megatron_zb.schedules.costs.CostModel.with_action_overhead`), so a schedule of more actions
-- a split backward, the V's two chunks -- is predicted to pay for them. Memory: the stages' relative ``mem_b`` and ``mem_w /
mem_b`` are measured (one more iteration with the saved-activation tracker, :func:`saving`), in the
given costs' unit (their mean ``mem_b`` kept), the memory limit kept (:func:`measured_costs`).

:func:`profile_and_replan`: ``warmup`` untimed iterations, then ``iterations`` timed ones, each one
call of the user's ``train_step`` (which calls ``pipe.step(...)`` and whatever else an iteration
does). While timing, a family that splits the backward runs with every ``I`` and ``W`` as separate
actions (the export otherwise writes an ``I`` directly followed by its ``W`` as one ``B``; the order
is the same), so every stage has ``T_I`` and ``T_W``. An ``auto`` pipeline (:mod:`.choice`) is timed
``iterations`` times in each of two forms of its order, every backward split (``I`` then ``W``) and
every backward fused (PyTorch's ``B``), so every stage has ``T_I``, ``T_W`` and ``T_BW`` and the
choice can weigh what splitting costs (``t_bw`` of the cost model). Then every rank all-gathers the medians per
``(op, stage)`` over the stages' process group (so all ranks hold identical numbers), builds the
measured :class:`~megatron_zb.schedules.costs.CostModel` (:func:`measured_costs`, milliseconds;
with FSDP stages it holds their reduce as its data-parallel reduce, :func:`~.fsdp.fsdp_reduce_model`),
rebuilds the family's schedule (``auto``: chooses again) from it and reloads the runtime (every rank checks that all built
the same schedule). Stage 0's quirk and ``M_W = M_B`` (:mod:`.runtime`) need no correction here:
the measured ``T_I`` of stage 0 is the runtime's near-zero call, its ``T_W`` the whole backward,
and the measured bytes what the runtime holds.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from ..schedules.costs import CostModel
from ..schedules.fusion import as_run, fuse_all, split_all
from ..schedules.ir import Schedule
from ..schedules.simulator import simulate
from .choice import AUTO
from .export import TorchExportError, prepare_runtime
from .fsdp import fsdp_reduce_model, stage_grad_bytes
from .runtime import TorchPipeline

__all__ = ["MIN_COST_MS", "Replan", "StageTimer", "action_overhead_ms", "agree", "measured_costs", "profile_and_replan",
           "saving"]

MIN_COST_MS = 1e-6
"""Floor of a measured ``t_f``/``t_b`` [ms]: the cost model needs them ``> 0`` (stage 0's ``I`` is ~0)."""

_TIMED = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk", "perform_reduce_grad")


class StageTimer:
    """While open (``with StageTimer(pipe):``), the wall time of every compute call of this rank's
    stages, per ``(op, stage)`` in seconds (module doc)."""

    def __init__(self, pipe: TorchPipeline) -> None:
        self.pipe = pipe
        self.durations: dict[tuple[str, int], list[float]] = {}
        self.spans: list[tuple[tuple[str, int], float, float]] = []  # ((op, stage), start, end) perf_counter [s]
        self._last_forward: tuple[str, int] | None = None
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> "StageTimer":
        for st in self.pipe.stages:
            for name in _TIMED:
                self._saved.append((st, name, vars(st).get(name)))
                setattr(st, name, self._wrap(st, name, getattr(st, name)))
        if self.pipe.loss is not None:
            self.pipe.loss.timer = self
        return self

    def __exit__(self, *exc: Any) -> None:
        for st, name, before in reversed(self._saved):
            if before is None:
                delattr(st, name)
            else:
                setattr(st, name, before)
        self._saved = []
        if self.pipe.loss is not None:
            self.pipe.loss.timer = None

    def _wrap(self, stage: Any, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        cuda = stage.device.type == "cuda"

        def timed(*args: Any, **kwargs: Any) -> Any:
            if name == "forward_one_chunk":
                op = "F"
            elif name == "backward_weight_one_chunk":
                op = "W"
            elif name == "perform_reduce_grad":
                op = "R"
            else:
                full = kwargs.get("full_backward", args[2] if len(args) > 2 else True)
                op = "BW" if full else "B"
            if cuda:
                torch.cuda.synchronize(stage.device)
            t0 = time.perf_counter()
            out = method(*args, **kwargs)
            if cuda:
                torch.cuda.synchronize(stage.device)
            key, t1 = (op, stage.stage_index), time.perf_counter()
            self.durations.setdefault(key, []).append(t1 - t0)
            self.spans.append((key, t0, t1))
            self._last_forward = key if op == "F" else None
            return out
        return timed

    @contextlib.contextmanager
    def loss(self) -> Iterator[None]:
        """Add the time of the block (the loss) to the forward that ran just before it."""
        t0 = time.perf_counter()
        yield
        if self._last_forward is not None:
            t1 = time.perf_counter()
            self.durations[self._last_forward][-1] += t1 - t0
            key, start, _ = self.spans[-1]
            self.spans[-1] = (key, start, t1)

    def medians_ms(self) -> dict[tuple[str, int], float]:
        """Median duration per ``(op, stage)`` [ms] (robust to one call the OS descheduled)."""
        return {k: 1e3 * statistics.median(v) for k, v in self.durations.items()}


    def mean_bytes(self, tracker: Any) -> dict[tuple[str, int], float]:
        """Mean net change per ``(op, stage)`` call of the bytes ``tracker`` (an
        :class:`~megatron_zb.runtime.memory.ActivationMemoryTracker`) counted [bytes]."""
        sums: dict[tuple[str, int], list[float]] = {}
        for key, t0, t1 in self.spans:
            sums.setdefault(key, []).append(float(tracker.bytes_between(t0, t1)))
        return {k: statistics.fmean(v) for k, v in sums.items()}


@contextlib.contextmanager
def saving(tracker: Any) -> Iterator[None]:
    """Count every tensor autograd saves inside the block with ``tracker`` (an
    :class:`~megatron_zb.runtime.memory.ActivationMemoryTracker`), as its ``saving()`` does, but
    keep a *detached* alias (same storage, no ``grad_fn``): a pack hook that returns the tensor
    itself makes a node that saves its own output (softmax, ReLU, attention) reference itself
    through that output, and PyTorch's ``W`` -- which runs only the weight-side part of the graph --
    never releases the buffers of the other nodes, so with ``tracker.saving()`` those nodes and
    what they saved would stay alive after the step (measured: a last stage's saved bytes
    held after every ``W``). Each saved storage is counted while autograd holds an alias of it
    (``tracker.track_saved``), not while the storage lives: PyTorch's ``PipelineStage`` preallocates one
    receive buffer per microbatch and keeps all of them for the whole run (``args_recv_info``), and a
    stage's first operation saves its input, which is that buffer -- counted until the ``W`` (or ``B``)
    that releases it, as any activation, instead of to the end of the step. Gradients are unchanged
    (``tests/torch_pipelining/test_torch_runtime.py``)."""
    def pack(t: torch.Tensor) -> torch.Tensor:
        alias = t.detach()
        tracker.track_saved(alias)
        return alias

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def agree(mine: dict[tuple[str, int], float], group: Any) -> dict[tuple[str, int], float]:
    """Every pipeline rank's values per ``(op, stage)``, merged (an all-gather over ``group``):
    identical on all ranks."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    out: dict[tuple[str, int], float] = {}
    for g in gathered:
        out.update(g)
    return out


def _slowest(mine: dict[tuple[str, int], float], group: Any) -> dict[tuple[str, int], float]:
    """The largest value per key over the ranks of ``group`` (an all-gather): identical on all ranks."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    return {k: max(g[k] for g in gathered) for k in mine}


def _replica_mean(values: dict[tuple[str, int], float], group: Any) -> dict[tuple[str, int], float]:
    """``values`` averaged over the data-parallel replicas of ``group`` (``None``: unchanged);
    identical on every replica."""
    if group is None:
        return values
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, values, group=group)
    return {k: statistics.fmean(g[k] for g in gathered) for k in values}


def _per_stage(values: dict[tuple[str, int], float], op: str, num_stages: int) -> list[float] | None:
    vals = [values.get((op, s)) for s in range(num_stages)]
    return None if any(v is None for v in vals) else [float(v) for v in vals]  # type: ignore[arg-type]


def measured_costs(medians_ms: dict[tuple[str, int], float], base: CostModel, num_stages: int,
                   nbytes: dict[tuple[str, int], float] | None = None,
                   reduce_bytes: Sequence[float] | None = None) -> CostModel:
    """The cost model [ms] from measured medians per ``(op, stage)``: ``t_f`` from ``F``; ``t_b``,
    ``t_w`` from ``B`` (PyTorch's ``I``) and ``W`` when every stage has both, and then ``t_bw`` from
    ``BW`` (PyTorch's fused ``B``) when every stage has it too (``auto`` measures both), else
    ``None`` (``t_b + t_w``); without ``B`` and ``W``, ``t_b`` from ``BW`` and ``t_w = 0`` (a fused
    backward simulates exactly so); ``t_f``, ``t_b``, ``t_bw`` floored at :data:`MIN_COST_MS`. The memory
    limit and ``t_comm`` are ``base``'s (their units). With ``nbytes`` (mean net saved-activation bytes per
    ``(op, stage)`` call): ``mem_b`` per stage in proportion to the measured ``M_B`` (the bytes one ``F``
    leaves), scaled so that its mean is ``base``'s -- the stages' relative sizes measured (the loss
    stage's logits, an embedding stage), the unit kept, so a family's default limit (a fraction of
    1F1B's peak) follows them -- and, with a split backward,
    ``mem_w = mem_b x (M_B + dM_I) / M_B`` per stage, clipped to ``[0, mem_b]``: the share of a
    microbatch's activations PyTorch's ``I`` leaves held until ``W`` (``M_B``: the bytes one ``F``
    leaves; ``dM_I``: the net change over one ``I``); else ``base``'s ``mem_w``. With
    ``reduce_bytes`` (per stage, bytes its ``REDUCE_GRAD`` reduces: :func:`~.fsdp.stage_grad_bytes`)
    and measured ``R`` times, ``dp_reduce`` is :func:`~.fsdp.fsdp_reduce_model`; else ``base``'s.

    Raises:
        TorchExportError: a stage has no forward or no backward time.
    """
    t_f = _per_stage(medians_ms, "F", num_stages)
    t_b, t_w = _per_stage(medians_ms, "B", num_stages), _per_stage(medians_ms, "W", num_stages)
    split = t_b is not None and t_w is not None
    if not split:
        t_b, t_w = _per_stage(medians_ms, "BW", num_stages), [0.0] * num_stages
    if t_f is None or t_b is None:
        missing = sorted(s for s in range(num_stages) if ("F", s) not in medians_ms or not any(
            (op, s) in medians_ms for op in ("B", "BW")))
        raise TorchExportError(f"no forward or backward time was measured for stage(s) {missing}: run at least one "
                               f"training step (pipe.step with target and losses) inside the profiling window")
    res = base.resolve(num_stages)
    mem_b, mem_w = list(res.mem_b), list(res.mem_w)
    m_f = _per_stage(nbytes or {}, "F", num_stages)
    d_i = _per_stage(nbytes or {}, "B", num_stages)
    if m_f is not None and all(v > 0 for v in m_f):
        mean_b, mean_f = sum(mem_b) / num_stages, sum(m_f) / num_stages
        mem_b = [mean_b * f / mean_f for f in m_f]   # the measured relative sizes, in base's unit and mean
        mem_w = [min(w, b) for w, b in zip(mem_w, mem_b)]
        if split and d_i is not None:
            mem_w = [b * min(1.0, max(0.0, (f + d) / f)) for b, f, d in zip(mem_b, m_f, d_i)]
    t_bw = _per_stage(medians_ms, "BW", num_stages) if split else None   # both measured (auto)
    dp_reduce = base.dp_reduce
    if reduce_bytes is not None:
        dp_reduce = fsdp_reduce_model(reduce_bytes, [medians_ms.get(("R", s)) for s in range(num_stages)]) or dp_reduce
    return replace(base, t_f=[max(v, MIN_COST_MS) for v in t_f], t_b=[max(v, MIN_COST_MS) for v in t_b], t_w=t_w,
                   mem_b=mem_b, mem_w=mem_w, dp_reduce=dp_reduce,
                   t_bw=None if t_bw is None else [max(v, MIN_COST_MS) for v in t_bw])


def _timed_forms(pipe: TorchPipeline) -> list[tuple[Schedule, bool]]:
    """The orders timed, each ``(schedule, merge_iw)``: a split-backward family's schedule with every
    ``I`` and ``W`` its own action; a fused family's as it is; for ``auto`` both, the split form of
    the loaded order (:func:`~megatron_zb.schedules.fusion.split_all`) and its fused form
    (:func:`~megatron_zb.schedules.fusion.fuse_all`), so every stage gets ``T_I``, ``T_W`` and ``T_BW``.
    Every rank derives the same forms from the same schedule."""
    sched = pipe.schedule
    split = [(split_all(sched), False)]
    fused = [(fuse_all(sched), True)]
    if pipe.schedule_name == AUTO:
        return split + fused
    return split if pipe.spec.split_backward else fused


@dataclass
class Replan:
    """What :func:`profile_and_replan` measured and loaded.

    Attributes:
        medians_ms: median time per ``(op, stage)`` [ms], all stages (ops ``F``, ``B`` = PyTorch's
            ``I``, ``W``, ``BW`` = PyTorch's ``B``, ``R`` = the stage's ``REDUCE_GRAD``).
        bytes: mean net saved-activation bytes per ``(op, stage)`` call, all stages (empty when
            memory was not measured).
        costs: the measured cost model the new schedule was built from [ms].
        before, after: the schedule loaded before and after.
        iterations: timed iterations.
        samples: timed calls per ``(op, stage)`` of this rank.
        step_ms: per timed form, the slowest rank's median ``pipe.step`` [ms].
        action_overhead_ms: the runtime's time per compute action beyond the compute [ms]
            (:func:`action_overhead_ms`), included in :attr:`costs`.
    """

    medians_ms: dict[tuple[str, int], float]
    bytes: dict[tuple[str, int], float]
    costs: CostModel
    before: Schedule
    after: Schedule
    iterations: int
    samples: dict[tuple[str, int], int] = field(default_factory=dict)
    step_ms: list[float] = field(default_factory=list)
    action_overhead_ms: float = 0.0


def action_overhead_ms(forms: Sequence[tuple[Schedule, bool]], step_ms: Sequence[float], costs: CostModel) -> float:
    """The runtime's time per compute action beyond the compute [ms]: the mean over the timed
    ``forms`` (``(schedule, merge_iw)``, as loaded) of (measured iteration ``step_ms`` - the
    simulator's ``total_time`` of the form as run, from ``costs`` [ms]) / the busiest rank's number of
    compute actions in it (an ``I`` merged with its ``W`` is one), floored at 0."""
    per_form = []
    for (sched, merge_iw), step in zip(forms, step_ms):
        run = as_run(sched) if merge_iw else sched
        actions = max(len(acts) for acts in run.ranks)
        per_form.append((step - simulate(run, costs, enforce_memory=False).total_time) / actions)
    return max(0.0, statistics.fmean(per_form)) if per_form else 0.0


def _with_overhead(costs: CostModel, overhead: float, *, split: bool) -> CostModel:
    """``costs`` with every compute action ``overhead`` longer: a fused backward is one action, so with
    split costs measured its ``t_bw`` (``t_b + t_w`` when not measured) grows once, not twice."""
    if split and costs.t_bw is None:
        res = costs.resolve(len(costs.t_b) if isinstance(costs.t_b, list) else 1)
        costs = replace(costs, t_bw=[b + w for b, w in zip(res.t_b, res.t_w)])
    return costs.with_action_overhead(overhead, split_backward=split)


@contextlib.contextmanager
def _timing_steps(pipe: TorchPipeline, into: list[float]) -> Iterator[None]:
    """Append the wall time of every ``pipe.step`` call inside the block to ``into`` [s]."""
    step = pipe.step

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = step(*args, **kwargs)
        into.append(time.perf_counter() - t0)
        return out

    pipe.step = timed  # type: ignore[method-assign]
    try:
        yield
    finally:
        del pipe.step


def profile_and_replan(pipe: TorchPipeline, train_step: Callable[[], Any], *, iterations: int = 3,
                       warmup: int = 1, memory: bool = True, data_parallel_group: Any = None) -> Replan:
    """Time ``iterations`` calls of ``train_step`` (after ``warmup`` untimed ones; for an ``auto``
    pipeline ``iterations`` per form, split and fused) inside PyTorch's runtime, agree on the medians
    across the pipeline ranks, rebuild ``pipe``'s schedule (``auto``: choose again) from the
    measured costs and reload its runtime (module doc). ``memory``: one more call with the
    saved-activation tracker on (its hooks slow the calls, so its times are not used), for
    ``mem_w / mem_b`` (:func:`measured_costs`). Collective over the stages' group: every pipeline
    rank calls it with the same arguments.

    ``data_parallel_group``: the group of this rank's replicas (one rank of every other pipeline,
    holding the same stages); required when the stages are FSDP-sharded, since every replica must
    run the same schedule (the replicas' reduces of a stage meet in one collective, issued in the
    order of the stages' last ``W``'s). The measurements are then averaged over the replicas, so
    all of them build the same schedule.
    """
    from ..runtime.memory import ActivationMemoryTracker

    if iterations < 1 or warmup < 0:
        raise TorchExportError(f"iterations={iterations}, warmup={warmup}: time at least one iteration "
                               f"(iterations >= 1, warmup >= 0)")
    before = pipe.schedule
    reduce_bytes = stage_grad_bytes(pipe.stages, before.num_stages, pipe.group)  # 0 for a stage without FSDP
    if data_parallel_group is None and any(reduce_bytes):
        raise TorchExportError("the stages are FSDP-sharded (fully_shard), so every data-parallel replica must re-plan "
                               "the same schedule: pass data_parallel_group= (the group of this rank's replicas)")
    for _ in range(warmup):
        train_step()
    forms = _timed_forms(pipe)
    timer = StageTimer(pipe)
    step_s: list[list[float]] = [[] for _ in forms]
    mine_bytes: dict[tuple[str, int], float] = {}
    try:
        with timer:
            for (sched, merge_iw), steps in zip(forms, step_s):
                prepare_runtime(pipe.runtime, sched, merge_iw=merge_iw)
                with _timing_steps(pipe, steps):
                    for _ in range(iterations):
                        train_step()
        if memory:  # with the first form loaded (the split one, when timed)
            prepare_runtime(pipe.runtime, forms[0][0], merge_iw=forms[0][1])
            tracker = ActivationMemoryTracker([q for st in pipe.stages for q in st.submod.parameters()])
            with StageTimer(pipe) as spans, saving(tracker):
                train_step()
            mine_bytes = spans.mean_bytes(tracker)
    finally:
        prepare_runtime(pipe.runtime, before)
    medians = _replica_mean(agree(timer.medians_ms(), pipe.group), data_parallel_group)
    nbytes = _replica_mean(agree(mine_bytes, pipe.group), data_parallel_group)
    costs = measured_costs(medians, pipe.costs, before.num_stages, nbytes, reduce_bytes)
    # the first step after loading a form is not counted when there are more (PyTorch re-prepares its runtime)
    steps = _slowest(_replica_mean({("step", k): 1e3 * statistics.median(v[1:] or v) for k, v in enumerate(step_s)},
                                   data_parallel_group), pipe.group)
    step_ms = [steps[("step", k)] for k in range(len(forms))]
    overhead = action_overhead_ms(forms, step_ms, costs)
    costs = _with_overhead(costs, overhead, split=_per_stage(medians, "W", before.num_stages) is not None)
    after = pipe.rebuild(costs)
    samples = {k: len(v) for k, v in timer.durations.items()}
    return Replan(medians, nbytes, costs, before, after, iterations, samples, step_ms, overhead)

"""Executes one rank's part of any schedule on megatron-core model chunks.

The schedule is lowered (:func:`megatron_zb.schedules.lower`) and checked once per schedule
(:func:`~megatron_zb.runtime.rank_plan.plan_rank`); every iteration the rank then walks its
action list (:func:`execute`):

* ``F``  -- megatron-core's ``forward_step`` on the chunk holding the stage (first stage reads
  the data iterator, the last stage computes the loss);
* ``B``  -- megatron-core's ``backward_step`` inside :meth:`WeightGradStore.deferring` of the
  store passed in: input gradients now, the weight-gradient work of every routed layer queued
  (:mod:`megatron_zb.runtime.routes`, :func:`~megatron_zb.runtime.routes.backward_window`);
* ``W``  -- runs the queue of that (stage, microbatch); with weight-gradient groups
  (:attr:`RankPlan.w_groups`) a group's last ``W`` runs the whole group layer-major and its
  earlier members run nothing;
* ``BW`` -- megatron-core's ``backward_step`` as is (fused, as 1F1B does; layers that queue
  their weight gradients themselves, e.g. Transformer Engine's, run them right after);
* ``IF`` / ``S`` / ``T`` / ``IB`` -- the vocabulary-parallel passes, run by the iteration's
  :class:`~megatron_zb.runtime.vocab_runtime.VocabPasses` (``StageRuntime.vocab``), which also hooks
  the first stage's ``F``/``B`` (the word embedding, its gradient) and the last stage's (``X``, its
  gradient, the loss);
* ``RECV_*`` / ``SEND_*`` -- p2p via :class:`PipeComm`, one communicator per direction, matched
  by order as on NCCL. When receives are posted (ahead of use) and when a sent tensor is let go
  is decided once per schedule, as the rank's issue order (:attr:`RankPlan.program`,
  :mod:`~megatron_zb.runtime.comm_program`), which this module walks; transfers between two
  stages on the same rank (the tip of the V) are handed over in memory.

Using megatron-core's own ``forward_step``/``backward_step`` keeps loss scaling, per-token loss
normalisation and the loss bookkeeping identical to megatron-core's schedules.

:class:`RankPlan`, :func:`plan_rank` and :class:`RecvPoster` live in
:mod:`megatron_zb.runtime.rank_plan`; they are re-exported here (their former home).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterator, Sequence

import torch

from ..schedules import Action, Op
from ..schedules.lowering import pipeline_neighbours
from .action_timing import ActionTiming
from .grad_sync import GradSync
from .memory import ActivationMemoryTracker
from .p2p import PipeComm
from .comm_program import Issue, Step
from .rank_plan import RankPlan, RecvPoster, plan_rank
from .routes import backward_window
from .wgrad_store import WeightGradStore

__all__ = ["ActionTiming", "LoopOverhead", "IterationState", "RankPlan", "RecvPoster", "StageRuntime", "execute", "plan_rank"]

@dataclass
class LoopOverhead:
    """The runtime's own time in :func:`execute`, summed over the calls it was passed to.

    Every call is split into three parts: the compute actions (F, B, W, BW: from the call of the
    handler to its return -- megatron-core's step functions, the model, the weight-gradient
    closures), the p2p calls (posting and waiting for receives, ``isend`` calls, the final drain)
    and the rest, the *overhead*: the loop, the receive-posting policy, the tensor bookkeeping
    between stages, the timing records, the set-up and tear-down of the iteration. Measured with
    ``time.perf_counter`` (wall, seconds) and ``time.thread_time`` (CPU time of the executing
    thread, seconds -- not inflated when other processes take the core). Always on: four clock
    reads per action, about 2 microseconds.

    Attributes:
        calls: :func:`execute` calls added.
        compute_actions: compute actions run.
        wall, cpu: whole calls, seconds.
        compute_wall, compute_cpu: inside compute actions, seconds.
        comm_wall, comm_cpu: inside p2p calls, seconds.
    """

    calls: int = 0
    compute_actions: int = 0
    wall: float = 0.0
    cpu: float = 0.0
    compute_wall: float = 0.0
    compute_cpu: float = 0.0
    comm_wall: float = 0.0
    comm_cpu: float = 0.0

    def add(self, *, actions: int, wall: float, cpu: float, compute_wall: float, compute_cpu: float,
            comm_wall: float, comm_cpu: float) -> None:
        """Add one call's numbers (seconds)."""
        self.calls += 1
        self.compute_actions += actions
        self.wall += wall
        self.cpu += cpu
        self.compute_wall += compute_wall
        self.compute_cpu += compute_cpu
        self.comm_wall += comm_wall
        self.comm_cpu += comm_cpu

    def merge(self, other: "LoopOverhead") -> None:
        """Add every field of ``other`` (e.g. one call's numbers into a running total)."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def overhead_wall(self) -> float:
        """Seconds of wall time outside compute actions and p2p calls."""
        return self.wall - self.compute_wall - self.comm_wall

    @property
    def overhead_cpu(self) -> float:
        """Seconds of this thread's CPU time outside compute actions and p2p calls."""
        return self.cpu - self.compute_cpu - self.comm_cpu

    def per_action_us(self, *, cpu: bool = True) -> float:
        """Overhead per compute action in microseconds (CPU time by default, else wall); nan if none."""
        if not self.compute_actions:
            return float("nan")
        return 1e6 * (self.overhead_cpu if cpu else self.overhead_wall) / self.compute_actions


@dataclass
class StageRuntime:
    """What the executor needs to know about the rank's chunks and the tensors between stages.

    Attributes:
        chunks: stage index -> model chunk (the megatron-core module, possibly DDP-wrapped).
        data_iterators: stage index -> data iterator passed to ``forward_step_func``.
        tensor_shape: shape of the hidden states sent between stages
            (``[seq_len / tp if sequence parallel else seq_len, micro_batch_size, hidden]``).
        dtype: dtype of those hidden states (``config.pipeline_dtype``).
        device: device of those hidden states.
        vocab: the iteration's vocabulary-parallel passes
            (:class:`~megatron_zb.runtime.vocab_runtime.VocabPasses`) when the schedule has them.
    """

    chunks: dict[int, torch.nn.Module]
    data_iterators: dict[int, Iterator[Any] | None]
    tensor_shape: Sequence[int]
    dtype: torch.dtype
    device: torch.device
    vocab: Any = None


def execute(*, plan: RankPlan, runtime: StageRuntime, store: WeightGradStore, forward_step_func: Callable,
            config: Any, comm: PipeComm, collect_non_loss_data: bool = False, cp_group_size: int = 1,
            first_val_step: bool | None = None, timing: ActionTiming | None = None,
            memory: ActivationMemoryTracker | None = None, grad_sync: GradSync | None = None,
            overhead: LoopOverhead | None = None) -> tuple[list[Any], torch.Tensor]:
    """Run one iteration of ``plan`` (see :func:`plan_rank`); return (forward data store, total tokens).

    Walks ``plan.program`` (:mod:`~megatron_zb.runtime.comm_program`): the rank's compute actions,
    receive posts and waits, sends and send releases in the order they are issued.
    The forward data store holds what megatron-core's schedules return: the reduced losses of
    the last stage, in microbatch order. ``store`` receives the weight-gradient work of every B
    and runs it at the matching W (it must be empty; it is empty again on return).
    ``grad_sync`` (``--overlap-grad-reduce``) is told after every compute action, and reports
    parameters ready to megatron-core's DDP buckets (:mod:`megatron_zb.runtime.grad_sync`).
    ``overhead`` (filled in place) receives where this call's time went (:class:`LoopOverhead`).
    """
    watch = _Stopwatch(timing)    # first: the call's wall and CPU time include the set-up
    it = IterationState(plan=plan, runtime=runtime, store=store, forward_step_func=forward_step_func,
                    config=config, collect_non_loss_data=collect_non_loss_data, cp_group_size=cp_group_size,
                    first_val_step=first_val_step, memory=memory)
    grad_sync = _begin_iteration(plan, store, grad_sync)
    for issue in plan.program.issues:
        step, a = issue.step, issue.action
        if step is Step.RUN:
            mark, t0, u0 = watch.before_compute()
            it.compute(a)
            watch.after_compute(a, t0, u0, mark)
            if grad_sync is not None:
                grad_sync.after_compute(a, t0)
        elif issue.coll:   # a vocabulary collective: issued, or waited for
            t0, u0 = watch.now()
            runtime.vocab.collective(issue)
            watch.after_collective(issue, t0, u0)
        else:
            t0, u0 = watch.now()
            _communicate(issue, it, comm, runtime)
            watch.after_comm(a if step is Step.WAIT or step is Step.SEND else None, t0, u0)
    t0, u0 = watch.now()
    comm.finish()
    if runtime.vocab is not None:
        it.vocab_finished(*runtime.vocab.finish())
    watch.after_comm(None, t0, u0)
    if not plan.forward_only:
        store.assert_empty()
    result = it.result()
    watch.report(overhead if overhead is not None else LoopOverhead())
    return result


def _begin_iteration(plan: RankPlan, store: WeightGradStore, grad_sync: GradSync | None) -> GradSync | None:
    """Tell the store (and data-parallel overlap) how many W's each stage runs; the ``grad_sync``
    to tell after every compute action (``None`` when forward-only: no gradients)."""
    if plan.forward_only:
        return None
    store.begin_iteration(plan.w_per_stage)
    if grad_sync is not None:
        grad_sync.begin(actions=plan.actions, store=store)
    return grad_sync


def _communicate(issue: Issue, it: "IterationState", comm: PipeComm, runtime: StageRuntime) -> None:
    """One p2p step of the rank's program: post or wait for a receive, send, or release a send."""
    step, a = issue.step, issue.action
    if step is Step.POST:
        comm.post_recv(a, runtime.tensor_shape, runtime.dtype, runtime.device, slot=issue.slot)
    elif step is Step.WAIT:
        it.received(a, comm.wait_recv(a))
    elif step is Step.SEND:
        comm.send(a, it.to_send(a, (a.mb, a.stage)), slot=issue.slot)
        it.sent(a)
    else:
        comm.release(a)


class _Stopwatch:
    """Where one :func:`execute` call's time goes (:class:`LoopOverhead`) and, with an
    :class:`ActionTiming`, each action's record.

    Per step this costs a few comparisons, four clock reads and no allocation (the runtime's
    overhead budget is tens of microseconds per compute action, see :class:`LoopOverhead`).
    """

    def __init__(self, timing: ActionTiming | None) -> None:
        self.now = _now
        self.timing = timing
        self.wall0, self.cpu0 = _now()
        if timing is not None:
            timing.start = self.wall0
        self.comm_wall = self.comm_cpu = self.compute_wall = self.compute_cpu = 0.0
        self.n_compute = 0

    def before_compute(self) -> tuple[Any, float, float]:
        """``(timing mark, wall, cpu)`` just before a compute action."""
        mark = self.timing.mark() if self.timing is not None else None
        t0, u0 = _now()
        return mark, t0, u0

    def after_compute(self, a: Action, t0: float, u0: float, mark: Any) -> None:
        """Count the compute action ``a`` that started at ``(t0, u0)`` and record it."""
        t1, u1 = _now()
        self.compute_wall += t1 - t0
        self.compute_cpu += u1 - u0
        self.n_compute += 1
        if self.timing is not None:
            self.timing.add_compute(a, t0, t1, u1 - u0, mark)

    def after_comm(self, recorded: Action | None, t0: float, u0: float) -> None:
        """Count a p2p call that started at ``(t0, u0)``; record ``recorded`` (a wait or a send) if given."""
        t1, u1 = _now()
        self.comm_wall += t1 - t0
        self.comm_cpu += u1 - u0
        if self.timing is not None and recorded is not None:
            self.timing.add_comm(recorded, t0, t1)

    def after_collective(self, issue: Issue, t0: float, u0: float) -> None:
        """Count a vocabulary collective's step (``COLL`` / ``WAIT``) that started at ``(t0, u0)`` as
        communication, and record it."""
        t1, u1 = _now()
        self.comm_wall += t1 - t0
        self.comm_cpu += u1 - u0
        if self.timing is not None:
            self.timing.add_collective(issue, t0, t1)

    def report(self, overhead: LoopOverhead) -> None:
        """Add this call's numbers to ``overhead``."""
        wall, cpu = _now()
        overhead.add(actions=self.n_compute, wall=wall - self.wall0, cpu=cpu - self.cpu0,
                     compute_wall=self.compute_wall, compute_cpu=self.compute_cpu, comm_wall=self.comm_wall,
                     comm_cpu=self.comm_cpu)


def _now(clock: Callable[[], float] = time.perf_counter, cpu: Callable[[], float] = time.thread_time
         ) -> tuple[float, float]:
    """``(wall seconds, this thread's CPU seconds)``."""
    return clock(), cpu()


class IterationState:
    """One iteration's tensors between the actions of one rank, and the compute handlers.

    Keyed by ``(mb, stage)``:

    * ``stage_inputs`` -- the input of a stage: received (``RECV_F``) or handed over by the
      previous stage on this rank (the tip of the V); ``None`` for stage 0 (reads data);
    * ``outputs`` -- a stage's output (the loss on the last stage), until its B/BW (or its
      ``SEND_F`` when forward-only);
    * ``output_grads`` -- the gradient of a stage's output: received (``RECV_B``) or handed
      over by the next stage on this rank;
    * ``input_grads`` -- the gradient of a stage's input, waiting for its ``SEND_B``.
    """

    def __init__(self, *, plan: RankPlan, runtime: StageRuntime, store: WeightGradStore,
                 forward_step_func: Callable, config: Any, collect_non_loss_data: bool, cp_group_size: int,
                 first_val_step: bool | None, memory: ActivationMemoryTracker | None) -> None:
        from ..megatron_compat import pipeline_step_functions

        steps = pipeline_step_functions()
        self._forward_step, self._backward_step = steps.forward_step, steps.backward_step
        self._check_first_val_step = steps.check_first_val_step
        self._deallocate = steps.deallocate_output_tensor
        # megatron-core's deallocate_pipeline_outputs (Megatron-LM always sets it): a stage output
        # is pseudo-freed once sent or handed over, and B calls custom_backward, which requires it
        self.pseudo_free = bool(getattr(config, "deallocate_pipeline_outputs", False)) and not plan.forward_only
        self.runtime, self.store, self.config, self.memory = runtime, store, config, memory
        self.forward_step_func, self.collect_non_loss_data = forward_step_func, collect_non_loss_data
        self.cp_group_size, self.first_val_step = cp_group_size, first_val_step
        self.forward_only = plan.forward_only
        self.w_groups = plan.w_groups
        self.rank, self.stage_to_rank = plan.rank, plan.schedule.stage_to_rank
        self.m, self.last = plan.schedule.num_microbatches, plan.schedule.num_stages - 1
        self.feeders = {s: _InOrderFeeder(it) for s, it in runtime.data_iterators.items()
                        if it is not None and s in plan.out_of_order_stages}
        self.stage_inputs: dict[tuple[int, int], torch.Tensor | None] = {}
        self.outputs: dict[tuple[int, int], Any] = {}
        self.output_grads: dict[tuple[int, int], torch.Tensor] = {}
        self.input_grads: dict[tuple[int, int], torch.Tensor] = {}
        self.stage_data: dict[tuple[int, int], list[Any]] = {}  # per-(mb, stage) forward data
        self.total_tokens = torch.zeros([], dtype=torch.int, device=runtime.device)  # megatron-core: on the GPU

    # ------------------------------------------------------------------ communication
    def received(self, a: Action, t: torch.Tensor) -> None:
        """Keep the tensor of a ``RECV_F`` / ``RECV_B`` (``a.stage`` is the producing stage)."""
        _, dst = pipeline_neighbours(a.op.direction, a.stage, self.last + 1)   # the stage it feeds
        if a.op is Op.RECV_F:
            self.stage_inputs[(a.mb, dst)] = t.requires_grad_(not self.forward_only)
        else:
            self.output_grads[(a.mb, dst)] = t

    def sent(self, a: Action) -> None:
        """After a ``SEND_F`` was issued: pseudo-free the stage output (the send holds its own view
        of the storage until it is released, :mod:`~megatron_zb.runtime.p2p`)."""
        if self.pseudo_free and a.op is Op.SEND_F:
            self._deallocate(_first(self.outputs[(a.mb, a.stage)]), True)

    def to_send(self, a: Action, key: tuple[int, int]) -> torch.Tensor:
        """The tensor a ``SEND_F`` / ``SEND_B`` sends (dropped here once nothing else needs it)."""
        if a.op is Op.SEND_F:
            if self.forward_only:
                return _first(self.outputs.pop(key))
            return _first(self.outputs[key])
        return self.input_grads.pop(key)

    # ------------------------------------------------------------------ compute
    def compute(self, a: Action) -> None:
        """Run the compute action ``a`` (``F``, ``B``, ``W`` or ``BW``)."""
        op = a.op
        if op.is_vocab:
            self.runtime.vocab.run(a)
        elif op is Op.F:
            self.forward(a, (a.mb, a.stage))
        elif op is Op.W:
            group = self.w_groups.get((a.stage, a.mb))
            if group is None:
                self.store.run(a.stage, a.mb)
            elif group:  # the group's last W: the whole group, layer-major (an earlier member: nothing)
                self.store.run_group(a.stage, group)
        else:  # B (weight gradients queued in the store) or BW (megatron-core's fused backward)
            self.backward(a, (a.mb, a.stage), deferred=op is Op.B)

    def forward(self, a: Action, key: tuple[int, int]) -> None:
        """``F``: megatron-core's ``forward_step`` (data on stage 0, loss on the last stage)."""
        stage, fo, vocab = a.stage, self.forward_only, self.runtime.vocab
        step_func = self.forward_step_func
        vocab_ctx: Any = contextlib.nullcontext()
        if vocab is not None:  # the loss is the vocabulary passes' (runtime/vocab_runtime.py)
            if stage == self.last:
                step_func = vocab.wrap_forward_step_func(a.mb, step_func)
            if stage == 0:
                vocab_ctx = vocab.first_forward(a.mb)
        if stage == 0:
            inp = None
        else:  # received, or handed over by the previous stage on this rank
            inp = self.stage_inputs.pop(key) if fo else self.stage_inputs[key]
        data: list[Any] = []
        ctx = self.memory.saving() if self.memory is not None else contextlib.nullcontext()
        with ctx, vocab_ctx:
            out, n_tok = self._forward_step(
                step_func,
                self.feeders[stage].for_microbatch(a.mb) if stage in self.feeders
                else self.runtime.data_iterators.get(stage),
                self.runtime.chunks[stage], self.m, inp, data, self.config,
                self.cp_group_size, collect_non_loss_data=self.collect_non_loss_data,
                is_first_microbatch=self._check_first_val_step(self.first_val_step, fo, a.mb == 0),
                current_microbatch=a.mb, is_last_stage=(stage == self.last and vocab is None))
        self.total_tokens += n_tok
        if vocab is not None and stage == self.last:
            vocab.after_last_forward(a.mb, _first(out))
        if data:
            self.stage_data[key] = data
        _, dst = pipeline_neighbours(Op.F, stage, self.last + 1)
        handed_over = dst is not None and self.stage_to_rank[dst] == self.rank
        if handed_over:  # next stage lives on this rank (tip of the V): its input, detached
            self.stage_inputs[(a.mb, dst)] = _first(out).detach().requires_grad_(not fo)
        if not fo or (dst is not None and not handed_over):  # for B/BW, or for the SEND_F
            self.outputs[key] = out
        if self.pseudo_free and (stage == self.last or handed_over):  # nothing to send: free it now
            self._deallocate(_first(out), True)

    def backward(self, a: Action, key: tuple[int, int], *, deferred: bool) -> None:
        """``B`` (``deferred``: weight gradients queued in the store for W) or ``BW``."""
        stage = a.stage
        inp = self.stage_inputs.pop(key, None)
        out = self.outputs.pop(key)
        vocab = self.runtime.vocab
        if stage != self.last:
            out_grad = self.output_grads.pop(key)
        else:  # the loss's own gradient, or with vocabulary parallelism the gradient of the final norm's output
            out_grad = None if vocab is None else vocab.last_output_grad(a.mb)
        # tracked as in F: what a recomputed block saves in B (W closures may keep part of it)
        ctx = self.memory.saving() if self.memory is not None else contextlib.nullcontext()
        with ctx, backward_window(store=self.store, deferred=deferred, chunk=self.runtime.chunks[stage],
                                  stage=stage, microbatch=a.mb):
            in_grad = self._backward_step(inp, out, out_grad, self.config)
        del out, out_grad
        if vocab is not None and stage == 0:
            vocab.after_first_backward(a.mb)
        _, dst = pipeline_neighbours(a.op, stage, self.last + 1)
        if dst is not None:
            if self.stage_to_rank[dst] == self.rank:  # previous stage on this rank
                self.output_grads[(a.mb, dst)] = in_grad
            else:
                self.input_grads[key] = in_grad  # picked up by the SEND_B that follows

    def vocab_finished(self, data: dict[int, list[Any]], tokens: torch.Tensor) -> None:
        """The last rank's loss data per microbatch and token count, from the vocabulary passes."""
        for mb, d in data.items():
            self.stage_data[(mb, self.last)] = d
        self.total_tokens += tokens.to(self.total_tokens.device)

    def result(self) -> tuple[list[Any], torch.Tensor]:
        """(forward data of the last stage in microbatch order, total tokens)."""
        forward_data = [d for mb in range(self.m) for d in self.stage_data.get((mb, self.last), [])]
        return forward_data, self.total_tokens


def _first(x: Any) -> torch.Tensor:
    return x[0] if isinstance(x, (list, tuple)) else x


class _InOrderFeeder:
    """Serves micro batch ``i`` of a data iterator to a forward that runs out of order.

    megatron-core's data iterators are read in microbatch order, one item per forward. When a
    schedule runs a stage's forwards out of microbatch order, this reads the iterator in order,
    keeps the items not yet used, and hands each forward a one-item iterator with its own micro
    batch. Stages whose forwards are in order use the iterator directly (no buffering).
    """

    def __init__(self, it: Iterator[Any]) -> None:
        self._it = it
        self._read = 0
        self._held: dict[int, Any] = {}

    def for_microbatch(self, mb: int) -> Iterator[Any]:
        while self._read <= mb:
            self._held[self._read] = next(self._it)
            self._read += 1
        return iter([self._held.pop(mb)])

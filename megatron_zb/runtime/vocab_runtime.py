"""The runtime's vocabulary-parallel passes: ``IF``, ``S``, ``T``, ``IB`` of a schedule on the slices of
:class:`~megatron_zb.model.vocab_parallel.VocabParallelSlices`, with their collectives over the
model-parallel group, tensor x pipeline ranks (docs/vocab_parallel.md, "What runs").

Per microbatch ``i`` (``first`` / ``last``: the ranks of the first and last stage, each of their tensor-parallel
ranks; ``X``, the loss gradient and the embedding's gradient are replicated over those (bitwise:
megatron-core's tensor-parallel all-reduces give every tensor rank the same sum; with sequence parallelism
the stripped chunks' stand-ins gather ``X``'s rows and the embedding gradient's, :mod:`~megatron_zb.model.vocab_chunks`) and
broadcast from the stage's tensor rank 0; the stage's other tensor ranks take part in the broadcast with a
scratch buffer and use their own copy, as megatron-core's tensor-parallel layers do, so they never wait for
it: over more than two ranks one receiver's copy can depend on the other receivers having posted theirs,
and a wait there would tie the stage's tensor ranks -- which meet in every tensor-parallel all-reduce -- to
other stages' progress the schedule does not expect (a deadlock otherwise); every collective is
issued asynchronously where it is produced and waited for where the schedule's timing kernel says its
consumer waits, so a rank never waits for anything the schedule does not make it wait for):

* ``IF(i)`` (every rank): masked lookup of the slice's tokens, all-reduce SUM posted; ``first``'s
  ``F(i)`` waits for it and takes it as the word embedding (:mod:`~megatron_zb.model.vocab_chunks`).
* ``last``'s ``F(i)``: the chunk stops after the final norm; its output ``X`` is broadcast (posted).
* ``S(i)`` (every rank): waits for ``X``, computes the slice's logits and statistics, then hands the
  forward barrier to the rank's *barrier thread* (the analogue of the paper's communication stream):
  ``C0`` (:func:`~megatron_zb.model.vocab_parallel.output_c0`), then on ``last`` megatron-core's loss
  bookkeeping (``forward_step_calc_loss`` with the ``loss_func`` that ``forward_step_func`` returned
  in ``F(i)``, the loss scale) and the gradient of the loss with respect to the per-token losses,
  broadcast to every rank. The thread runs the barriers in microbatch order, on its own process
  group, so nothing of it waits for the rank's other work.
* ``T(i)`` (every rank): waits for the barrier, computes the slice's logits gradient, input-gradient
  part and weight gradient (run at once, or -- with ``VocabParallelModel.defer_t_weight``, when the rank
  runs a ``W`` of microbatch ``i`` later -- queued in the weight-gradient store for that ``W``); with two barriers (``vocab_barriers == 2``,
  megatron-core's exact arithmetic) the parts are all-reduced (``C1``, posted).
* ``last``'s ``B(i)``: the gradient of ``X`` is ``C1``'s sum (two barriers) or, with one barrier (the
  paper's rescaled arithmetic, the input gradient formed in ``S`` and reduced in ``C0``), computed by
  the barrier thread; megatron-core's ``backward_step`` then runs the chunk as a middle stage.
* ``first``'s ``B(i)``: the embedding's gradient is broadcast (posted); ``IB(i)`` (every rank) waits
  for it and adds the slice's weight gradient.

A forward-only call (evaluation) runs ``IF``, the forwards and ``S``; the barrier thread computes the
loss, nothing is broadcast back and no ``T``/``IB`` runs.

Each kind of collective has its own process group (:func:`vocab_channels`), so kinds issued in other
orders on different ranks never meet; within a kind every rank issues them in microbatch order
(checked: :func:`check_vocab_schedule`).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from ..schedules import Action, Op, Schedule
from ..schedules.ir import interleaved_placement, plain_placement, v_placement
from .vocab_timing import VocabTiming
from .wgrad_store import WeightGradStore

__all__ = ["VocabParallelModel", "VocabPasses", "check_vocab_schedule", "t_weight_stages", "vocab_channels"]

KINDS = ("if", "x", "c0", "c1", "ib")
"""The collectives' process groups: IF's all-reduce, X's broadcast, the forward barrier (and the loss
gradient's broadcast), the backward barrier, the embedding gradient's broadcast."""

_CHANNELS: dict[tuple[Any, tuple[int, ...]], dict[str, Any]] = {}


@dataclass
class VocabParallelModel:
    """What the runtime needs to run a vocabulary-parallel schedule on this rank.

    Attributes:
        slices: this rank's :class:`~megatron_zb.model.vocab_parallel.VocabParallelSlices` over the
            pipeline group (tied: one slice serves both layers); the chunks (built untied) must have been
            passed through
            :func:`~megatron_zb.model.vocab_chunks.strip_vocab_layers`.
        data_iterator: on every rank, the micro batches (dicts with ``tokens`` and ``labels``, ``[b, s]``)
            in order: the same ones ``forward_step_func`` reads on the first and last stage (IF looks up
            the tokens, S needs the targets). Each training call reads ``num_microbatches`` of them; set
            or replace it between calls (megatron-core's ``forward_backward_func`` keywords stay as they are).
    """

    slices: torch.nn.Module
    data_iterator: Any = None
    ddp: Any = None
    """With data parallelism: ``slices`` wrapped in megatron-core ``DistributedDataParallel`` with
    ``overlap_grad_reduce=False`` (the weight gradients go straight into ``main_grad``; no autograd hook
    fires); the runtime runs its ``finish_grad_sync`` after the schedule."""
    defer_t_weight: bool = False
    """``True``: ``T``'s weight gradient is queued for the rank's first ``W`` of the microbatch after ``T``
    (:func:`t_weight_stages`); ``False`` (default): ``T`` runs it at once, as the schedule's cost model
    has it (:class:`~megatron_zb.schedules.costs.VocabCosts` ``t_t`` includes it). Deferred, a ``W``
    meant to fill a bubble carries the output layer's weight gradient -- on the benchmark's model about
    as long as ``T`` itself -- and ``zbv-vocab-1`` ran 1.3x slower (docs/vocab_parallel.md, "Benchmark")."""


def vocab_channels(group: Any, *, timeout: float) -> dict[str, Any]:
    """One process group per kind of collective (:data:`KINDS`) over ``group``'s ranks (the model-parallel
    group: tensor x pipeline ranks; the pipeline group's at TP = 1), built on the first call (collective
    over the default group: every rank creates every replica's groups, in the same order, as
    :func:`~megatron_zb.runtime.p2p.pipe_channels`), then cached. ``timeout``: seconds, the groups' own
    timeout."""
    ranks = tuple(dist.get_process_group_ranks(group))
    key = (dist.group.WORLD, ranks)
    if key not in _CHANNELS:
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, ranks)
        td = datetime.timedelta(seconds=timeout)
        for group_ranks in sorted(set(everyone)):
            groups = {k: dist.new_group(list(group_ranks), timeout=td, backend=dist.get_backend(group),
                                        group_desc=f"vocab_parallel_{k}") for k in KINDS}
            if group_ranks == ranks:
                _CHANNELS[key] = groups
    return _CHANNELS[key]


def check_vocab_schedule(schedule: Schedule) -> None:
    """Refuse (``ValueError``) a vocabulary-parallel schedule the runtime cannot run: a placement other than
    plain, V or interleaved (Megatron's ``v`` chunks per rank), or a first stage whose ``B``/``BW`` or a last
    stage whose ``F`` leave microbatch order (their broadcasts are matched by order)."""
    p, n = schedule.num_ranks, schedule.num_stages
    known = [plain_placement(p), v_placement(p)] + ([interleaved_placement(p, n // p)] if n % p == 0 else [])
    if list(schedule.stage_to_rank) not in known:
        raise ValueError(f"schedule {schedule.name!r}: the runtime runs vocabulary passes on the plain, the V and the "
                         f"interleaved placement only, not on stage_to_rank {list(schedule.stage_to_rank)}")
    last = n - 1
    for stage, ops in ((0, (Op.B, Op.BW)), (last, (Op.F,))):
        mbs = [a.mb for a in schedule.ranks[schedule.stage_to_rank[stage]] if a.op in ops and a.stage == stage]
        if mbs != sorted(mbs):
            raise ValueError(f"schedule {schedule.name!r}: stage {stage}'s {ops[0].value}'s leave microbatch order; "
                             f"the vocabulary broadcasts need them in order")


def t_weight_stages(rank_actions: tuple[Action, ...] | list[Action]) -> dict[int, int]:
    """Microbatch -> the stage whose ``W`` of that microbatch runs ``T``'s weight gradient: the rank's first
    ``W`` of the microbatch after its ``T`` (on the V a rank has two; microbatches without one are absent:
    ``T`` runs its weight gradient at once)."""
    out: dict[int, int] = {}
    seen_t: set[int] = set()
    for a in rank_actions:
        if a.op is Op.T:
            seen_t.add(a.mb)
        elif a.op is Op.W and a.mb in seen_t and a.mb not in out:
            out[a.mb] = a.stage
    return out


class _BarrierThread:
    """The rank's barrier thread: runs submitted functions one after another (daemon: a collective
    stuck on a dead peer does not keep the process alive; the groups' timeout ends it)."""

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[Callable[[], Any], Future] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="megatron-zb-vocab-barrier", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        self._queue.put((fn, fut))
        return fut

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, fut = item
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to the waiting main thread
                fut.set_exception(e)

    def close(self) -> None:
        self._queue.put(None)


@dataclass
class _Barrier:
    """What ``T(i)`` and the last stage's ``B(i)`` take from the barrier thread."""

    grad_loss: torch.Tensor      # [s, b]: d(final loss, scaled) / d(per-token loss)
    x_grad: torch.Tensor | None  # one barrier, last rank: the gradient of X (else None)
    loss_data: list[Any]         # last rank: what forward_step_calc_loss appended (forward data store)
    num_tokens: torch.Tensor | None


class VocabPasses:
    """One rank's vocabulary-parallel state for one iteration (module docstring); the executor calls
    :meth:`run` for ``IF``/``S``/``T``/``IB`` and the hooks around the first and last stage's ``F``/``B``."""

    def __init__(self, *, model: VocabParallelModel, channels: dict[str, Any], schedule: Schedule, rank: int,
                 inputs: list[dict[str, torch.Tensor]], config: Any, chunks: dict[int, torch.nn.Module],
                 dtype: torch.dtype, store: WeightGradStore, rank_actions: tuple[Action, ...],
                 collect_non_loss_data: bool, cp_group_size: int, forward_only: bool = False,
                 tp_size: int = 1, tp_rank: int = 0) -> None:
        from ..megatron_compat import forward_step_calc_loss

        self.slices, self.g, self.ddp = model.slices, channels, model.ddp
        self.p, self.rank, self.m = schedule.num_ranks, rank, schedule.num_microbatches
        self.last_stage = schedule.num_stages - 1
        self.is_first, self.is_last = rank == schedule.stage_to_rank[0], rank == schedule.stage_to_rank[-1]
        # the broadcasts' sources: the stage's tensor rank 0, group rank pp_rank x TP + tp_rank (the slices' numbering)
        self.src_first = schedule.stage_to_rank[0] * tp_size  # first stage (pipeline rank 0 on plain and V)
        self.src_last = schedule.stage_to_rank[-1] * tp_size  # last stage (pipeline rank p - 1 plain, 0 on the V)
        self.sends_first, self.sends_last = self.is_first and tp_rank == 0, self.is_last and tp_rank == 0
        self.exact = schedule.vocab_barriers == 2   # two barriers: megatron-core's arithmetic, C1 after T
        if len(inputs) != self.m:
            raise ValueError(f"vocabulary-parallel inputs: {len(inputs)} micro batches for {self.m} microbatches")
        self.inputs, self.config, self.chunks = inputs, config, chunks
        self.dtype, self.store = dtype, store
        self.collect_non_loss_data, self.cp_group_size = collect_non_loss_data, cp_group_size
        self.forward_only = forward_only  # evaluation: IF, F, S and the loss; no T, no IB
        self._calc_loss = forward_step_calc_loss()
        self._loss_config = copy.copy(config)
        self._loss_config.timers = None   # megatron-core's timers are the main thread's
        # mb -> the stage of the W that runs T's weight gradient (none: T runs it)
        self._t_to_w = t_weight_stages(rank_actions) if model.defer_t_weight else {}
        self._thread = _BarrierThread()
        self.timing = VocabTiming()  # waits inside actions, T's queued weight gradients, the barriers (host seconds)
        self._last_b = next((a.op.value for a in rank_actions if a.stage == self.last_stage and a.op in (Op.B, Op.BW)),
                            "B")  # the last stage's backward action (its wait for the output layer's gradient)
        self._pending: list[Any] = []   # posted works nobody waits for on this rank (drained at the end)
        self._if: dict[int, tuple[Any, Any, Any]] = {}  # mb -> (IF's work, partial sum, lookup state)
        self._emb_leaf: dict[int, torch.Tensor] = {}
        self._ib: dict[int, tuple[Any, torch.Tensor]] = {}
        self._x: dict[int, torch.Tensor] = {}
        self._out_dtype = dtype  # the last stage's chunk output's dtype (fp32 behind Float16Module)
        self._state: dict[int, Any] = {}
        self._barrier: dict[int, Future] = {}
        self._c1: dict[int, tuple[Any, torch.Tensor]] = {}
        self._loss_funcs: dict[int, Callable] = {}
        self.results: dict[int, _Barrier] = {}

    # ------------------------------------------------------------------ the passes
    def run(self, a: Action) -> None:
        """Run the vocabulary pass ``a`` (``IF``, ``S``, ``T`` or ``IB`` of microbatch ``a.mb``)."""
        self._reap()
        {Op.IF: self._run_if, Op.S: self._run_s, Op.T: self._run_t, Op.IB: self._run_ib}[a.op](a.mb)

    def _run_if(self, mb: int) -> None:
        from ..model.vocab_parallel import embedding_if

        tokens = self.inputs[mb]["tokens"]
        partial, state = embedding_if(tokens, self.slices.word_embeddings, self.slices.vocab)
        work = dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=self.g["if"], async_op=True)
        if self.is_first:
            self._if[mb] = (work, partial, state)
        else:  # the sum is the first stage's: keep only what IB needs
            self._if[mb] = (None, None, state)
            self._pending.append(work)

    def _run_s(self, mb: int) -> None:
        from ..model.vocab_parallel import output_s

        target = self.inputs[mb]["labels"].transpose(0, 1).contiguous()
        if self.is_last:
            x = self._x.pop(mb)
        else:  # X whole, [s, b, h] (with sequence parallelism too: the stand-in output layer gathers it)
            weight = self.slices.output_layer_weight
            x = torch.empty(*target.shape, weight.shape[1], dtype=self.dtype, device=weight.device)
            work = dist.broadcast(x, src=self._global(self.src_last), group=self.g["x"], async_op=True)
            self.timing.wait(("S", self.rank, mb), work.wait)
        state = output_s(x, self.slices.output_layer_weight, target, self.slices.vocab, exact=self.exact,
                         fuse_input_grad=not self.exact)
        self._state[mb] = state
        self._barrier[mb] = self._thread.submit(self.timing.timed_barrier(mb, lambda: self._forward_barrier(mb, state)))

    def _forward_barrier(self, mb: int, state: Any) -> _Barrier:
        """The barrier thread's work for microbatch ``mb``: C0, the loss (last rank), its gradient's broadcast."""
        from ..model.vocab_parallel import output_c0

        loss = output_c0(state, self.g["c0"])
        grad_loss = torch.empty_like(loss)
        data: list[Any] = []
        num_tokens = None
        if self.forward_only:
            if self.is_last:
                with torch.no_grad():
                    _, num_tokens = self._calc_loss(
                        self.chunks[self.last_stage], loss.transpose(0, 1).contiguous(), self._loss_funcs.pop(mb),
                        self._loss_config, None, self.collect_non_loss_data, self.m, data, self.cp_group_size, True)
            return _Barrier(grad_loss=grad_loss, x_grad=None, loss_data=data, num_tokens=num_tokens)
        if self.is_last:
            per_token = loss.transpose(0, 1).contiguous().requires_grad_()  # [b, s], as megatron-core's model returns
            with torch.enable_grad():
                out, num_tokens = self._calc_loss(
                    self.chunks[self.last_stage], per_token, self._loss_funcs.pop(mb), self._loss_config, None,
                    self.collect_non_loss_data, self.m, data, self.cp_group_size, True)
                if self.config.grad_scale_func is not None:   # backward_step's scaling of the last stage
                    out = self.config.grad_scale_func(out)
                (g,) = torch.autograd.grad(out, per_token)
            grad_loss.copy_(g.transpose(0, 1))
        recv = grad_loss if not self.is_last or self.sends_last else torch.empty_like(grad_loss)  # own copy kept
        dist.broadcast(recv, src=self._global(self.src_last), group=self.g["c0"])
        x_grad = None
        if self.is_last and not self.exact:  # one barrier: the input gradient was reduced in C0
            x_grad = (state.input_grad * grad_loss.unsqueeze(-1)).to(self.dtype)
        return _Barrier(grad_loss=grad_loss, x_grad=x_grad, loss_data=data, num_tokens=num_tokens)

    def _run_t(self, mb: int) -> None:
        from ..model.vocab_parallel import output_t

        barrier = self.timing.wait(("T", self.rank, mb), self._barrier[mb].result)
        self.results[mb] = barrier
        grads = output_t(self._state.pop(mb), barrier.grad_loss)
        if self.exact:  # C1: the input gradient's parts, summed for the last stage's B
            work = dist.all_reduce(grads.input_grad, op=dist.ReduceOp.SUM, group=self.g["c1"], async_op=True)
            if self.is_last:
                self._c1[mb] = (work, grads.input_grad)
            else:
                self._pending.append(work)
        self._weight_grad(mb, grads.weight_grad)

    def _run_ib(self, mb: int) -> None:
        from ..model.vocab_parallel import embedding_ib

        state = self._if.pop(mb)[2]
        if self.is_first:
            work, grad = self._ib.pop(mb)
            self._pending.append(work)
        else:
            tokens = self.inputs[mb]["tokens"]
            weight = self.slices.word_embeddings
            grad = torch.empty(*tokens.shape, weight.shape[1], dtype=weight.dtype, device=weight.device)
            work = dist.broadcast(grad, src=self._global(self.src_first), group=self.g["ib"], async_op=True)
            self.timing.wait(("IB", self.rank, mb), work.wait)
        embedding_ib(state, grad, self.slices.word_embeddings)()

    def _weight_grad(self, mb: int, wg: Callable[[], None]) -> None:
        """Run T's weight gradient now, or queue it for this rank's later W of ``mb``."""
        if mb in self._t_to_w:
            stage = self._t_to_w[mb]
            self.store.queue_for(stage, mb, self.timing.timed_weight_grad(stage, mb, wg),
                                 params=(self.slices.output_layer_weight,))
        else:
            wg()

    # ------------------------------------------------------------------ hooks of the first / last stage
    @contextlib.contextmanager
    def first_forward(self, mb: int) -> Iterator[None]:
        """Around the first stage's ``F(mb)``: the chunk's word embedding is IF's sum (waited for here)."""
        from ..model.vocab_chunks import embedding_source

        def source(input_ids: torch.Tensor) -> torch.Tensor:
            work, partial, state = self._if[mb]
            if not torch.equal(input_ids.to(self.inputs[mb]["tokens"].device), self.inputs[mb]["tokens"]):
                raise RuntimeError(f"microbatch {mb}: the first stage's tokens differ from the vocabulary-parallel "
                                   f"inputs' (every rank must be given the same micro batches, in order)")
            self.timing.wait(("F", 0, mb), work.wait)
            leaf = partial.detach().requires_grad_()
            self._emb_leaf[mb] = leaf
            self._if[mb] = (None, None, state)  # IB needs only the lookup's state
            return leaf

        with embedding_source(source):
            yield

    def wrap_forward_step_func(self, mb: int, forward_step_func: Callable) -> Callable:
        """The last stage's ``forward_step_func``, keeping the ``loss_func`` it returns for the barrier thread."""
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            out, loss_func = forward_step_func(*args, **kwargs)
            self._loss_funcs[mb] = loss_func
            return out, loss_func
        return wrapped

    def after_last_forward(self, mb: int, out: torch.Tensor) -> None:
        """After the last stage's ``F(mb)``: keep ``X`` and post its broadcast (from tensor rank 0; the stage's
        other tensor ranks keep their own, equal, copy and receive into a scratch buffer). ``X`` travels in the
        pipeline's dtype (bf16: ``Float16Module`` hands the last stage's output out as fp32, an exact cast back)."""
        self._out_dtype = out.dtype
        x = out.detach().to(self.dtype, copy=True)
        self._x[mb] = x
        send = x if self.sends_last else torch.empty_like(x)
        self._pending.append(dist.broadcast(send, src=self._global(self.src_last), group=self.g["x"], async_op=True))

    def last_output_grad(self, mb: int) -> torch.Tensor:
        """For the last stage's ``B(mb)``: the gradient of ``X`` (C1's sum, or the barrier thread's), in the
        pipeline's dtype, then in the dtype of the chunk's output (fp32 behind bf16's ``Float16Module``)."""
        if self.exact:
            work, grad = self._c1.pop(mb)
            self.timing.wait((self._last_b, self.last_stage, mb), work.wait)
            return grad.to(self.dtype).to(self._out_dtype)
        x_grad = self.timing.wait((self._last_b, self.last_stage, mb), self._barrier[mb].result).x_grad
        assert x_grad is not None
        return x_grad.to(self._out_dtype)

    def after_first_backward(self, mb: int) -> None:
        """After the first stage's ``B(mb)``: post the embedding gradient's broadcast for ``IB``."""
        leaf = self._emb_leaf.pop(mb)
        grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        send = grad if self.sends_first else torch.empty_like(grad)  # tensor ranks > 0: their own copy kept
        work = dist.broadcast(send, src=self._global(self.src_first), group=self.g["ib"], async_op=True)
        self._ib[mb] = (work, grad)

    # ------------------------------------------------------------------ end of the iteration
    def finish(self) -> tuple[dict[int, list[Any]], torch.Tensor]:
        """Wait for every posted collective and the barrier thread; return the last rank's forward data per
        microbatch and its token count."""
        for mb, fut in self._barrier.items():
            self.results.setdefault(mb, fut.result())
        for work in self._pending:
            work.wait()
        self._pending.clear()
        self.close()
        data = {mb: r.loss_data for mb, r in self.results.items() if r.loss_data}
        tokens = torch.zeros([], dtype=torch.int, device=self.slices.word_embeddings.device)
        for r in self.results.values():
            if r.num_tokens is not None:
                tokens += r.num_tokens.to(tokens.device)
        return data, tokens

    def sync_grads(self) -> None:
        """After a training call: the slices' data-parallel gradient reduction (their DDP's, when given)."""
        if self.ddp is not None:
            self.ddp.finish_grad_sync()

    def close(self) -> None:
        """Stop the barrier thread (also after a failure)."""
        self._thread.close()

    def _reap(self) -> None:
        """Drop the posted works that completed (their errors raised here)."""
        keep = []
        for w in self._pending:
            if w.is_completed():
                w.wait()
            else:
                keep.append(w)
        self._pending = keep

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.g["x"], group_rank)


def vocab_passes(model: VocabParallelModel, *, plan: Any, timeout: float, config: Any, runtime: Any,
                 store: WeightGradStore, forward_only: bool, collect_non_loss_data: bool,
                 cp_group_size: int) -> VocabPasses:
    """This call's :class:`VocabPasses`, after refusing (``ValueError``) what the runtime does not run yet:
    data parallelism without the slices' DDP, context parallelism, chunks not passed through
    ``strip_vocab_layers``, schedules :func:`check_vocab_schedule` refuses, a missing ``data_iterator``."""
    from megatron.core import parallel_state

    schedule = plan.schedule
    problems = []
    if cp_group_size != 1:
        problems.append(f"context-parallel size {cp_group_size}: vocabulary-parallel passes run with tensor, pipeline "
                        f"and data parallelism only so far")
    dp = parallel_state.get_data_parallel_world_size()
    if dp > 1 and model.ddp is None:
        problems.append(f"data-parallel size {dp}: VocabParallelModel.ddp (the slices in megatron-core DDP) is needed "
                        f"to reduce the slices' gradients")
    if model.ddp is not None and (model.ddp.ddp_config.overlap_grad_reduce or model.ddp.ddp_config.overlap_param_gather):
        problems.append("VocabParallelModel.ddp must have overlap_grad_reduce=False and overlap_param_gather=False "
                        "(no autograd hook reports the slices' gradients; no forward hook gathers them)")
    if getattr(config, "calculate_per_token_loss", False):
        problems.append("calculate_per_token_loss: finalize_model_grads would divide the chunks' gradients by the "
                        "token count but not the vocabulary slices' (not supported yet)")
    if getattr(config, "num_moe_experts", None):
        problems.append("mixture of experts: the auxiliary-loss scale is not set by the vocabulary passes yet")
    if schedule.vocab_barriers not in (1, 2):
        problems.append(f"schedule {schedule.name!r} has no vocabulary-parallel passes")
    for stage, chunk in runtime.chunks.items():
        if stage in (0, schedule.num_stages - 1) and not getattr(_unwrap(chunk), "vocab_parallel_stripped", False):
            problems.append(f"stage {stage}'s chunk still holds its vocabulary layer: pass it through "
                            f"megatron_zb.model.vocab_chunks.strip_vocab_layers")
    mp_group = parallel_state.get_model_parallel_group()  # the slices' group: pp_rank x TP + tp_rank
    vocab = getattr(model.slices, "vocab", None)
    if vocab is not None and (vocab.num_slices, vocab.index) != (mp_group.size(), mp_group.rank()):
        problems.append(f"the slices are slice {vocab.index} of {vocab.num_slices}, this rank is rank {mp_group.rank()} "
                        f"of {mp_group.size()} of the model-parallel group: build VocabParallelSlices over "
                        f"parallel_state.get_model_parallel_group()")
    data_iterator = model.data_iterator
    if data_iterator is None:
        problems.append("VocabParallelModel.data_iterator is not set: every rank needs each microbatch's tokens "
                        "and labels")
    if problems:
        raise ValueError("vocabulary-parallel run refused: " + "; ".join(problems))
    check_vocab_schedule(schedule)
    inputs = [next(data_iterator) for _ in range(schedule.num_microbatches)]
    return VocabPasses(model=model, channels=vocab_channels(mp_group, timeout=timeout), schedule=schedule,
                       rank=plan.rank, inputs=inputs, config=config, chunks=runtime.chunks,
                       dtype=runtime.dtype, store=store, rank_actions=plan.actions,
                       collect_non_loss_data=collect_non_loss_data, cp_group_size=cp_group_size,
                       forward_only=forward_only, tp_size=parallel_state.get_tensor_model_parallel_world_size(),
                       tp_rank=parallel_state.get_tensor_model_parallel_rank())


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk

"""The runtime's vocabulary-parallel passes: ``IF``, ``S``, ``T``, ``IB`` of a schedule on the slices of
:class:`~megatron_zb.model.vocab_parallel.VocabParallelSlices`, and their collectives, issued where the rank's
program says (:mod:`~megatron_zb.runtime.vocab_program`; docs/vocab_parallel.md, "What runs").

Per microbatch ``i`` (``first`` / ``last``: the ranks of the first and last stage; on each tensor-parallel
rank its own pipeline does the same: ``X``, the loss gradient and the embedding's gradient are replicated
over a stage's tensor ranks -- bitwise: megatron-core's tensor-parallel all-reduces give every tensor rank
the same sum; with sequence parallelism the stripped chunks' stand-ins gather ``X``'s rows and the embedding
gradient's, :mod:`~megatron_zb.model.vocab_chunks`):

* ``IF(i)`` (every rank): masked lookup of the slice's tokens; ``COLL if``: the all-reduce SUM over the
  model-parallel group, posted; ``first``'s ``F(i)`` waits for it (``WAIT if``) and takes the sum as the word
  embedding (:mod:`~megatron_zb.model.vocab_chunks`).
* ``last``'s ``F(i)``: the chunk stops after the final norm; ``COLL x`` sends its output ``X`` to every other
  pipeline rank (point to point: :mod:`~megatron_zb.runtime.vocab_program` says why not a broadcast).
* ``S(i)`` (every rank; the others first receive ``X``: ``COLL x``, ``WAIT x``): the slice's logits and
  statistics; then the forward barrier ``COLL c0`` (:func:`~megatron_zb.model.vocab_parallel.output_c0`: its
  all-reduces, each waited for before the next; then on ``last`` megatron-core's loss bookkeeping --
  ``forward_step_calc_loss`` with the ``loss_func`` that ``forward_step_func`` returned in ``F(i)``, the loss
  scale -- and the gradient of the loss with respect to the per-token losses), and ``COLL grad``: ``last``
  sends that gradient to every other rank.
* ``T(i)`` (every rank; the others wait for the loss gradient first): the slice's logits gradient,
  input-gradient part and weight gradient (run at once, or -- with ``VocabParallelModel.defer_t_weight``,
  when the rank runs a ``W`` of microbatch ``i`` later -- queued in the weight-gradient store for that ``W``);
  with two barriers (``vocab_barriers == 2``, megatron-core's exact arithmetic) ``COLL c1`` all-reduces the
  parts.
* ``last``'s ``B(i)``: the gradient of ``X`` is ``C1``'s sum (two barriers: ``WAIT c1``) or, with one barrier
  (the paper's rescaled arithmetic, the input gradient formed in ``S`` and reduced in ``C0``), computed in
  ``last``'s ``COLL c0``; megatron-core's ``backward_step`` then runs the chunk as a middle stage.
* ``first``'s ``B(i)``: ``COLL ib`` sends the embedding's gradient to every other rank; ``IB(i)`` (every rank;
  the others receive it first) adds the slice's weight gradient.

A forward-only call (evaluation) runs ``IF``, the forwards, ``S`` and ``C0`` (``last`` computes the loss);
nothing is sent back and no ``T``/``IB`` runs. Everything is issued by the main thread, in the program's
order, so the NCCL model replays exactly these calls (:mod:`~megatron_zb.runtime.comm_certify`). On NCCL a
wait is a stream wait; nothing here synchronises the host.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from ..schedules import Action, Op, Schedule
from ..schedules.ir import interleaved_placement, plain_placement, v_placement
from .channels import Channels
from .comm_program import Issue, Step
from .vocab_program import broadcast_sources
from .wgrad_store import WeightGradStore

__all__ = ["VocabParallelModel", "VocabPasses", "check_vocab_schedule", "t_weight_stages"]


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
    tokens_checked: bool = False
    """Set after the first call compared the first stage's tokens with ``data_iterator``'s (once: the
    comparison synchronises the host with the device)."""


def check_vocab_schedule(schedule: Schedule) -> None:
    """Refuse (``ValueError``) a vocabulary-parallel schedule the runtime cannot run: a placement other than
    plain, V or interleaved (Megatron's ``v`` chunks per rank), or a first stage whose ``B``/``BW`` or a last
    stage whose ``F`` leave microbatch order (what they send is matched by order)."""
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
                             f"what the stage sends to every rank needs them in order")


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


class VocabPasses:
    """One rank's vocabulary-parallel state for one iteration (module docstring); the executor calls
    :meth:`run` for ``IF``/``S``/``T``/``IB``, :meth:`collective` for the program's ``COLL`` / ``WAIT`` steps of
    the vocabulary collectives, and the hooks around the first and last stage's ``F``/``B``.

    ``timing`` (set by the caller when actions are timed) times ``T``'s deferred weight gradients and the
    forward barriers on the actions' clock (:meth:`~megatron_zb.runtime.action_timing.ActionTiming.interval`)."""

    def __init__(self, *, model: VocabParallelModel, channels: Channels, schedule: Schedule, rank: int,
                 inputs: list[dict[str, torch.Tensor]], config: Any, chunks: dict[int, torch.nn.Module],
                 dtype: torch.dtype, store: WeightGradStore, rank_actions: tuple[Action, ...],
                 collect_non_loss_data: bool, cp_group_size: int, forward_only: bool = False) -> None:
        from ..megatron_compat import forward_step_calc_loss

        self.model, self.slices, self.channels, self.ddp = model, model.slices, channels, model.ddp
        self.p, self.rank, self.m = schedule.num_ranks, rank, schedule.num_microbatches
        self.last_stage = schedule.num_stages - 1
        self.is_first, self.is_last = rank == schedule.stage_to_rank[0], rank == schedule.stage_to_rank[-1]
        self.sources = broadcast_sources(schedule)   # kind -> the pipeline rank that sends it
        self.exact = schedule.vocab_barriers == 2   # two barriers: megatron-core's arithmetic, C1 after T
        if len(inputs) != self.m:
            raise ValueError(f"vocabulary-parallel inputs: {len(inputs)} micro batches for {self.m} microbatches")
        self.inputs, self.config, self.chunks = inputs, config, chunks
        self.dtype, self.store = dtype, store
        self.collect_non_loss_data, self.cp_group_size = collect_non_loss_data, cp_group_size
        self.forward_only = forward_only  # evaluation: IF, F, S and the loss; no T, no IB
        self.timing: Any = None           # an ActionTiming when the actions are timed
        self._calc_loss = forward_step_calc_loss()
        self._loss_config = copy.copy(config)
        self._loss_config.timers = None   # the loss bookkeeping runs outside megatron-core's timed steps
        # mb -> the stage of the W that runs T's weight gradient (none: T runs it)
        self._t_to_w = t_weight_stages(rank_actions) if model.defer_t_weight else {}
        self._pending: list[Any] = []   # works nobody waits for on this rank (waited at the end)
        self._works: dict[tuple[str, int], Any] = {}   # (kind, mb) -> the work a WAIT step waits for
        self._held: dict[tuple[str, int], torch.Tensor] = {}   # (kind, mb) -> a tensor received or to send
        self._if: dict[int, tuple[torch.Tensor, Any]] = {}  # mb -> (partial sum, lookup state)
        self._emb_leaf: dict[int, torch.Tensor] = {}
        self._out_dtype = dtype  # the last stage's chunk output's dtype (fp32 behind Float16Module)
        self._state: dict[int, Any] = {}
        self._loss_funcs: dict[int, Callable] = {}
        self._x_grad: dict[int, torch.Tensor] = {}
        self._loss_data: dict[int, list[Any]] = {}
        self._num_tokens: list[torch.Tensor] = []

    # ------------------------------------------------------------------ the passes
    def run(self, a: Action) -> None:
        """Run the vocabulary pass ``a`` (``IF``, ``S``, ``T`` or ``IB`` of microbatch ``a.mb``)."""
        self._reap()
        {Op.IF: self._run_if, Op.S: self._run_s, Op.T: self._run_t, Op.IB: self._run_ib}[a.op](a.mb)

    def _run_if(self, mb: int) -> None:
        from ..model.vocab_parallel import embedding_if

        self._if[mb] = embedding_if(self.inputs[mb]["tokens"], self.slices.word_embeddings, self.slices.vocab)

    def _run_s(self, mb: int) -> None:
        from ..model.vocab_parallel import output_s

        target = self.inputs[mb]["labels"].transpose(0, 1).contiguous()
        x = self._held.pop(("x", mb))   # the last stage's own, or received (WAIT x)
        self._state[mb] = output_s(x, self.slices.output_layer_weight, target, self.slices.vocab, exact=self.exact,
                                   fuse_input_grad=not self.exact)

    def _run_t(self, mb: int) -> None:
        from ..model.vocab_parallel import output_t

        grads = output_t(self._state.pop(mb), self._held.pop(("grad", mb)))
        if self.exact:   # C1 sums the input gradient's parts (COLL c1)
            self._held[("c1", mb)] = grads.input_grad
        self._weight_grad(mb, grads.weight_grad)

    def _run_ib(self, mb: int) -> None:
        from ..model.vocab_parallel import embedding_ib

        state = self._if.pop(mb)[1]
        embedding_ib(state, self._held.pop(("ib", mb)), self.slices.word_embeddings)()

    def _weight_grad(self, mb: int, wg: Callable[[], None]) -> None:
        """Run T's weight gradient now, or queue it for this rank's later W of ``mb``."""
        if mb not in self._t_to_w:
            wg()
            return
        stage = self._t_to_w[mb]

        def timed() -> None:
            with self._interval(("TW", stage, mb)):
                wg()
        self.store.queue_for(stage, mb, timed, params=(self.slices.output_layer_weight,))

    def _interval(self, key: tuple) -> contextlib.AbstractContextManager:
        return self.timing.interval(key) if self.timing is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------ the collectives (program steps)
    def collective(self, issue: Issue) -> None:
        """Issue (``COLL``) or wait for (``WAIT``) the vocabulary collective ``issue.coll`` of microbatch
        ``issue.action.mb`` on communicator slot ``issue.slot`` (module docstring)."""
        kind, mb = issue.coll, issue.action.mb
        if issue.step is Step.WAIT:
            if kind != "c0":   # C0's all-reduces were waited for one by one in COLL c0
                self._works.pop((kind, mb)).wait()
        elif kind in ("x", "grad", "ib"):
            self._send_or_receive(kind, mb, issue.slot)
        elif kind == "if":
            partial = self._if[mb][0]
            work = dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=self._coll(kind, issue.slot), async_op=True)
            self._keep(kind, mb, work, mine=self.is_first)
        elif kind == "c0":
            with self._interval(("C0", mb)):
                self._forward_barrier(mb, self._coll(kind, issue.slot))
        else:  # c1
            work = dist.all_reduce(self._held[("c1", mb)], op=dist.ReduceOp.SUM, group=self._coll(kind, issue.slot),
                                   async_op=True)
            self._keep(kind, mb, work, mine=self.is_last)
            if not self.is_last:
                del self._held[("c1", mb)]

    def _keep(self, kind: str, mb: int, work: Any, *, mine: bool) -> None:
        """The work a later ``WAIT`` of this rank waits for (``mine``), or one waited for at the end."""
        if mine:
            self._works[(kind, mb)] = work
        else:
            self._pending.append(work)

    def _coll(self, kind: str, slot: int) -> Any:
        return self.channels.group(("coll", kind, slot))

    def _send_or_receive(self, kind: str, mb: int, slot: int) -> None:
        """What one stage hands every rank: its rank sends ``_held[(kind, mb)]`` to each other pipeline rank;
        the others post the receive into a new buffer (kept for the ``WAIT`` and the pass that uses it)."""
        src = self.sources[kind]
        if self.rank == src:
            t = self._held[(kind, mb)]   # its own pass takes it later (S, T, IB)
            for r in range(self.p):
                if r != src:
                    group = self.channels.group(("bcast", kind, src, r, slot))
                    self._pending.append(dist.isend(t, dst=self.channels.peer(r), group=group))
            return
        buf = self._buffer(kind, mb)
        group = self.channels.group(("bcast", kind, src, self.rank, slot))
        self._works[(kind, mb)] = dist.irecv(buf, src=self.channels.peer(src), group=group)
        self._held[(kind, mb)] = buf

    def _buffer(self, kind: str, mb: int) -> torch.Tensor:
        """A receive buffer for ``kind``: ``X`` ``[s, b, h]`` in the pipeline's dtype, the loss gradient like
        this rank's own per-token loss ``[s, b]`` (C0 computed it), the embedding's gradient ``[b, s, h]`` like
        the embedding."""
        if kind == "grad":
            return torch.empty_like(self._state[mb].loss)
        weight = self.slices.word_embeddings
        b, s = self.inputs[mb]["tokens"].shape
        if kind == "x":
            return torch.empty(s, b, weight.shape[1], dtype=self.dtype, device=weight.device)
        return torch.empty(b, s, weight.shape[1], dtype=weight.dtype, device=weight.device)

    def _forward_barrier(self, mb: int, group: Any) -> None:
        """C0 for microbatch ``mb`` on every rank; on the last rank also the loss (megatron-core's bookkeeping),
        its gradient with respect to the per-token losses (kept for ``COLL grad``) and, with one barrier, the
        gradient of ``X``."""
        from ..model.vocab_parallel import output_c0

        state = self._state[mb]
        loss = output_c0(state, group)
        if not self.is_last:
            return
        data: list[Any] = []
        per_token = loss.transpose(0, 1).contiguous()  # [b, s], as megatron-core's model returns
        if self.forward_only:
            with torch.no_grad():
                _, tokens = self._calc_loss(self.chunks[self.last_stage], per_token, self._loss_funcs.pop(mb),
                                            self._loss_config, None, self.collect_non_loss_data, self.m, data,
                                            self.cp_group_size, True)
        else:
            per_token.requires_grad_()
            with torch.enable_grad():
                out, tokens = self._calc_loss(self.chunks[self.last_stage], per_token, self._loss_funcs.pop(mb),
                                              self._loss_config, None, self.collect_non_loss_data, self.m, data,
                                              self.cp_group_size, True)
                if self.config.grad_scale_func is not None:   # backward_step's scaling of the last stage
                    out = self.config.grad_scale_func(out)
                (g,) = torch.autograd.grad(out, per_token)
            grad_loss = g.transpose(0, 1).contiguous()
            self._held[("grad", mb)] = grad_loss
            if not self.exact:  # one barrier: the input gradient was reduced in C0
                self._x_grad[mb] = (state.input_grad * grad_loss.unsqueeze(-1)).to(self.dtype)
        self._loss_data[mb] = data
        self._num_tokens.append(tokens)

    # ------------------------------------------------------------------ hooks of the first / last stage
    @contextlib.contextmanager
    def first_forward(self, mb: int) -> Iterator[None]:
        """Around the first stage's ``F(mb)``: the chunk's word embedding is IF's sum (``WAIT if`` came first)."""
        from ..model.vocab_chunks import embedding_source

        def source(input_ids: torch.Tensor) -> torch.Tensor:
            self._check_tokens(mb, input_ids)
            leaf = self._if[mb][0].detach().requires_grad_()
            self._emb_leaf[mb] = leaf
            return leaf

        with embedding_source(source):
            yield

    def _check_tokens(self, mb: int, input_ids: torch.Tensor) -> None:
        """The first stage's tokens must be the vocabulary-parallel inputs' (every rank reads the same micro
        batches, in order): the shapes every microbatch, the values in the first call only (a host sync)."""
        mine = self.inputs[mb]["tokens"]
        same = tuple(input_ids.shape) == tuple(mine.shape)
        if same and not self.model.tokens_checked:
            same = torch.equal(input_ids.to(mine.device), mine)
        if not same:
            raise RuntimeError(f"microbatch {mb}: the first stage's tokens differ from the vocabulary-parallel "
                               f"inputs' (every rank must be given the same micro batches, in order)")

    def wrap_forward_step_func(self, mb: int, forward_step_func: Callable) -> Callable:
        """The last stage's ``forward_step_func``, keeping the ``loss_func`` it returns for the forward barrier."""
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            out, loss_func = forward_step_func(*args, **kwargs)
            self._loss_funcs[mb] = loss_func
            return out, loss_func
        return wrapped

    def after_last_forward(self, mb: int, out: torch.Tensor) -> None:
        """After the last stage's ``F(mb)``: keep ``X`` for ``S`` and ``COLL x``, in the pipeline's dtype (bf16:
        ``Float16Module`` hands the last stage's output out as fp32, an exact cast back)."""
        self._out_dtype = out.dtype
        self._held[("x", mb)] = out.detach().to(self.dtype, copy=True)

    def last_output_grad(self, mb: int) -> torch.Tensor:
        """For the last stage's ``B(mb)``: the gradient of ``X`` (C1's sum, waited for by ``WAIT c1``, or the
        forward barrier's), in the pipeline's dtype, then in the dtype of the chunk's output (fp32 behind bf16's
        ``Float16Module``)."""
        if self.exact:
            return self._held.pop(("c1", mb)).to(self.dtype).to(self._out_dtype)
        return self._x_grad.pop(mb).to(self._out_dtype)

    def after_first_backward(self, mb: int) -> None:
        """After the first stage's ``B(mb)``: keep the embedding gradient for ``COLL ib`` and ``IB``."""
        leaf = self._emb_leaf.pop(mb)
        grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        self._held[("ib", mb)] = grad

    # ------------------------------------------------------------------ end of the iteration
    def finish(self) -> tuple[dict[int, list[Any]], torch.Tensor]:
        """Wait for every collective not waited for yet; return the last rank's forward data per microbatch
        and its token count."""
        for work in self._pending + list(self._works.values()):
            work.wait()
        self.close()
        self.model.tokens_checked = True
        tokens = torch.zeros([], dtype=torch.int, device=self.slices.word_embeddings.device)
        for t in self._num_tokens:
            tokens += t.to(tokens.device)
        return {mb: d for mb, d in self._loss_data.items() if d}, tokens

    def sync_grads(self) -> None:
        """After a training call: the slices' data-parallel gradient reduction (their DDP's, when given)."""
        if self.ddp is not None:
            self.ddp.finish_grad_sync()

    def close(self) -> None:
        """Drop the works (the iteration ended, or failed)."""
        self._pending.clear()
        self._works.clear()

    def _reap(self) -> None:
        """Drop the posted works that completed (their errors raised here)."""
        keep = []
        for w in self._pending:
            if w.is_completed():
                w.wait()
            else:
                keep.append(w)
        self._pending = keep


def vocab_passes(model: VocabParallelModel, *, plan: Any, channels: Channels, config: Any, runtime: Any,
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
    return VocabPasses(model=model, channels=channels, schedule=schedule, rank=plan.rank, inputs=inputs, config=config,
                       chunks=runtime.chunks, dtype=runtime.dtype, store=store, rank_actions=plan.actions,
                       collect_non_loss_data=collect_non_loss_data, cp_group_size=cp_group_size,
                       forward_only=forward_only)


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk

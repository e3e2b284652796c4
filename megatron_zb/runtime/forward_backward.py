"""The drop-in ``forward_backward_func``: megatron-core's signature, any schedule of the library."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from ..schedules.costs import CostModel
from ..schedules.ir import Schedule, ScheduleError, vocab_passes_unsupported
from ..schedules.registry import build_schedule, get_spec
from ..schedules.wgrad_groups import group_wgrads, wgrad_group_of
from .executor import ActionTiming, LoopOverhead, StageRuntime, execute
from .install import Installed, NotBuilt, install_from_rank0
from .measure import Measure, Measured
from .rank_plan import RECV_LOOKAHEAD, RankPlan, check_lookahead, plan_rank
from .grad_sync import GradSync, GradSyncReport, overlapping_ddp_chunks
from .sharded_grads import ShardedGradSync, sharded_chunks
from .memory import ActivationMemoryTracker
from .peer_wait import WaitPolicy, Watchdog
from .channels import channels_for
from .p2p import PipeComm
from .routes import check_schedule, install_routes
from .wgrad_store import WeightGradStore

if TYPE_CHECKING:
    from .vocab_runtime import VocabParallelModel, VocabPasses

NOTHING = Measure()
"""What a plain ``forward_backward_func`` call measures: nothing beyond :class:`LoopOverhead`."""


@dataclass(frozen=True)
class ZeroBubbleOptions:
    """Options of :func:`get_forward_backward_func` (megatron-core style config dataclass), fixed for
    the object's life (what one call measures is asked per call: :class:`~megatron_zb.runtime.measure.Measure`).

    Attributes:
        schedule: a schedule name of the library (``"1f1b"``, ``"zb-h1"``, ``"zb-h2"``, ``"zb"``,
            ``"zb-1p"``, ``"zb-2p"``, ``"zbv"``, ``"v-half"``, ``"v-min"``, ...), or a
            :class:`~megatron_zb.schedules.Schedule` (e.g. loaded from JSON) for fixed ``p`` and ``m``.
        costs: per-stage cost model for cost-aware schedules (times in any unit; memory in units
            of one stage's activation) until measured costs are installed
            (:meth:`ZeroBubbleForwardBackward.install`). ``None``: unit costs.
        memory_limit: per-rank activation limit in units of one stage's ``M_B`` (``None``: the
            schedule's default, e.g. ``p`` for ``"zb"``).
        num_chunks: model chunks per rank for interleaved placements.
        timeout: seconds any single p2p transfer, and any data-parallel reduce launched from W
            (``overlap_grad_reduce``), may take before the run fails with a
            :class:`~megatron_zb.runtime.peer_wait.PipelineTimeoutError` naming the rank, the operation and
            the peer (:mod:`megatron_zb.runtime.peer_wait`).
        recv_lookahead: how many actions ahead receives are posted, 0 to
            :data:`~megatron_zb.runtime.rank_plan.MAX_RECV_LOOKAHEAD` (each direction of a pair of
            ranks has its own communicators, so posting early never holds a send back); default
            :data:`~megatron_zb.runtime.rank_plan.RECV_LOOKAHEAD`.
        wait_policy: how p2p and the data-parallel reduces wait (:class:`~megatron_zb.runtime.peer_wait.WaitPolicy`);
            ``None`` (default): from each group's backend (NCCL: stream waits and a watchdog;
            otherwise host waits with the timeout).
        validate: check the schedule before running it. Turn off only to exercise the runtime's
            own safety nets (p2p timeouts, pending-W check) with deliberately broken schedules.
        vocab_parallel: the model's vocabulary slices
            (:class:`~megatron_zb.runtime.vocab_runtime.VocabParallelModel`), required by -- and only
            allowed with -- a schedule with vocabulary-parallel passes (``1f1b-vocab-1``, ...), with the
            iterator of micro batches every rank reads for them (docs/vocab_parallel.md).
        wgrad_group: run each stage's ``W``'s in groups of this many micro batches, each group layer-major
            (:func:`~megatron_zb.schedules.wgrad_groups.group_wgrads` applied to every schedule built or
            given; the gradients are bitwise those of the ungrouped schedule). ``None``: as the schedule
            runs them.
    """

    schedule: str | Schedule = "zb"
    costs: CostModel | None = None
    memory_limit: float | None = None
    num_chunks: int = 2
    timeout: float = 120.0
    recv_lookahead: int = RECV_LOOKAHEAD
    wait_policy: WaitPolicy | None = None
    validate: bool = True
    vocab_parallel: VocabParallelModel | None = None
    wgrad_group: int | None = None

    def stage_to_rank(self, num_ranks: int) -> list[int]:
        """The placement the model chunks are built for at ``num_ranks`` pipeline ranks."""
        if isinstance(self.schedule, Schedule):
            return list(self.schedule.stage_to_rank)
        return get_spec(self.schedule).placement.stage_to_rank(num_ranks, self.num_chunks)


@dataclass
class ZeroBubbleForwardBackward:
    """Callable with megatron-core's ``forward_backward_func`` signature; :meth:`run` is the same call
    with what to measure asked (:class:`~megatron_zb.runtime.measure.Measure`) and what was measured
    returned (:class:`~megatron_zb.runtime.measure.Measured`).

    Holds the schedule installed for each ``(p, m)`` (:meth:`install`: global rank 0's, built from the
    installed costs -- the options' until measured ones are installed), its lowered and checked
    per-rank plan (built on the first call for a ``(p, m)``, reused by every later call) and its
    weight-gradient ``store`` (every call's B's queue into it, its W's run it).
    """

    options: ZeroBubbleOptions
    store: WeightGradStore = field(default_factory=WeightGradStore)
    _costs: CostModel | None = None   # the installed costs (``options.costs`` until install(costs=...))
    _memory_limit: float | None = None  # the installed limit (``options.memory_limit``, or the costs' own)
    _calls: int = 0  # training (not forward-only) calls so far
    _reduce_watchdog: Watchdog | None = None  # NCCL: the last call's data-parallel reduces
    _installed: dict[tuple[int, int], Schedule] = field(default_factory=dict)
    _plans: dict[tuple[int, int, int, bool], RankPlan] = field(default_factory=dict)
    _mtp_checked: set[int] = field(default_factory=set)  # id() of the chunks mark_tied_mtp_weights has seen

    def __post_init__(self) -> None:
        self._costs, self._memory_limit = self.options.costs, self.options.memory_limit

    @property
    def costs(self) -> CostModel | None:
        """The cost model the installed schedules were built from (``None``: unit costs)."""
        return self._costs

    def installed(self, num_ranks: int, num_microbatches: int) -> Schedule | None:
        """The schedule installed for ``p`` ranks and ``m`` micro batches, if any (:meth:`install`)."""
        return self._installed.get((num_ranks, num_microbatches))

    def schedule_for(self, num_ranks: int, num_microbatches: int) -> Schedule:
        """The schedule installed for ``p`` and ``m``; a ``KeyError`` naming :meth:`install` when none is."""
        sched = self.installed(num_ranks, num_microbatches)
        if sched is None:
            raise KeyError(f"no schedule installed for {num_ranks} pipeline ranks and {num_microbatches} micro "
                           f"batches: a call of this forward_backward_func, or install(), installs one")
        return sched

    def build(self, num_ranks: int, num_microbatches: int, costs: CostModel | None = None) -> Schedule:
        """Build (not install) the schedule for ``p`` and ``m`` from ``costs`` (default: the installed
        costs); a fixed schedule (``options.schedule`` a :class:`Schedule`) must match ``p`` and ``m``."""
        fixed = self.options.schedule
        if isinstance(fixed, Schedule):
            if (fixed.num_ranks, fixed.num_microbatches) != (num_ranks, num_microbatches):
                raise ScheduleError(f"the given schedule is for {fixed.num_ranks} pipeline ranks and "
                                    f"{fixed.num_microbatches} microbatches, but this run has {num_ranks} ranks and "
                                    f"{num_microbatches} microbatches")
            return self._grouped(fixed)
        if costs is None:
            costs, limit = self._costs, self._memory_limit
        else:  # measured costs bring their own limit (the measured bytes'), else the installed one stays
            limit = costs.memory_limit if costs.memory_limit is not None else self._memory_limit
        return self._grouped(build_schedule(fixed, num_ranks=num_ranks, num_microbatches=num_microbatches,
                                            costs=costs, memory_limit=limit, num_chunks=self.options.num_chunks))

    def _grouped(self, sched: Schedule) -> Schedule:
        """``sched`` with the options' weight-gradient groups (as it is without, or when already so grouped)."""
        k = self.options.wgrad_group
        return sched if k is None or wgrad_group_of(sched) == k else group_wgrads(sched, k)

    def install(self, num_ranks: int, num_microbatches: int, *, costs: CostModel | None = None,
                schedule: Schedule | None = None) -> Installed | NotBuilt:
        """The install protocol (:func:`~megatron_zb.runtime.install.install_from_rank0`): global rank 0
        builds the schedule for ``p`` and ``m`` (``schedule`` given: rank 0's is that one; ``costs`` given:
        built from them), every rank installs rank 0's after checking its placement. With ``costs``, a
        success also makes them the installed costs and drops the schedules of other ``m`` (built again
        from these costs when used); a :class:`NotBuilt` changes nothing. Collective."""
        def build() -> Schedule:
            return self._grouped(schedule) if schedule is not None else self.build(num_ranks, num_microbatches, costs)

        def adopt(sched: Schedule) -> None:
            _check_vocab_option(self.options, vocab_passes_unsupported(sched))
            if costs is not None:
                self._costs = costs
                if costs.memory_limit is not None:
                    self._memory_limit = costs.memory_limit
                self._installed.clear()
                self._plans.clear()
            self._installed[(num_ranks, num_microbatches)] = sched
            self._drop_plans(num_ranks, num_microbatches)

        return install_from_rank0(build, stage_to_rank=self.options.stage_to_rank(num_ranks), install=adopt)

    def plan_for(self, num_ranks: int, num_microbatches: int, rank: int, *, forward_only: bool = False) -> RankPlan:
        """``rank``'s lowered and checked plan of the installed schedule (built once, then cached)."""
        key = (num_ranks, num_microbatches, rank, forward_only)
        if key not in self._plans:
            self._plans[key] = plan_rank(self.schedule_for(num_ranks, num_microbatches), rank=rank,
                                         forward_only=forward_only, validate=self.options.validate,
                                         recv_lookahead=self.options.recv_lookahead)
        return self._plans[key]

    def _drop_plans(self, num_ranks: int, num_microbatches: int) -> None:
        for key in [k for k in self._plans if k[:2] == (num_ranks, num_microbatches)]:
            del self._plans[key]

    def __call__(self, *, forward_step_func: Callable, data_iterator: Iterator | list[Iterator] | None,
                 model: torch.nn.Module | list[torch.nn.Module], num_microbatches: int, seq_length: int,
                 micro_batch_size: int, decoder_seq_length: int | None = None, forward_only: bool = False,
                 collect_non_loss_data: bool = False, first_val_step: bool | None = None,
                 adjust_tensor_shapes_fn: Callable | None = None, p2p_communicator: Any = None,
                 pg_collection: Any = None, force_all_reduce: bool | None = False) -> list[Any]:
        """megatron-core's ``forward_backward_func`` (its keywords, those of :meth:`run`): one iteration,
        nothing measured; returns the last stage's forward data."""
        return self.run(NOTHING, forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                        num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size,
                        decoder_seq_length=decoder_seq_length, forward_only=forward_only,
                        collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step,
                        adjust_tensor_shapes_fn=adjust_tensor_shapes_fn, p2p_communicator=p2p_communicator,
                        pg_collection=pg_collection, force_all_reduce=force_all_reduce).data

    def run(self, measure: Measure = NOTHING, *, forward_step_func: Callable,
            data_iterator: Iterator | list[Iterator] | None,
            model: torch.nn.Module | list[torch.nn.Module], num_microbatches: int, seq_length: int,
            micro_batch_size: int, decoder_seq_length: int | None = None, forward_only: bool = False,
            collect_non_loss_data: bool = False, first_val_step: bool | None = None,
            adjust_tensor_shapes_fn: Callable | None = None, p2p_communicator: Any = None,
            pg_collection: Any = None, force_all_reduce: bool | None = False) -> Measured:
        """One iteration, as megatron-core's ``forward_backward_func`` (the same keywords), measuring
        what ``measure`` asks: install the schedule for ``(p, m)`` if none is (collective), plan this
        rank's part, execute it with gradient reduction held back, then finish the gradients. Returns
        the last stage's forward data (reduced losses, micro batch order) with the call's measurements
        (a vocabulary-parallel schedule also reads ``num_microbatches`` micro batches of
        ``options.vocab_parallel.data_iterator``)."""
        from megatron.core import parallel_state
        from megatron.core.utils import get_model_config

        from .linear_route import mark_tied_mtp_weights

        self._begin_call(forward_only)
        install_routes()
        chunks = model if isinstance(model, list) else [model]
        new = [c for c in chunks if id(c) not in self._mtp_checked]
        if new:  # once per chunk, not every call (it walks every module): chunks built outside megatron-zb
            mark_tied_mtp_weights(new)
            self._mtp_checked.update(id(c) for c in new)
        iters = data_iterator if isinstance(data_iterator, list) else [data_iterator] * len(chunks)
        config = get_model_config(chunks[0])
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        p, rank = pp_group.size(), pp_group.rank()
        if self.installed(p, num_microbatches) is None:
            outcome = self.install(p, num_microbatches)
            if isinstance(outcome, NotBuilt):
                raise ScheduleError(outcome.reason)
        sched = self.schedule_for(p, num_microbatches)
        plan = self.plan_for(p, num_microbatches, rank, forward_only=forward_only)
        stages = _check_chunks(sched, rank, chunks, forward_only)
        shape = _tensor_shape(config, seq_length=seq_length, micro_batch_size=micro_batch_size,
                              decoder_seq_length=decoder_seq_length, adjust_tensor_shapes_fn=adjust_tensor_shapes_fn)
        runtime = StageRuntime(chunks=dict(zip(stages, chunks)), data_iterators=dict(zip(stages, iters)),
                               tensor_shape=shape, dtype=config.pipeline_dtype or torch.float32,
                               device=next(chunks[0].parameters()).device)
        # every communicator the plan uses, created and warmed up in one global order (channels.py)
        channels = channels_for(pp_group, parallel_state.get_model_parallel_group(), timeout=self.options.timeout)
        channels.ensure(plan.communicators, runtime.device)
        if self.options.vocab_parallel is not None:
            from .vocab_runtime import vocab_passes

            runtime.vocab = vocab_passes(
                self.options.vocab_parallel, plan=plan, channels=channels,
                config=config, runtime=runtime, store=self.store,
                forward_only=forward_only, collect_non_loss_data=collect_non_loss_data,
                cp_group_size=parallel_state.get_context_parallel_group().size())
        memory = None
        if measure.track_memory:
            memory = ActivationMemoryTracker(p for c in chunks for p in c.parameters())
        comm = PipeComm(channels=channels, rank=rank,
                        timeout=self.options.timeout, policy=self.options.wait_policy, memory=memory,
                        max_outstanding_sends=plan.program.max_outstanding_sends)
        if config.timers is not None:
            config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
        grad_sync = None if forward_only else self._grad_sync(chunks, stages, measure.iteration)
        sync_ctx = _no_sync_context(config, chunks, grad_sync)
        overhead = LoopOverhead()
        # created last: on CUDA it records the iteration's start event (ActionTiming)
        timing = ActionTiming(device=runtime.device) if measure.time_actions else None
        if timing is not None and runtime.vocab is not None:
            runtime.vocab.timing = timing   # T's deferred weight gradients and the barriers on the actions' clock
        data, total_tokens, report = self._execute(
            comm=comm, grad_sync=grad_sync, sync_ctx=sync_ctx, vocab=runtime.vocab, plan=plan,
            runtime=runtime, forward_step_func=forward_step_func, config=config,
            collect_non_loss_data=collect_non_loss_data,
            cp_group_size=parallel_state.get_context_parallel_group().size(), first_val_step=first_val_step,
            timing=timing, memory=memory, overhead=overhead)
        if not forward_only:
            if runtime.vocab is not None:  # the slices' own data-parallel reduction (their DDP)
                runtime.vocab.sync_grads()
            _finish_gradients(config, chunks, grad_sync_launched=grad_sync is not None, schedule=sched,
                              total_tokens=total_tokens, pp_group=pp_group, pg_collection=pg_collection,
                              force_all_reduce=force_all_reduce)
        if config.timers is not None:
            config.timers("forward-backward").stop()
        return Measured(data=data, timing=timing, memory=memory, overhead=overhead, grad_sync=report)

    # ------------------------------------------------------------------ the steps of one call
    def _begin_call(self, forward_only: bool) -> None:
        """Count a training call; fail now if the last call's data-parallel reduces were late."""
        if not forward_only:
            self._calls += 1
            if self._reduce_watchdog is not None:
                self._reduce_watchdog.check()  # the last call's reduces, if one was late

    def _grad_sync(self, chunks: list[torch.nn.Module], stages: list[int],
                   iteration: int | None) -> GradSync | ShardedGradSync | None:
        """With sharded gradients (:func:`~megatron_zb.runtime.sharded_grads.shard_gradients`): the
        :class:`~megatron_zb.runtime.sharded_grads.ShardedGradSync` reducing each bucket after each W group.
        With megatron-core DDP's ``overlap_grad_reduce``: the :class:`GradSync` that launches each
        bucket's reduce once its last W ran (``None`` otherwise); its errors name ``iteration``, or
        the count of training calls when the caller named none."""
        sharded = sharded_chunks(chunks)
        if sharded is not None:
            return ShardedGradSync({stages[i]: sg for i, sg in sharded.items()})
        if not overlapping_ddp_chunks(chunks):
            return None
        return GradSync(dict(zip(stages, chunks)), iteration=self._calls if iteration is None else iteration,
                        iteration_name="training call" if iteration is None else "iteration")

    def _execute(self, *, comm: PipeComm, grad_sync: GradSync | ShardedGradSync | None,
                 sync_ctx: contextlib.AbstractContextManager,
                 vocab: VocabPasses | None, **execute_args: Any) -> tuple[list[Any], torch.Tensor, GradSyncReport | None]:
        """:func:`execute` under ``sync_ctx``, then the deadline of the reduces launched from W; on any
        failure abort the p2p (and ``vocab``'s passes), drop the queued W's and the launched reduces,
        and re-raise. Returns the data, the token count and the bucket launches."""
        try:
            with sync_ctx:  # no gradient reduction while W may still add to the gradients
                data, total_tokens = execute(comm=comm, store=self.store, grad_sync=grad_sync, **execute_args)
            report = grad_sync.end() if grad_sync is not None else None
            if grad_sync is not None:  # the deadline of the reduces launched from W (before finalize waits)
                if self._reduce_watchdog is not None:
                    self._reduce_watchdog.stop()
                self._reduce_watchdog = grad_sync.wait_launched(timeout_s=self.options.timeout,
                                                                policy=self.options.wait_policy)
        except BaseException:
            comm.abort()
            if vocab is not None:
                vocab.close()
            self.store.clear()
            if grad_sync is not None:
                grad_sync.end_failed()
            raise
        return data, total_tokens, report


def _check_chunks(schedule: Schedule, rank: int, chunks: list[torch.nn.Module], forward_only: bool) -> list[int]:
    """``rank``'s stages, checked against the model chunks it was given (one chunk per stage) and,
    when training, against every route's needs (e.g. TE modules need W's in B order on every stage)."""
    if not forward_only:
        check_schedule(schedule, chunks)
    stages = schedule.stages_of(rank)
    if len(chunks) != len(stages):
        raise ValueError(f"schedule {schedule.name or '(given)'} places stages {stages} on pipeline rank {rank}, "
                         f"but model has {len(chunks)} chunk(s); build the model for this placement "
                         f"(megatron_zb.model.build_gpt_chunks with stage_to_rank={schedule.stage_to_rank})")
    return stages


def _tensor_shape(config: Any, *, seq_length: int, micro_batch_size: int, decoder_seq_length: int | None,
                  adjust_tensor_shapes_fn: Callable | None) -> Any:
    """The shape of the hidden states sent between stages, as megatron-core's schedules compute it."""
    from megatron.core import parallel_state

    from ..megatron_compat import pipeline_step_functions

    shapes = pipeline_step_functions().get_tensor_shapes(
        seq_length=seq_length, micro_batch_size=micro_batch_size, decoder_seq_length=decoder_seq_length,
        config=config, tp_group=parallel_state.get_tensor_model_parallel_group(),
        cp_group=parallel_state.get_context_parallel_group())
    if adjust_tensor_shapes_fn is not None:
        shapes, _ = adjust_tensor_shapes_fn(shapes, shapes)
    return shapes[0]


def _no_sync_context(config: Any, chunks: list[torch.nn.Module],
                     grad_sync: GradSync | None) -> contextlib.AbstractContextManager:
    """The context that holds gradient reduction back during the schedule: megatron-core's
    ``config.no_sync_func`` (one function, or one per chunk as its interleaved schedule takes),
    overridden by every chunk's own ``no_sync`` when :class:`GradSync` reports the buckets itself."""
    no_sync = [c.no_sync for c in chunks] if grad_sync is not None else config.no_sync_func
    if isinstance(no_sync, list):
        stack = contextlib.ExitStack()
        for f in no_sync:
            stack.enter_context(f())
        return stack
    return no_sync() if no_sync is not None else contextlib.nullcontext()


def _finish_gradients(config: Any, chunks: list[torch.nn.Module], *, grad_sync_launched: bool, schedule: Schedule,
                      total_tokens: torch.Tensor, pp_group: Any, pg_collection: Any,
                      force_all_reduce: bool | None) -> None:
    """After a training iteration, as megatron-core's schedules: start the gradient sync (unless
    :class:`GradSync` launched the buckets as they became ready: launching them again would reduce
    twice), share the token count where the loss is not on the last rank, finalize the gradients."""
    if config.grad_sync_func is not None and not grad_sync_launched:  # one function, or one per chunk
        sync = config.grad_sync_func
        for f, c in zip(sync if isinstance(sync, list) else [sync] * len(chunks), chunks):
            f(c.parameters())
    _share_token_count(config, schedule, total_tokens, pp_group)
    if config.finalize_model_grads_func is not None:
        config.finalize_model_grads_func(
            chunks, total_tokens if config.calculate_per_token_loss else None,
            pg_collection=pg_collection, force_all_reduce=force_all_reduce)


def _share_token_count(config: Any, schedule: Schedule, total_tokens: torch.Tensor, pp_group: Any) -> None:
    """Per-token loss with the loss stage off the last pipeline rank (the V: rank 0): sum the token
    count over the pipeline in place. megatron-core's ``finalize_model_grads`` broadcasts it from the
    last pipeline rank, which in a V counts 0 tokens."""
    if config.calculate_per_token_loss and schedule.stage_to_rank[-1] != pp_group.size() - 1:
        torch.distributed.all_reduce(total_tokens, group=pp_group)


def get_forward_backward_func(schedule: str | Schedule = "zb", **options: Any) -> ZeroBubbleForwardBackward:
    """A drop-in replacement for megatron-core's ``get_forward_backward_func()`` result.

    Args:
        schedule: schedule name (see :class:`ZeroBubbleOptions`).
        **options: further :class:`ZeroBubbleOptions` fields (``memory_limit``, ``costs``, ...).

    Returns:
        a callable with megatron-core's ``forward_backward_func`` keyword signature.
    """
    refusal = (vocab_passes_unsupported(schedule) if isinstance(schedule, Schedule) else
               vocab_passes_unsupported(name=schedule, vocab_parallel=get_spec(schedule).vocab_parallel))
    opts = ZeroBubbleOptions(schedule=schedule, **options)   # (get_spec above also fails early on an unknown name)
    check_lookahead(opts.recv_lookahead)
    _check_vocab_option(opts, refusal)
    return ZeroBubbleForwardBackward(opts)


def _check_vocab_option(options: ZeroBubbleOptions, refusal: str | None) -> None:
    """A schedule with vocabulary-parallel passes (``refusal`` says why one cannot run without the
    model's slices) needs ``options.vocab_parallel``, and that option needs such a schedule."""
    if refusal is not None and options.vocab_parallel is None:
        raise ValueError(refusal)
    if refusal is None and options.vocab_parallel is not None:
        raise ValueError("vocab_parallel (the model's vocabulary slices) needs a schedule with vocabulary-parallel "
                         "passes (e.g. 1f1b-vocab-1, zb-h1-vocab-1); this one places none")

"""The drop-in ``forward_backward_func``: megatron-core's signature, any schedule of the library."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from ..schedules.costs import CostModel
from ..schedules.ir import Schedule, vocab_passes_unsupported
from ..schedules.registry import build_schedule, get_spec
from .executor import ActionTiming, LoopOverhead, RankPlan, StageRuntime, execute, plan_rank
from .rank_plan import RECV_LOOKAHEAD, check_lookahead
from .grad_sync import GradSync, GradSyncReport, overlapping_ddp_chunks
from .memory import ActivationMemoryTracker
from ..peer_wait import WaitPolicy, Watchdog
from .channels import channels_for
from .p2p import PipeComm
from .routes import check_schedule, install_routes
from .wgrad_store import WeightGradStore


@dataclass
class ZeroBubbleOptions:
    """Options of :func:`get_forward_backward_func` (megatron-core style config dataclass).

    Attributes:
        schedule: a schedule name of the library (``"1f1b"``, ``"zb-h1"``, ``"zb-h2"``, ``"zb"``,
            ``"zb-1p"``, ``"zb-2p"``, ``"zbv"``, ``"v-half"``, ``"v-min"``, ...), or a
            :class:`~megatron_zb.schedules.Schedule` (e.g. loaded from JSON) for fixed ``p`` and ``m``.
        costs: per-stage cost model for cost-aware schedules (times in any unit; memory in units
            of one stage's activation). ``None``: unit costs until measured costs are set with
            :meth:`ZeroBubbleForwardBackward.replan`.
        memory_limit: per-rank activation limit in units of one stage's ``M_B`` (``None``: the
            schedule's default, e.g. ``p`` for ``"zb"``).
        num_chunks: model chunks per rank for interleaved placements.
        timeout: seconds any single p2p transfer, and any data-parallel reduce launched from W
            (``overlap_grad_reduce``), may take before the run fails with a
            :class:`~megatron_zb.peer_wait.PipelineTimeoutError` naming the rank, the operation and
            the peer (:mod:`megatron_zb.peer_wait`).
        recv_lookahead: how many actions ahead receives are posted, 0 to
            :data:`~megatron_zb.runtime.rank_plan.MAX_RECV_LOOKAHEAD` (each direction of a pair of
            ranks has its own communicators, so posting early never holds a send back); default
            :data:`~megatron_zb.runtime.rank_plan.RECV_LOOKAHEAD`.
        wait_policy: how p2p and the data-parallel reduces wait (:class:`~megatron_zb.peer_wait.WaitPolicy`);
            ``None`` (default): from each group's backend (NCCL: stream waits and a watchdog;
            otherwise host waits with the timeout).
        track_memory: measure bytes of saved activations per iteration (see ``last_peak_bytes``).
        time_actions: record the seconds of every compute action (see ``last_timing``): host
            ``time.perf_counter`` on CPU, CUDA events on a CUDA model (resolved later, with one
            synchronisation: :class:`~megatron_zb.runtime.action_timing.ActionTiming`).
        validate: check the schedule before running it. Turn off only to exercise the runtime's
            own safety nets (p2p timeouts, pending-W check) with deliberately broken schedules.
        vocab_parallel: the model's vocabulary slices
            (:class:`~megatron_zb.runtime.vocab_runtime.VocabParallelModel`), required by -- and only
            allowed with -- a schedule with vocabulary-parallel passes (``1f1b-vocab-1``, ...), with the
            iterator of micro batches every rank reads for them (docs/vocab_parallel.md).
    """

    schedule: str | Schedule = "zb"
    costs: CostModel | None = None
    memory_limit: float | None = None
    num_chunks: int = 2
    timeout: float = 120.0
    recv_lookahead: int = RECV_LOOKAHEAD
    wait_policy: WaitPolicy | None = None
    track_memory: bool = False
    time_actions: bool = False
    validate: bool = True
    vocab_parallel: Any = None


@dataclass
class ZeroBubbleForwardBackward:
    """Callable with megatron-core's ``forward_backward_func`` signature.

    Holds the schedule (rebuilt when ``num_microbatches`` or the costs change), its lowered and
    checked per-rank plan (built on the first call for a ``(p, m)``, reused by every later
    call), its weight-gradient ``store`` (every call's B's queue into it, its W's run it), and,
    after each call, the measured ``last_timing`` (on a CUDA model unresolved: call its ``resolve()``
    -- one synchronisation -- or ``resolve_timings`` over several calls before reading its
    ``records``) and ``last_peak_bytes`` when asked for, and
    with megatron-core DDP's ``overlap_grad_reduce`` the bucket launches in ``last_grad_sync``.
    ``iteration`` is the caller's training iteration, for the errors that name a late reduce (the
    trainer sets it: ``SchedulePlanner.begin_iteration``); left ``None`` (Megatron-LM's loop), the
    errors name the count of training calls of this object instead ("training call 2").
    ``last_overhead`` (always measured) splits the last call's executor time into compute actions,
    p2p calls and the runtime's own overhead; ``overhead`` sums it over every call so far (reset it
    with ``fb.overhead = LoopOverhead()``).
    """

    options: ZeroBubbleOptions
    store: WeightGradStore = field(default_factory=WeightGradStore)
    last_timing: ActionTiming | None = None
    last_peak_bytes: int | None = None
    last_memory: ActivationMemoryTracker | None = None  # the last call's tracker (per-action bytes)
    last_grad_sync: GradSyncReport | None = None
    last_overhead: LoopOverhead | None = None
    overhead: LoopOverhead = field(default_factory=LoopOverhead)
    iteration: int | None = None
    _calls: int = 0  # training (not forward-only) calls so far
    _reduce_watchdog: Watchdog | None = None  # NCCL: the last call's data-parallel reduces
    _cache: dict[tuple[int, int], Schedule] = field(default_factory=dict)
    _plans: dict[tuple[int, int, int, bool], RankPlan] = field(default_factory=dict)

    def schedule_for(self, num_ranks: int, num_microbatches: int) -> Schedule:
        """The schedule used for ``p`` ranks and ``m`` microbatches (built once, then cached)."""
        fixed = self.options.schedule
        if isinstance(fixed, Schedule):
            if (fixed.num_ranks, fixed.num_microbatches) != (num_ranks, num_microbatches):
                raise ValueError(f"the given schedule is for {fixed.num_ranks} pipeline ranks and "
                                 f"{fixed.num_microbatches} microbatches, but this run has {num_ranks} ranks and "
                                 f"{num_microbatches} microbatches")
            return fixed
        key = (num_ranks, num_microbatches)
        if key not in self._cache:
            self._cache[key] = build_schedule(
                self.options.schedule, num_ranks=num_ranks, num_microbatches=num_microbatches,
                costs=self.options.costs, memory_limit=self.options.memory_limit,
                num_chunks=self.options.num_chunks)
        return self._cache[key]

    def plan_for(self, num_ranks: int, num_microbatches: int, rank: int, *, forward_only: bool = False) -> RankPlan:
        """``rank``'s lowered and checked plan of :meth:`schedule_for` (built once, then cached)."""
        key = (num_ranks, num_microbatches, rank, forward_only)
        if key not in self._plans:
            self._plans[key] = plan_rank(self.schedule_for(num_ranks, num_microbatches), rank=rank,
                                         forward_only=forward_only, validate=self.options.validate,
                                         recv_lookahead=self.options.recv_lookahead)
        return self._plans[key]

    def install_schedule(self, schedule: Schedule) -> None:
        """Use ``schedule`` for its ``(p, m)`` from now on (e.g. one built on another rank and
        broadcast, so that every rank runs the identical action lists)."""
        _check_vocab_option(self.options, vocab_passes_unsupported(schedule))
        self._cache[(schedule.num_ranks, schedule.num_microbatches)] = schedule
        self._drop_plans(schedule.num_ranks, schedule.num_microbatches)

    def replan(self, costs: CostModel, memory_limit: float | None = None) -> None:
        """Use measured ``costs`` (and optionally a new limit) from the next iteration on."""
        self.options.costs = costs
        if memory_limit is not None:
            self.options.memory_limit = memory_limit
        self._cache.clear()
        self._plans.clear()

    def _drop_plans(self, num_ranks: int, num_microbatches: int) -> None:
        for key in [k for k in self._plans if k[:2] == (num_ranks, num_microbatches)]:
            del self._plans[key]

    def __call__(self, *, forward_step_func: Callable, data_iterator: Iterator | list[Iterator] | None,
                 model: torch.nn.Module | list[torch.nn.Module], num_microbatches: int, seq_length: int,
                 micro_batch_size: int, decoder_seq_length: int | None = None, forward_only: bool = False,
                 collect_non_loss_data: bool = False, first_val_step: bool | None = None,
                 adjust_tensor_shapes_fn: Callable | None = None, p2p_communicator: Any = None,
                 pg_collection: Any = None, force_all_reduce: bool | None = False) -> list[Any]:
        """One iteration, as megatron-core's ``forward_backward_func``: plan this rank's part of the
        schedule, execute it with gradient reduction held back, then finish the gradients; returns
        the last stage's forward data (reduced losses) in microbatch order (a vocabulary-parallel
        schedule also reads ``num_microbatches`` micro batches of ``options.vocab_parallel.data_iterator``)."""
        from megatron.core import parallel_state
        from megatron.core.utils import get_model_config

        self._begin_call(forward_only)
        install_routes()
        chunks = model if isinstance(model, list) else [model]
        iters = data_iterator if isinstance(data_iterator, list) else [data_iterator] * len(chunks)
        config = get_model_config(chunks[0])
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        p, rank = pp_group.size(), pp_group.rank()
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
        if self.options.track_memory:
            memory = ActivationMemoryTracker(p for c in chunks for p in c.parameters())
        comm = PipeComm(channels=channels, rank=rank,
                        timeout=self.options.timeout, policy=self.options.wait_policy, memory=memory,
                        max_outstanding_sends=plan.program.max_outstanding_sends)
        if config.timers is not None:
            config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
        grad_sync = None if forward_only else self._grad_sync(chunks, stages)
        sync_ctx = _no_sync_context(config, chunks, grad_sync)
        overhead = LoopOverhead()
        # created last: on CUDA it records the iteration's start event (ActionTiming)
        timing = ActionTiming(device=runtime.device) if self.options.time_actions else None
        if timing is not None and runtime.vocab is not None:
            runtime.vocab.timing = timing   # T's deferred weight gradients and the barriers on the actions' clock
        data, total_tokens = self._execute(
            comm=comm, grad_sync=grad_sync, sync_ctx=sync_ctx, plan=plan,
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
        self._keep_measurements(timing, overhead, memory)
        return data

    # ------------------------------------------------------------------ the steps of one call
    def _begin_call(self, forward_only: bool) -> None:
        """Count a training call; fail now if the last call's data-parallel reduces were late."""
        if not forward_only:
            self._calls += 1
            if self._reduce_watchdog is not None:
                self._reduce_watchdog.check()  # the last call's reduces, if one was late

    def _grad_sync(self, chunks: list[torch.nn.Module], stages: list[int]) -> GradSync | None:
        """With megatron-core DDP's ``overlap_grad_reduce``: the :class:`GradSync` that launches each
        bucket's reduce once its last W ran (``None`` otherwise)."""
        if not overlapping_ddp_chunks(chunks):
            return None
        return GradSync(dict(zip(stages, chunks)), iteration=self._calls if self.iteration is None else self.iteration,
                        iteration_name="training call" if self.iteration is None else "iteration")

    def _execute(self, *, comm: PipeComm, grad_sync: GradSync | None, sync_ctx: contextlib.AbstractContextManager,
                 **execute_args: Any) -> tuple[list[Any], torch.Tensor]:
        """:func:`execute` under ``sync_ctx``, then the deadline of the reduces launched from W; on any
        failure abort the p2p, drop the queued W's and the launched reduces, and re-raise."""
        try:
            with sync_ctx:  # no gradient reduction while W may still add to the gradients
                result = execute(comm=comm, store=self.store, grad_sync=grad_sync, **execute_args)
            self.last_grad_sync = grad_sync.end() if grad_sync is not None else None
            if grad_sync is not None:  # the deadline of the reduces launched from W (before finalize waits)
                if self._reduce_watchdog is not None:
                    self._reduce_watchdog.stop()
                self._reduce_watchdog = grad_sync.wait_launched(timeout_s=self.options.timeout,
                                                                policy=self.options.wait_policy)
        except BaseException:
            comm.abort()
            if execute_args["runtime"].vocab is not None:
                execute_args["runtime"].vocab.close()
            self.store.clear()
            if grad_sync is not None:
                grad_sync.end_failed()
            raise
        return result

    def _keep_measurements(self, timing: ActionTiming | None, overhead: LoopOverhead,
                           memory: ActivationMemoryTracker | None) -> None:
        """Publish the call's measurements (``last_timing``, ``last_overhead``, ``overhead``, memory)."""
        self.last_timing = timing
        self.last_overhead = overhead
        self.overhead.merge(overhead)
        self.last_peak_bytes = memory.peak_bytes if memory is not None else None
        self.last_memory = memory


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

"""The drop-in ``forward_backward_func``: megatron-core's signature, any schedule of the library."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from ..schedules.costs import CostModel
from ..schedules.ir import Schedule
from ..schedules.registry import build_schedule, get_spec
from .executor import ActionTiming, LoopOverhead, RankPlan, StageRuntime, execute, plan_rank
from .rank_plan import RECV_LOOKAHEAD
from .grad_sync import GradSync, GradSyncReport, overlapping_ddp_chunks
from .memory import ActivationMemoryTracker
from ..peer_wait import WaitPolicy, Watchdog
from .p2p import PipeComm, pipe_channels
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
        recv_lookahead: how many actions ahead receives are posted (each direction of a pair of
            ranks has its own communicator, so posting early never holds a send back); default
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
        from megatron.core import parallel_state
        from megatron.core.utils import get_model_config

        from ..megatron_compat import pipeline_step_functions

        if not forward_only:
            self._calls += 1
            if self._reduce_watchdog is not None:
                self._reduce_watchdog.check()  # the last call's reduces, if one was late
        install_routes()
        chunks = model if isinstance(model, list) else [model]
        iters = data_iterator if isinstance(data_iterator, list) else [data_iterator] * len(chunks)
        config = get_model_config(chunks[0])
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        p, rank = pp_group.size(), pp_group.rank()
        sched = self.schedule_for(p, num_microbatches)
        plan = self.plan_for(p, num_microbatches, rank, forward_only=forward_only)
        if not forward_only:
            check_schedule(sched, chunks)  # e.g. TE modules need W's in B order on every stage
        stages = sched.stages_of(rank)
        if len(chunks) != len(stages):
            raise ValueError(f"schedule {sched.name or '(given)'} places stages {stages} on pipeline rank {rank}, "
                             f"but model has {len(chunks)} chunk(s); build the model for this placement "
                             f"(megatron_zb.model.build_gpt_chunks with stage_to_rank={sched.stage_to_rank})")
        tp_group = parallel_state.get_tensor_model_parallel_group()
        cp_group = parallel_state.get_context_parallel_group()
        get_tensor_shapes = pipeline_step_functions().get_tensor_shapes
        shapes = get_tensor_shapes(seq_length=seq_length, micro_batch_size=micro_batch_size,
                                   decoder_seq_length=decoder_seq_length, config=config,
                                   tp_group=tp_group, cp_group=cp_group)
        if adjust_tensor_shapes_fn is not None:
            shapes, _ = adjust_tensor_shapes_fn(shapes, shapes)
        device = next(chunks[0].parameters()).device
        runtime = StageRuntime(chunks=dict(zip(stages, chunks)), data_iterators=dict(zip(stages, iters)),
                               tensor_shape=shapes[0], dtype=config.pipeline_dtype or torch.float32,
                               device=device)
        memory = None
        if self.options.track_memory:
            memory = ActivationMemoryTracker(p for c in chunks for p in c.parameters())
        comm = PipeComm(channels=pipe_channels(pp_group, timeout=self.options.timeout), rank=rank,
                        timeout=self.options.timeout, policy=self.options.wait_policy, memory=memory,
                        max_outstanding_sends=plan.program.max_outstanding_sends)

        if config.timers is not None:
            config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
        no_sync = config.no_sync_func
        store = self.store
        grad_sync = None
        if not forward_only and overlapping_ddp_chunks(chunks):
            grad_sync = GradSync(dict(zip(stages, chunks)),
                                 iteration=self._calls if self.iteration is None else self.iteration,
                                 iteration_name="training call" if self.iteration is None else "iteration")
            no_sync = [c.no_sync for c in chunks]  # every chunk, whatever config says: GradSync reports
        if isinstance(no_sync, list):  # one per chunk, as megatron-core's interleaved schedule takes
            sync_ctx: contextlib.AbstractContextManager = contextlib.ExitStack()
            for f in no_sync:
                sync_ctx.enter_context(f())
        else:
            sync_ctx = no_sync() if no_sync is not None else contextlib.nullcontext()
        overhead = LoopOverhead()
        # created last: on CUDA it records the iteration's start event (ActionTiming)
        timing = ActionTiming(device=runtime.device) if self.options.time_actions else None
        try:
            with sync_ctx:  # no gradient reduction while W may still add to the gradients
                data, total_tokens = execute(
                    plan=plan, runtime=runtime, store=store, forward_step_func=forward_step_func, config=config,
                    comm=comm, collect_non_loss_data=collect_non_loss_data, cp_group_size=cp_group.size(),
                    first_val_step=first_val_step, timing=timing, memory=memory, grad_sync=grad_sync,
                    overhead=overhead)
            self.last_grad_sync = grad_sync.end() if grad_sync is not None else None
            if grad_sync is not None:  # the deadline of the reduces launched from W (before finalize waits)
                if self._reduce_watchdog is not None:
                    self._reduce_watchdog.stop()
                self._reduce_watchdog = grad_sync.wait_launched(timeout_s=self.options.timeout,
                                                                policy=self.options.wait_policy)
        except BaseException:
            comm.abort()
            store.clear()
            if grad_sync is not None:
                grad_sync.end_failed()
            raise
        if not forward_only:
            # with overlap, the buckets were launched as they became ready (GradSync): calling
            # grad_sync_func (megatron-core's start_grad_sync) again would launch them twice
            if config.grad_sync_func is not None and grad_sync is None:  # one function, or one per chunk
                sync = config.grad_sync_func
                for f, c in zip(sync if isinstance(sync, list) else [sync] * len(chunks), chunks):
                    f(c.parameters())
            if config.calculate_per_token_loss and sched.stage_to_rank[-1] != p - 1:
                # megatron-core's finalize_model_grads broadcasts the token count from the last
                # pipeline rank; in a V the loss stage is on rank 0 (the others count 0 tokens).
                torch.distributed.all_reduce(total_tokens, group=pp_group)
            if config.finalize_model_grads_func is not None:
                config.finalize_model_grads_func(
                    chunks, total_tokens if config.calculate_per_token_loss else None,
                    pg_collection=pg_collection, force_all_reduce=force_all_reduce)
        if config.timers is not None:
            config.timers("forward-backward").stop()
        self.last_timing = timing
        self.last_overhead = overhead
        self.overhead.merge(overhead)
        self.last_peak_bytes = memory.peak_bytes if memory is not None else None
        self.last_memory = memory
        return data


def get_forward_backward_func(schedule: str | Schedule = "zb", **options: Any) -> ZeroBubbleForwardBackward:
    """A drop-in replacement for megatron-core's ``get_forward_backward_func()`` result.

    Args:
        schedule: schedule name (see :class:`ZeroBubbleOptions`).
        **options: further :class:`ZeroBubbleOptions` fields (``memory_limit``, ``costs``, ...).

    Returns:
        a callable with megatron-core's ``forward_backward_func`` keyword signature.
    """
    if not isinstance(schedule, Schedule):
        get_spec(schedule)  # fail early on an unknown name
    return ZeroBubbleForwardBackward(ZeroBubbleOptions(schedule=schedule, **options))

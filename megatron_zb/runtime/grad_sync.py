"""Data-parallel gradient reduction overlapped with a zero-bubble schedule (``--overlap-grad-reduce``).

megatron-core's DDP (``overlap_grad_reduce=True``) launches a bucket's all-reduce (or, with the
distributed optimizer, reduce-scatter) when every parameter of the bucket was reported ready
by the gradient-accumulator hook during the *last* microbatch's backward, i.e. outside
``no_sync``. Under a zero-bubble schedule that moment is wrong for weights: their gradient is
complete only after their last W. :class:`GradSync` reports readiness itself instead, while the
whole iteration runs inside ``no_sync`` (so DDP's own hooks only accumulate, never register):

* a weight whose gradient work went through the weight-gradient store is ready right after its
  last W entry of the iteration has added into ``main_grad`` (the store's per-entry
  ``on_params_done`` reports, :attr:`WeightGradStore.report_per_entry`) -- the contract of
  Transformer Engine's ``register_wgrad_accumulation_and_reduce_hooks`` for its delayed wgrad;
* every other parameter of a stage (layer norms, biases, embeddings, weights of ``BW``
  actions) is ready after the stage's last B/BW;
* a weight whose stage runs a ``BW`` after its last ``W`` waits for that ``BW``.

Readiness goes to megatron-core's own ``register_grad_ready`` of the parameter's bucket group
(with that group's ``is_last_microbatch`` raised for the call only), so megatron-core decides
when to launch: not at all in the first iteration (it records the per-parameter counts and
launches in ``finish_grad_sync``), from the second on as soon as the bucket group is complete.
Every launch is megatron-core's ``start_grad_sync``, so its NaN/Inf check of the bucket
(``DistributedDataParallelConfig.check_for_nan_in_grad``, ``--check-for-nan-in-loss-and-grad``) sees
the gradients after the last W that adds into them: a deferred W cannot hide a NaN from it.
Every stage is handled on its own (plain, interleaved and V placements: a V rank's two chunks
finish at different times). Each launch is recorded (:class:`BucketLaunch`) with its time and
how many compute actions of the iteration had finished, for the overlap evidence in tests and
benchmarks (:class:`GradSyncReport`).

**Dead peers.** Each launched reduce is kept with what it waits for (which reduce, stage, bucket,
iteration, the peer ranks of its group); :meth:`GradSync.wait_launched` applies the deadline rule
of :mod:`megatron_zb.runtime.peer_wait` to them before megatron-core's ``finish_grad_sync`` waits: on gloo
a timed host wait at the point where megatron-core's wait would block the host anyway, on NCCL no
host wait at all (a watchdog thread over ``is_completed()``; megatron-core's untimed ``wait()`` only
orders the stream). A dead or frozen data-parallel peer then ends the run with a
:class:`~megatron_zb.runtime.peer_wait.PipelineTimeoutError` naming all of that. The first iteration's
reduces (launched by megatron-core's ``finish_grad_sync`` itself) and the reduces without overlap
are megatron-core's synchronous collectives: their bound is the process group's own timeout
(``--distributed-timeout-minutes``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from .peer_wait import Awaited, WaitPolicy, Watchdog, Watched, wait_host
from ..schedules import Action, Op
from .wgrad_store import WeightGradStore

__all__ = ["BeforeReduceHook", "BucketLaunch", "GradSync", "GradSyncError", "GradSyncReport", "overlapping_ddp_chunks",
           "set_before_reduce_hook"]

BeforeReduceHook = Callable[[int], None]
"""A fault-injection hook: called with :attr:`GradSync.iteration` (see :func:`set_before_reduce_hook`)."""

_before_reduce_hook: BeforeReduceHook | None = None


def set_before_reduce_hook(hook: BeforeReduceHook | None) -> None:
    """Install ``hook`` in this process, for fault injection (tests only; ``None``, the default, removes
    it): every :class:`GradSync` calls ``hook(iteration)`` once per iteration, just before it reports the
    iteration's first parameters ready -- the point where its first data-parallel reduce can launch.
    ``tests/training/test_dead_peer.py`` installs one that freezes one rank there (``SIGSTOP``), as a
    frozen node would. The product never installs one."""
    global _before_reduce_hook
    _before_reduce_hook = hook


class GradSyncError(RuntimeError):
    """A bucket was not launched by the end of an iteration, or the model cannot be overlapped."""


@dataclass(frozen=True)
class BucketLaunch:
    """One bucket group's reduce launch.

    Attributes:
        stage: the stage (model chunk) the bucket group belongs to.
        bucket: index of the group in its DDP's ``bucket_groups + expert_parallel_bucket_groups``.
        numel: gradient elements the group reduces (padded buffer sizes).
        time: ``time.perf_counter()`` at the launch, seconds.
        computes_done: compute actions (F, B, W, BW) of the iteration finished before the launch.
    """

    stage: int
    bucket: int
    numel: int
    time: float
    computes_done: int


@dataclass
class GradSyncReport:
    """What :class:`GradSync` saw in one iteration (seconds are ``time.perf_counter()`` values).

    Attributes:
        launches: bucket launches in launch order (empty in megatron-core's first iteration,
            where ``finish_grad_sync`` launches every bucket).
        first_batch: whether megatron-core was still recording its per-parameter counts.
        num_buckets: bucket groups over the rank's chunks.
        last_w_start: start of the rank's last ``W`` (``None``: no W).
        compute_end: end of the rank's last compute action.
        computes: compute actions run.
    """

    launches: list[BucketLaunch] = field(default_factory=list)
    first_batch: bool = True
    num_buckets: int = 0
    last_w_start: float | None = None
    compute_end: float | None = None
    computes: int = 0

    def launched_before_last_w(self) -> int:
        """Bucket groups launched before the rank's last W started."""
        if self.last_w_start is None:
            return 0
        return sum(1 for x in self.launches if x.time < self.last_w_start)

    def hidden_window(self) -> list[float]:
        """Per launch, seconds from the launch to the end of the rank's compute (>= 0 means the
        reduce could run under compute for that long)."""
        end = self.compute_end or 0.0
        return [end - x.time for x in self.launches]


def overlapping_ddp_chunks(chunks: Iterable[Any]) -> bool:
    """Whether the chunks are megatron-core DDP modules with ``overlap_grad_reduce`` on.

    Raises :class:`GradSyncError` when some chunks overlap and others do not (one DDP config
    per model in Megatron).
    """
    flags = [bool(getattr(getattr(c, "ddp_config", None), "overlap_grad_reduce", False)) for c in chunks]
    if any(flags) and not all(flags):
        raise GradSyncError(f"overlap_grad_reduce is on for some model chunks and off for others ({flags}); "
                            f"wrap every chunk with the same DistributedDataParallelConfig")
    return bool(flags) and all(flags)


class GradSync:
    """Reports parameters ready to megatron-core's buckets at the right points of a schedule.

    Built once per ``forward_backward`` call for the rank's chunks (``{stage: DDP module}``),
    all with ``overlap_grad_reduce``, and the call's training ``iteration`` (``iteration_name``:
    what the number counts, ``"iteration"`` or, when the caller does not say, ``"training
    call"``). The executor calls :meth:`begin` before the first action and :meth:`after_compute`
    after every compute action; the store's per-entry reports come in through
    :meth:`_weights_done`. :meth:`end` checks that every bucket group was launched;
    :meth:`wait_launched` then keeps the deadline of the launched reduces.
    """

    def __init__(self, chunks: dict[int, Any], *, iteration: int = 0, iteration_name: str = "iteration") -> None:
        self.chunks = chunks
        self.iteration = iteration  # names the reduces in errors: f"({iteration_name} {iteration})"
        self.iteration_name = iteration_name
        for stage, ddp in chunks.items():
            if getattr(ddp.ddp_config, "reduce_scatter_with_fp32_accumulation", False):
                raise GradSyncError(f"stage {stage}: DistributedDataParallelConfig.reduce_scatter_with_fp32_accumulation "
                                    "gives megatron-core's own reduce handle, which has no Work to wait on with the "
                                    "pipeline timeout; turn it off to overlap the reduce with megatron-zb's schedules")
        self._stage_of: dict[int, int] = {}
        self._group_of: dict[int, tuple[int, int, Any]] = {}   # id(param) -> (stage, index, group)
        self._params: dict[int, list[torch.Tensor]] = {}
        for stage, ddp in chunks.items():
            groups = list(ddp.bucket_groups) + list(ddp.expert_parallel_bucket_groups)
            index = {id(g): i for i, g in enumerate(groups)}
            self._params[stage] = [p for p in ddp.module.parameters() if p in ddp.param_to_bucket_group]
            for p in self._params[stage]:
                g = ddp.param_to_bucket_group[p]
                self._stage_of[id(p)] = stage
                self._group_of[id(p)] = (stage, index[id(g)], g)
        self._groups = [(s, i, g) for s, ddp in chunks.items()
                        for i, g in enumerate(list(ddp.bucket_groups) + list(ddp.expert_parallel_bucket_groups))]
        self.store: WeightGradStore | None = None
        self.report = GradSyncReport()
        self._last_backward: dict[int, int] = {}
        self._backward_done: set[int] = set()
        self._last_w = -1
        self._computes = 0
        self._in_flight: list[Watched] = []   # the launched reduces' works, oldest first
        self._before_first_report = False  # the fault-injection hook is still to be called (set_before_reduce_hook)

    # ------------------------------------------------------------------ per iteration
    def begin(self, *, actions: tuple[Action, ...], store: WeightGradStore) -> None:
        """Start an iteration over ``actions`` (the rank's plan); hook into ``store``."""
        self._in_flight = []
        self._before_first_report = _before_reduce_hook is not None
        self._last_backward = {}
        self._last_w, n = -1, 0
        for a in actions:
            if a.op in (Op.B, Op.BW):
                self._last_backward[a.stage] = n
            elif a.op is Op.W:
                self._last_w = n
            if a.op.is_compute:
                n += 1
        self._backward_done = set()
        self._computes = 0
        first = any(g.is_first_batch for _, _, g in self._groups)
        self.report = GradSyncReport(first_batch=first, num_buckets=len(self._groups))
        self.store = store
        store.on_params_done = self._weights_done
        store.report_per_entry = True

    def after_compute(self, a: Action, start: float) -> None:
        """After compute action ``a`` (started at ``start``, perf_counter seconds)."""
        n = self._computes
        self._computes = n + 1
        if n == self._last_w:
            self.report.last_w_start = start
        if a.op is not Op.F and self._last_backward.get(a.stage) == n:
            self._backward_done.add(a.stage)
            store = self.store
            assert store is not None
            # what is final now: everything the store does not hold work for any more
            self._ready([p for p in self._params[a.stage] if store.remaining_w(p) in (None, 0)])
        self.report.compute_end = time.perf_counter()

    def end(self) -> GradSyncReport:
        """Check that every bucket group was launched (from megatron-core's second iteration)."""
        self.report.computes = self._computes
        self.end_failed()
        if not self.report.first_batch:
            missing = [(s, i, len(g.params) - len(g.per_param_grad_ready_counts))
                       for s, i, g in self._groups if g.grad_reduce_handle is None]
            if missing:
                raise GradSyncError("iteration ended with data-parallel bucket groups not launched (stage, bucket, "
                                    f"parameters not reported ready): {missing}")
        return self.report

    def end_failed(self) -> None:
        """Unhook from the store after a failed iteration (no check)."""
        if self.store is not None:
            self.store.on_params_done = None
            self.store.report_per_entry = False

    # ------------------------------------------------------------------ readiness
    def _weights_done(self, params: tuple[torch.Tensor, ...]) -> None:
        """The store ran the last W entry of ``params``: ready unless their stage still has a B/BW."""
        self._ready([p for p in params if self._stage_of.get(id(p)) in self._backward_done])

    def _ready(self, params: list[torch.Tensor]) -> None:
        if params and self._before_first_report:
            self._before_first_report = False
            hook = _before_reduce_hook
            if hook is not None:
                hook(self.iteration)
        for p in params:
            entry = self._group_of.get(id(p))
            if entry is None:
                continue  # not in a DDP bucket (requires_grad False)
            stage, index, group = entry
            if p in group.per_param_grad_ready_counts:
                continue  # reported already (a W param also final at its stage's last B)
            launched = group.grad_reduce_handle is not None
            group.is_last_microbatch = True
            try:
                group.register_grad_ready(p, self.chunks[stage].force_all_reduce)
            finally:
                group.is_last_microbatch = False
            if not launched and group.grad_reduce_handle is not None:
                self.report.launches.append(BucketLaunch(
                    stage=stage, bucket=index, numel=sum(b.grad_data.numel() for b in group.buckets),
                    time=time.perf_counter(), computes_done=self._computes))
                self._keep_in_flight(stage, index, group)

    # ------------------------------------------------------------------ dead peers
    def _keep_in_flight(self, stage: int, index: int, group: Any) -> None:
        """Keep the works of the reduce just launched for ``group`` with what they wait for."""
        _, kind, peers = _reduce_group(group, self.chunks[stage].force_all_reduce)
        awaited = Awaited(f"rank {dist.get_rank()}", f"data-parallel {kind} of stage {stage}, bucket {index} "
                          f"({self.iteration_name} {self.iteration})", peers)
        handle = group.grad_reduce_handle  # megatron-core's coalescing manager (its works), or one Work
        now = time.monotonic()
        self._in_flight += [(w, now, awaited) for w in getattr(handle, "works", [handle])]

    def wait_launched(self, *, timeout_s: float, policy: WaitPolicy | None = None) -> Watchdog | None:
        """Keep the deadline of this iteration's launched reduces (module docstring), before
        megatron-core's ``finish_grad_sync`` waits for them.

        ``policy`` (default: from the reduce group's backend): ``HOST`` waits for each on the host, at
        most ``timeout_s`` seconds, and raises :class:`~megatron_zb.runtime.peer_wait.PipelineTimeoutError`;
        ``STREAM`` returns a :class:`~megatron_zb.runtime.peer_wait.Watchdog` over them that stops once all
        completed (check it at the next iteration). Returns ``None`` when nothing was launched or
        the waits are done."""
        works, self._in_flight = self._in_flight, []
        if not works:
            return None
        if policy is None:
            pg, _, _ = _reduce_group(self._groups[0][2], False)
            policy = WaitPolicy.for_backend(dist.get_backend(pg))
        if policy is WaitPolicy.STREAM:
            return Watchdog(lambda: works, timeout_s=timeout_s, stop_when_idle=True,
                            name=f"megatron-zb-dp-reduce-watchdog-{self.iteration}")
        for work, _, awaited in works:
            wait_host(work, awaited, timeout_s)
        return None


def _reduce_group(group: Any, force_all_reduce: bool) -> tuple[Any, str, tuple[int, ...]]:
    """A megatron-core bucket group's reduce: its process group, ``"all-reduce"`` or
    ``"reduce-scatter"`` (as ``start_grad_sync`` chooses), the other ranks of the group."""
    distopt = group.ddp_config.use_distributed_optimizer
    pg = group.intra_distributed_optimizer_instance_group if distopt else group.data_parallel_group
    kind = "reduce-scatter" if distopt and not force_all_reduce else "all-reduce"
    me = dist.get_rank()
    return pg, kind, tuple(r for r in dist.get_process_group_ranks(pg) if r != me)

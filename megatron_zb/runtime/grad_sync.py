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
Every stage is handled on its own (plain, interleaved and V placements: a V rank's two chunks
finish at different times). Each launch is recorded (:class:`BucketLaunch`) with its time and
how many compute actions of the iteration had finished, for the overlap evidence in tests and
benchmarks (:class:`GradSyncReport`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from ..schedules import Action, Op
from .wgrad_store import WeightGradStore

__all__ = ["BucketLaunch", "GradSync", "GradSyncError", "GradSyncReport", "overlapping_ddp_chunks"]


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
    all with ``overlap_grad_reduce``. The executor calls :meth:`begin` before the first action
    and :meth:`after_compute` after every compute action; the store's per-entry reports come
    in through :meth:`_weights_done`. :meth:`end` checks that every bucket group was launched.
    """

    def __init__(self, chunks: dict[int, Any]) -> None:
        self.chunks = chunks
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

    # ------------------------------------------------------------------ per iteration
    def begin(self, *, actions: tuple[Action, ...], store: WeightGradStore) -> None:
        """Start an iteration over ``actions`` (the rank's plan); hook into ``store``."""
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

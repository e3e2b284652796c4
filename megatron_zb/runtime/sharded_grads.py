"""Sharded gradients (ZeRO-2) for megatron-core's distributed optimizer under a zero-bubble schedule.

megatron-core's distributed optimizer shards the optimizer state but keeps every parameter's whole
gradient for the iteration: its DDP buffer (``_ParamAndGradBuffer.grad_data``) has one element per
parameter, reduce-scattered once per bucket after the last micro batch. :func:`shard_gradients` frees
that buffer and keeps instead, per chunk,

* per bucket, this rank's **shard** of the reduced gradient (``numel / d`` elements, the gradient dtype):
  what the optimizer steps on;
* **work buffers** (two per rank, each the size of the largest bucket), reused: while a stage's group of
  W's (``--zero-bubble-wgrad-group K``, run layer-major by the store) adds a bucket's weight gradients,
  the bucket's weights point their ``main_grad`` into a work buffer; right after the group's last entry
  into a bucket (the store gives the group's entries up front), the bucket is reduce-scattered into its
  shard (asynchronously: ``reduce_scatter_tensor``, summed into the shard once it completes) while the group
  goes on, and its buffer is zeroed and reused by a later bucket (which waits for that reduce: with two
  buffers, bucket ``j + 2`` waits for bucket ``j``'s);
* a **residual** gradient for the parameters whose gradient comes in B, not W (norms, biases, the word
  embedding's lookup, a weight tied to it): megatron-core's DDP hook adds into their ``main_grad`` during
  B, so it points at a small buffer of their own for the whole iteration, which joins its bucket in the
  stage's last group (or in :meth:`ShardedGrads.finish_grad_sync`).

A weight whose gradient W computes (:func:`deferred_weights`) has, outside its bucket's binding, a
``main_grad`` of no elements: anything that adds into it then fails loudly instead of being lost.

With ``K = m`` (one group per stage) each bucket is reduce-scattered once, from the same sums megatron-
core reduces, into a zeroed shard: the optimizer steps on the same bits. With smaller groups the shard
sums the groups' reductions -- the same terms in another order (a stated tolerance in the tests).

The distributed optimizer reads the shard through :func:`read_gradients_from_shards` (its
``_copy_model_grads_to_main_grads``, which otherwise reads ``main_grad``). Refused here: megatron FSDP,
several distributed-optimizer instances, the precision-aware optimizer, a grad buffer shared with the
parameter all-gather (MXFP8).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from ..param_marks import WGRAD_IN_B

__all__ = ["ShardedGrads", "ShardedGradsError", "WorkBuffers", "bucketed_ddp", "deferred_weights",
           "read_gradients_from_shards", "shard_gradients", "sharded_chunks"]

ATTR = "zb_sharded_grads"
"""The attribute of a megatron-core DDP chunk holding its :class:`ShardedGrads`."""


class ShardedGradsError(RuntimeError):
    """A chunk or optimizer that sharded gradients cannot serve, or a gradient written outside its binding."""


@dataclass(eq=False)
class _Bucket:
    """One megatron-core bucket under sharded gradients."""

    index: int                      # in the chunk's buckets, buffer order
    numel: int                      # padded elements (divisible by the data-parallel size)
    scale: float                    # megatron-core's gradient_scaling_factor
    group: Any                      # the reduce-scatter's process group
    shard: torch.Tensor             # this rank's reduced shard, numel / d
    deferred: list[tuple[torch.Tensor, int]] = field(default_factory=list)   # (param, offset in the bucket)
    residual: list[tuple[torch.Tensor, int, torch.Tensor]] = field(default_factory=list)  # (param, offset, grad)
    reduces: int = 0                # reduce-scatters launched this iteration
    residual_joined: bool = False   # the residual gradients went into a reduce this iteration
    flights: list["_Slot"] = field(default_factory=list)  # slots whose reduce into the shard is in flight, launch order


@dataclass(eq=False)
class _Slot:
    """A work buffer: free, bound to a bucket, or the input of a reduce-scatter in flight."""

    data: torch.Tensor
    bucket: _Bucket | None = None
    in_flight: tuple[Any, torch.Tensor | None, _Bucket] | None = None  # (work, temp or None, bucket)
    owner: Any = None  # the ShardedGrads that last bound it (whose finish_grad_sync waits for its reduce)


@dataclass(frozen=True)
class _Group:
    """The W group running: its entries' parameters, whether it is the stage's last, and per entry index the
    buckets whose last entry in the group it is."""

    entries: tuple[tuple[torch.Tensor, ...], ...]
    final: bool
    release: dict[int, list[int]]


_NO_GROUP = _Group((), False, {})


class WorkBuffers:
    """The rank's reusable bucket-sized buffers (shared by its chunks): ``count`` of ``numel`` elements."""

    def __init__(self, numel: int, *, count: int, dtype: torch.dtype, device: torch.device, timeout_s: float) -> None:
        self.slots = [_Slot(torch.zeros(numel, dtype=dtype, device=device)) for _ in range(count)]
        self._bound: list[_Slot] = []   # bound slots, least recently bound first
        self.timeout_s = timeout_s      # how long a slot's reduce-scatter may take to free it [s]

    def acquire(self, evict: Callable[[_Slot], None]) -> _Slot:
        """A free slot (zeroed): a never-bound one, else the one whose reduce finished first, else the least
        recently bound slot after ``evict`` (which reduces its bucket)."""
        free = [s for s in self.slots if s.bucket is None]
        if not free:
            evict(self._bound[0])
            free = [s for s in self.slots if s.bucket is None]
        slot = next((s for s in free if s.in_flight is None), free[0])
        settle(slot, time.monotonic() + self.timeout_s)
        return slot

    def bound(self, slot: _Slot) -> None:
        self._bound.append(slot)

    def unbound(self, slot: _Slot) -> None:
        self._bound.remove(slot)


def settle(slot: _Slot, deadline: float) -> None:
    """Wait for the reduce-scatter reading ``slot`` (if any), and first for every earlier one of its bucket, each
    result added into the shard in launch order (the first writes the shard itself); the slots zeroed. Each wait
    has until ``deadline`` (``time.monotonic()`` seconds)."""
    if slot.in_flight is None:
        return
    bucket = slot.in_flight[2]
    while True:
        s = bucket.flights.pop(0)
        work, temp, _ = s.in_flight
        _wait(work, bucket, deadline)
        if temp is not None:
            bucket.shard.add_(temp)
        s.in_flight = None
        s.data.zero_()
        if s is slot:
            return


def deferred_weights(module: torch.nn.Module) -> set[int]:
    """``id()`` of the parameters whose gradient W adds (megatron-core's tensor-parallel linear layers'
    weights, unless marked to stay in B), minus any that is also a word embedding (its lookup's gradient
    comes in B)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    out, embeddings = set(), set()
    for m in module.modules():
        weight = getattr(m, "weight", None)
        if isinstance(m, VocabParallelEmbedding) and weight is not None:
            embeddings.add(id(weight))
        elif isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and isinstance(weight, torch.nn.Parameter):
            if not getattr(weight, WGRAD_IN_B, False):
                out.add(id(weight))
    return out - embeddings


class ShardedGrads:
    """Sharded gradients of one megatron-core DDP chunk (see the module docstring); built by
    :func:`shard_gradients`, which also puts it on the chunk (``chunk.zb_sharded_grads``).

    Attributes:
        buckets: the chunk's buckets (buffer order, then bucket order).
        reduce_log: ``(bucket index, elements)`` of every reduce-scatter launched this iteration.
    """

    def __init__(self, ddp: Any, work: WorkBuffers, *, timeout_s: float) -> None:
        _check_ddp(ddp)
        self.ddp, self.work, self.timeout_s = ddp, work, timeout_s
        self.buckets: list[_Bucket] = []
        self._of: dict[int, tuple[_Bucket, int]] = {}   # id(deferred param) -> (bucket, offset in bucket)
        self._slot_of: dict[int, _Slot] = {}            # bucket index -> its slot while bound
        self.reduce_log: list[tuple[int, int]] = []
        self._group = _NO_GROUP
        deferred = deferred_weights(ddp.module)
        residual_numel = 0
        for buffer in list(ddp.buffers) + list(ddp.expert_parallel_buffers):
            for bucket in buffer.buckets:
                params = list(bucket.params_list)
                group = ddp.param_to_bucket_group[params[0]].intra_distributed_optimizer_instance_group
                n = bucket.grad_data.numel()
                shard = torch.zeros(n // group.size(), dtype=buffer.grad_dtype, device=bucket.grad_data.device)
                b = _Bucket(index=len(self.buckets), numel=n, scale=bucket.gradient_scaling_factor, group=group,
                            shard=shard)
                for p in params:
                    offset = buffer.param_index_map[p][0] - bucket.offset
                    if id(p) in deferred:
                        b.deferred.append((p, offset))
                        self._of[id(p)] = (b, offset)
                    else:
                        b.residual.append((p, offset, None))  # its gradient: a view of the residual buffer, below
                        residual_numel += p.numel()
                self.buckets.append(b)
            buffer.grad_data.untyped_storage().resize_(0)  # megatron-core's whole-iteration gradient buffer: freed
        dtype = self.buckets[0].shard.dtype if self.buckets else torch.float32
        device = self.buckets[0].shard.device if self.buckets else torch.device("cpu")
        self.residual = torch.zeros(residual_numel, dtype=dtype, device=device)
        start = 0
        for b in self.buckets:
            for i, (p, offset, _) in enumerate(b.residual):
                view = self.residual[start:start + p.numel()].view(p.shape)
                b.residual[i] = (p, offset, view)
                p.main_grad = view
                start += p.numel()
            for p, _ in b.deferred:
                p.main_grad = _UNBOUND(p)

    # ------------------------------------------------------------------ W: binding and reducing
    def begin_group(self, entries: tuple[tuple[torch.Tensor, ...], ...], *, final: bool) -> None:
        """A group of W's starts; ``entries[i]``: the parameters its ``i``-th entry adds into (``final``: the
        stage's last group, after its last B -- a bucket reduced in it takes its residual gradients along).
        Each bucket is reduce-scattered right after the last entry that adds into it, so its reduce runs while
        the group goes on (the group is layer-major: a bucket's entries come together)."""
        last: dict[int, int] = {}  # bucket index -> its last entry in the group
        for i, params in enumerate(entries):
            for p in params:
                where = self._of.get(id(p))
                if where is not None:
                    last[where[0].index] = i
        self._group = _Group(entries, final, {})
        for b, i in last.items():
            self._group.release.setdefault(i, []).append(b)

    def before_entry(self, index: int) -> None:
        """Before the group's entry ``index``: the buckets of its parameters bound to work buffers."""
        g = self._group
        for p in g.entries[index]:
            where = self._of.get(id(p))
            if where is not None and where[0].index not in self._slot_of:
                self._bind(where[0], final=g.final)

    def after_entry(self, index: int) -> None:
        """After the group's entry ``index``: the buckets whose last entry it was, reduce-scattered."""
        g = self._group
        for b in g.release.get(index, ()):
            slot = self._slot_of.get(b)
            if slot is not None:
                self._reduce(slot, final=g.final)

    def after_group(self) -> None:
        """The group ran: every bucket still bound is reduce-scattered (none, unless an entry was evicted)."""
        g = self._group
        for index in list(self._slot_of):
            self._reduce(self._slot_of[index], final=g.final)
        self._group = _NO_GROUP

    def _bind(self, b: _Bucket, *, final: bool) -> None:
        # every bound slot is this chunk's: a group's buckets are all reduced when the group ends
        slot = self.work.acquire(lambda s: self._reduce(s, final=final))
        slot.bucket, slot.owner = b, self
        self._slot_of[b.index] = slot
        self.work.bound(slot)
        for p, offset in b.deferred:
            p.main_grad = slot.data[offset:offset + p.numel()].view(p.shape)

    def _reduce(self, slot: _Slot, *, final: bool) -> None:
        """Launch the reduce-scatter of ``slot``'s bucket into its shard and unbind it."""
        b = slot.bucket
        assert b is not None
        data = slot.data[:b.numel]
        if final and not b.residual_joined:
            for _, offset, grad in b.residual:
                data[offset:offset + grad.numel()].copy_(grad.view(-1))
            b.residual_joined = True
        if b.scale != 1.0:
            data *= b.scale
        op = dist.ReduceOp.AVG if self.ddp.ddp_config.average_in_collective else dist.ReduceOp.SUM
        temp = None if b.reduces == 0 else torch.empty_like(b.shard)
        work = dist.reduce_scatter_tensor(b.shard if temp is None else temp, data, op=op, group=b.group,
                                          async_op=True)
        b.reduces += 1
        self.reduce_log.append((b.index, b.numel))
        for p, _ in b.deferred:
            p.main_grad = _UNBOUND(p)
        slot.in_flight, slot.bucket = (work, temp, b), None
        b.flights.append(slot)
        del self._slot_of[b.index]
        self.work.unbound(slot)

    # ------------------------------------------------------------------ megatron-core's DDP methods
    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """DDP's ``finish_grad_sync``: the residual gradients of buckets whose weights had no W in the last
        group are reduced now; every reduce-scatter completes; the shards hold the iteration's gradients."""
        if force_all_reduce:
            raise ShardedGradsError("force_all_reduce (megatron-core's all-reduce instead of the reduce-scatter) "
                                    "cannot serve sharded gradients")
        for slot in [self._slot_of[i] for i in list(self._slot_of)]:
            self._reduce(slot, final=True)
        for b in self.buckets:
            if b.residual and not b.residual_joined:
                self._bind(b, final=True)
                self._reduce(self._slot_of[b.index], final=True)
        deadline = time.monotonic() + self.timeout_s
        for slot in self.work.slots:
            if slot.in_flight is not None and slot.owner is self:
                settle(slot, deadline)

    def zero_grad_buffer(self) -> None:
        """DDP's ``zero_grad_buffer``: shards and residual gradients zeroed, the iteration's counts reset."""
        for b in self.buckets:
            b.shard.zero_()
            b.reduces, b.residual_joined = 0, False
        self.residual.zero_()
        self.reduce_log = []

    def scale_gradients(self, factor: float) -> None:
        """DDP's ``scale_gradients`` (per-token loss): the shards scaled."""
        for b in self.buckets:
            b.shard *= factor

    def shard_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """The shard of the bucket holding ``param`` (``None``: not in this chunk)."""
        return self._shard_by_param().get(id(param))

    def _shard_by_param(self) -> dict[int, torch.Tensor]:
        if not hasattr(self, "_shards"):
            self._shards = {id(p): b.shard for b in self.buckets for p, *_ in b.deferred + b.residual}
        return self._shards

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this chunk's gradients hold: ``shards``, ``residual`` and megatron-core's freed buffers (0)."""
        return {"shards": sum(b.shard.numel() * b.shard.element_size() for b in self.buckets),
                "residual": self.residual.numel() * self.residual.element_size(),
                "megatron_core_grad_buffers": sum(buf.grad_data.untyped_storage().nbytes()
                                                  for buf in list(self.ddp.buffers)
                                                  + list(self.ddp.expert_parallel_buffers))}


def _wait(work: Any, bucket: _Bucket, deadline: float) -> None:
    """Wait for ``bucket``'s reduce-scatter ``work`` until ``deadline`` (``time.monotonic()`` seconds; gloo: a host
    wait with that timeout; NCCL: stream-ordered, returns at once)."""
    left = max(deadline - time.monotonic(), 0.001)
    from datetime import timedelta

    try:
        if dist.get_backend(bucket.group) == "gloo":
            work.wait(timeout=timedelta(seconds=left))
        else:
            work.wait()
    except RuntimeError as e:
        raise ShardedGradsError(f"rank {dist.get_rank()}: sharded-gradient reduce-scatter of bucket {bucket.index} "
                                f"did not complete within {left:.0f} s: a data-parallel peer died, is frozen or never "
                                f"reached it ({e})") from None


def _UNBOUND(p: torch.Tensor) -> torch.Tensor:
    """The ``main_grad`` of a deferred weight outside its bucket's binding: no elements, so an addition fails."""
    return torch.empty(0, dtype=torch.float32, device=p.device)


def _check_ddp(ddp: Any) -> None:
    cfg = getattr(ddp, "ddp_config", None)
    problems = []
    if cfg is None or not getattr(cfg, "use_distributed_optimizer", False):
        problems.append("the chunk is not megatron-core DDP with use_distributed_optimizer")
    elif getattr(cfg, "use_megatron_fsdp", False):
        problems.append("megatron FSDP")
    elif getattr(cfg, "num_distributed_optimizer_instances", 1) != 1:
        problems.append("num_distributed_optimizer_instances > 1")
    elif getattr(cfg, "reuse_grad_buf_for_mxfp8_param_ag", False):
        problems.append("reuse_grad_buf_for_mxfp8_param_ag (the gradient buffer doubles as the all-gather's)")
    if problems:
        raise ShardedGradsError(f"sharded gradients need megatron-core DDP with the distributed optimizer: "
                                f"{'; '.join(problems)}")


def bucketed_ddp(bucket_size: int, **kwargs: Any) -> Any:
    """megatron-core's ``DistributedDataParallel(**kwargs)`` with buckets of ``bucket_size`` elements on every
    pipeline stage and chunk. megatron-core turns bucketing off on pipeline ranks after the first, for chunks
    after the first, and without ``overlap_grad_reduce`` (one bucket: the whole chunk), where its reduce is off
    the critical path; sharded gradients need the buckets everywhere, since each bucket's work buffer is
    what a rank holds while a group of W's runs. (A subclass whose ``bucket_size`` ignores what megatron-core's
    constructor assigns.)"""
    from megatron.core.distributed import DistributedDataParallel

    class BucketedDDP(DistributedDataParallel):
        @property
        def bucket_size(self) -> int:
            return bucket_size

        @bucket_size.setter
        def bucket_size(self, value: Any) -> None:
            pass  # megatron-core's None (no bucketing here): kept at bucket_size

    BucketedDDP.__qualname__ = "BucketedDDP"
    return BucketedDDP(**kwargs)


def shard_gradients(chunks: list[Any], *, work_buffers: int = 2, timeout_s: float = 300.0) -> list[ShardedGrads]:
    """Shard the gradients of the rank's DDP ``chunks`` (module docstring): megatron-core's gradient buffers
    freed, ``work_buffers`` bucket-sized buffers shared by the chunks, DDP's gradient methods
    (``finish_grad_sync``, ``zero_grad_buffer``, ``scale_gradients``) replaced on each chunk. ``timeout_s``:
    how long a reduce-scatter may take before the run fails naming it."""
    largest, dtype, device = 0, torch.float32, torch.device("cpu")
    for c in chunks:
        _check_ddp(c)
        for buffer in list(c.buffers) + list(c.expert_parallel_buffers):
            dtype, device = buffer.grad_dtype, buffer.grad_data.device
            largest = max([largest] + [b.grad_data.numel() for b in buffer.buckets])
    work = WorkBuffers(largest, count=work_buffers, dtype=dtype, device=device, timeout_s=timeout_s)
    out = []
    for c in chunks:
        sg = ShardedGrads(c, work, timeout_s=timeout_s)
        setattr(c, ATTR, sg)
        c.finish_grad_sync = sg.finish_grad_sync
        c.zero_grad_buffer = sg.zero_grad_buffer
        c.scale_gradients = sg.scale_gradients
        out.append(sg)
    return out


def sharded_chunks(chunks: Iterable[Any]) -> dict[int, ShardedGrads] | None:
    """``{index: ShardedGrads}`` when every chunk's gradients are sharded, ``None`` when none are; a mix raises."""
    found = {i: getattr(c, ATTR, None) for i, c in enumerate(chunks)}
    if all(v is None for v in found.values()):
        return None
    if any(v is None for v in found.values()):
        raise ShardedGradsError("some model chunks have sharded gradients and others not; shard every chunk")
    return found  # type: ignore[return-value]


def read_gradients_from_shards(optimizer: Any, chunks: list[Any]) -> None:
    """Make megatron-core's distributed ``optimizer`` (or each one of a chained optimizer) read the gradients
    from the chunks' shards: its ``_copy_model_grads_to_main_grads`` replaced by the same copy from the
    shard (each parameter's piece at its ``gbuf_local`` range) instead of from ``main_grad``."""
    sharded = [getattr(c, ATTR) for c in chunks]

    def shard(p: torch.Tensor) -> torch.Tensor:
        for sg in sharded:
            s = sg.shard_of(p)
            if s is not None:
                return s
        raise ShardedGradsError(f"parameter {tuple(p.shape)} is in no sharded chunk")

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not hasattr(opt, "_get_model_param_range_map"):
            raise ShardedGradsError(f"{type(opt).__name__} is not megatron-core's DistributedOptimizer")
        if getattr(opt.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
            raise ShardedGradsError("the precision-aware optimizer reads decoupled gradients; not with sharded "
                                    "gradients")
        opt._copy_model_grads_to_main_grads = _copier(opt, shard)


def _copier(opt: Any, shard: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
    def copy_model_grads_to_main_grads() -> None:
        """megatron-core's ``DistributedOptimizer._copy_model_grads_to_main_grads``, reading the shards."""
        for model_groups, main_groups in ((opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
                                          (opt.model_fp32_groups, opt.shard_fp32_groups)):
            for model_group, main_group in zip(model_groups, main_groups):
                for model_param, main_param in zip(model_group, main_group):
                    local = opt._get_model_param_range_map(model_param)["gbuf_local"]
                    main_param.grad = shard(model_param)[local.start:local.end].float()

    return copy_model_grads_to_main_grads


class ShardedGradSync:
    """One iteration of sharded gradients, driven by the executor (as :class:`~.grad_sync.GradSync` is):
    :meth:`begin` makes the store tell the chunks' :class:`ShardedGrads` about every W entry and group
    (:attr:`~megatron_zb.runtime.wgrad_store.WeightGradStore.binder`). The reductions launched from W
    complete in megatron-core's ``finalize_model_grads`` (``finish_grad_sync``, replaced on the chunks)."""

    def __init__(self, by_stage: dict[int, ShardedGrads]) -> None:
        self.by_stage = by_stage
        self.store: Any = None

    def begin(self, *, actions: Any, store: Any) -> None:
        self.store = store
        store.binder = self
        for sg in self.by_stage.values():
            sg.reduce_log = []

    def begin_group(self, stage: int, entries: tuple[tuple[torch.Tensor, ...], ...], *, final: bool) -> None:
        self.by_stage[stage].begin_group(entries, final=final)

    def before_entry(self, stage: int, index: int) -> None:
        self.by_stage[stage].before_entry(index)

    def after_entry(self, stage: int, index: int) -> None:
        self.by_stage[stage].after_entry(index)

    def after_group(self, stage: int) -> None:
        self.by_stage[stage].after_group()

    def after_compute(self, a: Any, start: float) -> None:
        """Nothing to do per action: the store reports the W's."""

    def end(self) -> None:
        self.end_failed()

    def end_failed(self) -> None:
        if self.store is not None:
            self.store.binder = None

    def wait_launched(self, *, timeout_s: float, policy: Any = None) -> None:
        """The reduce-scatters are waited for in ``finish_grad_sync`` (with the chunks' timeout)."""
        return None

"""The cost model shared by the simulator and every cost-aware generator (compute, memory and,
optionally, the data-parallel gradient reduce)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence, Union

from .ir import Op, ScheduleError

PerStage = Union[float, Sequence[float]]
"""A scalar (the same value for every stage) or one value per pipeline stage."""


def _expand(name: str, value: PerStage, num_stages: int, *, positive: bool) -> tuple[float, ...]:
    vals = [float(value)] * num_stages if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(vals) != num_stages:
        raise ScheduleError(f"{name} has {len(vals)} values but the schedule has {num_stages} stages; "
                            f"give one value per stage or a single scalar")
    for s, v in enumerate(vals):
        if math.isnan(v) or v < 0 or (positive and v == 0) or math.isinf(v):
            need = "> 0" if positive else ">= 0"
            raise ScheduleError(f"{name} for stage {s} is {v}; it must be finite and {need}")
    return tuple(vals)


@dataclass(frozen=True)
class DPReduceModel:
    """Sizes and speed of the data-parallel gradient reduce (the :attr:`CostModel.dp_reduce` field).

    The timing rule that uses it lives in :mod:`.timing`; :mod:`.dp_reduce` compares overlap on
    and off and reorders tails. Sizes in bytes, times in the unit of the costs.

    Attributes:
        stage_bytes: gradient bytes of each stage: one value per stage, or one for every stage.
        bucket_bytes: bucket size in bytes (``--ddp-bucket-size`` x element size); ``None``: one
            bucket per stage. One value for every stage, or one per stage (megatron-core keeps one
            bucket on pipeline ranks after the first: give those ``None``).
        bandwidth: bytes per time unit of the data-parallel collective (algorithm bandwidth).
        latency: fixed time per bucket collective (time unit of the costs).
        overlap: ``True``: a bucket is reduced as soon as it is ready (``--overlap-grad-reduce``);
            ``False``: a rank's buckets are reduced after its last compute action.
        wgrad_group: ``None``: the gradients of the whole iteration accumulate and each bucket is
            reduced once, during the stage's last weight-gradient action. ``k``: sharded gradients
            (ZeRO-2): a stage's ``W``'s run in groups of ``k`` micro batches, layer-major (the
            schedule's groups: :func:`~.wgrad_groups.group_wgrads`), and each bucket is reduce-scattered
            once per group, ready as the group reaches its layers -- ``ceil(m / k)`` collectives per
            bucket (``bandwidth`` is then the reduce-scatter's). Needs ``overlap``.
        work_buffers: with ``wgrad_group``, how many bucket-sized buffers a rank's groups write into
            (sharded gradients keep 2): a bucket waits for the reduce of the bucket written that many
            buckets before it on the rank, which frees its buffer, and the group waits with it. ``None``:
            no such wait.
        blocks_compute: the collectives run on the resources the compute uses (gloo on a CPU: TCP copies
            on the same cores), so a rank computes nothing while one of its buckets reduces: the rank's
            next action waits for the buckets a W readied, and with ``work_buffers`` a group writes its
            next bucket only after the previous one's reduce. ``False`` (GPUs: NCCL's kernels beside the
            compute): the reduces overlap the compute.
    """

    stage_bytes: PerStage
    bucket_bytes: float | Sequence[float | None] | None
    bandwidth: float
    latency: float = 0.0
    overlap: bool = True
    wgrad_group: int | None = None
    work_buffers: int | None = None
    blocks_compute: bool = False

    def resolve(self, num_stages: int) -> "DPReduceModel":
        """Check the values; the same model with one byte count per stage."""
        vals = _expand("dp_reduce.stage_bytes", self.stage_bytes, num_stages, positive=False)
        buckets = (self.bucket_bytes if isinstance(self.bucket_bytes, (int, float)) or self.bucket_bytes is None
                   else tuple(self.bucket_bytes))
        if isinstance(buckets, tuple) and len(buckets) != num_stages:
            raise ScheduleError(f"dp_reduce.bucket_bytes has {len(buckets)} values but the schedule has {num_stages} "
                                f"stages; give one value per stage or a single one")
        checks = [("bandwidth", self.bandwidth, True), ("latency", self.latency, False)]
        checks += [(f"bucket_bytes[{s}]", b, True) for s, b in enumerate(buckets if isinstance(buckets, tuple) else
                                                                           [buckets]) if b is not None]
        for name, v, positive in checks:
            if not math.isfinite(v) or v < 0 or (positive and v == 0):
                raise ScheduleError(f"dp_reduce.{name} is {v}; it must be finite and {'> 0' if positive else '>= 0'}")
        if self.wgrad_group is not None and (self.wgrad_group < 1 or not self.overlap):
            raise ScheduleError(f"dp_reduce.wgrad_group is {self.wgrad_group} with overlap={self.overlap}; it must be "
                                f">= 1, and a group's buckets are reduce-scattered as they are ready (overlap=True)")
        if self.work_buffers is not None and (self.work_buffers < 1 or self.wgrad_group is None):
            raise ScheduleError(f"dp_reduce.work_buffers is {self.work_buffers} with wgrad_group={self.wgrad_group}; "
                                f"it must be >= 1, and buffers are what a W group writes into (wgrad_group set)")
        return replace(self, stage_bytes=vals, bucket_bytes=buckets)

    def buckets(self, stage: int) -> list[float]:
        """Bucket sizes (bytes) of ``stage``, in the order they become ready (none for 0 bytes)."""
        total = float(self.stage_bytes if isinstance(self.stage_bytes, (int, float)) else self.stage_bytes[stage])
        size = self.bucket_bytes
        if size is not None and not isinstance(size, (int, float)):
            size = size[stage]
        if total == 0:
            return []
        if size is None or size >= total:
            return [total]
        n = int(total // size)
        sizes = [float(size)] * n
        if total - n * size > 0:
            sizes.append(total - n * size)
        return sizes

    def ready_fractions(self, stage: int) -> list[tuple[float, float]]:
        """``(fraction of the last weight-gradient action done when ready, bytes)`` per bucket."""
        sizes = self.buckets(stage)
        total, done, out = sum(sizes), 0.0, []
        for size in sizes:
            done += size
            out.append((done / total, size))
        return out

    def reduce_time(self, nbytes: float) -> float:
        """Time of one bucket's collective."""
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class VocabCosts:
    """Costs of the vocabulary-parallel passes (the :attr:`CostModel.vocab` field), per *rank*.

    Each rank holds ``1/p`` of the vocabulary, so these are the times of one rank's slice. Times
    in the unit of the costs; memory in the unit of ``mem_b``. The timing rule that uses them is
    in :mod:`.timing` (docs/vocab_parallel_schedules.md).

    Attributes:
        t_if: input embedding forward of the slice (``IF``).
        t_s: output layer forward of the slice (``S``: local logits, max, sum-exp; with one
            barrier also the partial input gradient).
        t_t: output layer backward of the slice (``T``: softmax gradient, partial input gradient,
            weight gradient).
        t_ib: input embedding backward of the slice (``IB``, its weight gradient).
        t_collective: time of one collective over the pipeline group (the broadcast of the last
            stage's output, the all-reduces ``C1``/``C2``, the embedding's all-reduce and the
            broadcast of its gradient). It runs beside compute (a side stream) and occupies no
            rank; what waits for it waits ``t_collective`` after its last input.
        mem_s: activation memory a rank allocates in ``S`` and frees in ``T`` (its logits slice
            and the broadcast input).
    """

    t_if: PerStage = 0.1
    t_s: PerStage = 0.5
    t_t: PerStage = 0.5
    t_ib: PerStage = 0.1
    t_collective: float = 0.0
    mem_s: PerStage = 0.0

    def resolve(self, num_ranks: int) -> "VocabCosts":
        """Check the values; the same costs with one value per rank (tuples)."""
        c = float(self.t_collective)
        if not math.isfinite(c) or c < 0:
            raise ScheduleError(f"vocab.t_collective is {self.t_collective}; it must be finite and >= 0")
        vals = {k: _expand(f"vocab.{k}", getattr(self, k), num_ranks, positive=False)
                for k in ("t_if", "t_s", "t_t", "t_ib", "mem_s")}
        return replace(self, t_collective=c, **vals)


@dataclass(frozen=True)
class CostModel:
    """Per-stage costs of one microbatch, and the activation memory it holds.

    Times are in any consistent unit (the profiler reports milliseconds; the paper's tables are in
    milliseconds). Memory is in bytes or in units of one stage's ``mem_b``; ``memory_limit`` uses
    the same unit and applies to each rank (the sum over the stages a rank holds).

    Attributes:
        t_f: forward time per stage.
        t_b: input-gradient backward time per stage.
        t_w: weight-gradient backward time per stage.
        t_bw: fused backward (``BW``) time per stage, or ``None`` (default): ``t_b + t_w``. A
            runtime whose split backward costs more than its fused one (PyTorch's ``I`` + ``W``
            repeat autograd work its ``B`` does once) has ``t_bw < t_b + t_w``; the timing kernel
            charges it to every ``BW`` action (:meth:`StageCosts.duration`, the one place).
        t_comm: latency of one activation/gradient transfer between two different ranks
            (transfers between stages on the same rank are free).
        mem_b: activation memory allocated by ``F`` and held until ``B`` (or ``BW``).
        mem_w: memory held from ``B`` until ``W`` (``>= 0``). ``B`` changes the held memory by
            ``mem_w - mem_b``: usually a part of what ``F`` saved (``mem_w <= mem_b``: ``B`` frees),
            but it may exceed it (``B`` allocates: with sequence parallelism each ``W`` keeps
            all-gathered tensors, ``T x h`` each, that ``F`` saved ``TP`` times smaller), and then
            a rank's peak can be right after a ``B``. ``W`` frees ``mem_w``; a fused ``BW`` frees
            ``mem_b`` (what its weight gradients gather lives only inside the action, one layer at
            a time, and is not modelled, like every other transient tensor).
        memory_limit: peak activation memory allowed on every rank, or ``None`` for no limit.
        dp_reduce: the data-parallel gradient reduce (:class:`DPReduceModel`: bytes
            per stage, bucket size, bandwidth, overlap on or off), or ``None`` (default): no reduce
            is modelled and every predicted time is the compute's alone. When given, the simulator
            and the generators' timing kernel add each rank's reduce to its end (see
            :mod:`.timing`).
        vocab: costs of the vocabulary-parallel passes (:class:`VocabCosts`, per rank), used
            only by schedules with vocabulary passes (``Schedule.vocab_barriers > 0``); ``None``
            (default): such a schedule is timed with ``VocabCosts()``'s defaults.
    """

    t_f: PerStage = 1.0
    t_b: PerStage = 1.0
    t_w: PerStage = 1.0
    t_comm: float = 0.0
    mem_b: PerStage = 1.0
    mem_w: PerStage | None = None
    memory_limit: float | None = None
    dp_reduce: DPReduceModel | None = None
    vocab: VocabCosts | None = None
    t_bw: PerStage | None = None

    def with_limit(self, memory_limit: float | None) -> "CostModel":
        return replace(self, memory_limit=memory_limit)

    def with_action_overhead(self, overhead: float, *, split_backward: bool) -> "CostModel":
        """Every compute action ``overhead`` longer (a runtime's measured time per action beyond the
        compute); with a fused backward (``split_backward=False``) ``BW = t_b + t_w`` is one action,
        so only ``t_b`` grows (and ``t_bw``, when given)."""
        def plus(v: PerStage) -> PerStage:
            return v + overhead if isinstance(v, (int, float)) else [x + overhead for x in v]
        return replace(self, t_f=plus(self.t_f), t_b=plus(self.t_b),
                       t_w=plus(self.t_w) if split_backward else self.t_w,
                       t_bw=None if self.t_bw is None else plus(self.t_bw))

    def resolve(self, num_stages: int) -> "StageCosts":
        """Check the values and expand scalars to one value per stage."""
        if num_stages < 1:
            raise ScheduleError(f"number of stages must be >= 1, got {num_stages}")
        t_comm = float(self.t_comm)
        if math.isnan(t_comm) or t_comm < 0 or math.isinf(t_comm):
            raise ScheduleError(f"t_comm is {self.t_comm}; it must be finite and >= 0")
        mem_b = _expand("mem_b", self.mem_b, num_stages, positive=False)
        mem_w_raw = self.mem_w if self.mem_w is not None else [b / 2 for b in mem_b]
        mem_w = _expand("mem_w", mem_w_raw, num_stages, positive=False)
        if self.memory_limit is not None and (math.isnan(self.memory_limit) or self.memory_limit <= 0):
            raise ScheduleError(f"memory_limit is {self.memory_limit}; it must be > 0 (or None for no limit)")
        return StageCosts(
            t_f=_expand("t_f", self.t_f, num_stages, positive=True),
            t_b=_expand("t_b", self.t_b, num_stages, positive=True),
            t_w=_expand("t_w", self.t_w, num_stages, positive=False),
            t_comm=t_comm, mem_b=mem_b, mem_w=mem_w, memory_limit=self.memory_limit,
            dp_reduce=None if self.dp_reduce is None else self.dp_reduce.resolve(num_stages),
            vocab=self.vocab,
            t_bw=None if self.t_bw is None else _expand("t_bw", self.t_bw, num_stages, positive=True),
        )


@dataclass(frozen=True)
class StageCosts:
    """A :class:`CostModel` resolved for a given number of stages (tuples, one entry per stage)."""

    t_f: tuple[float, ...]
    t_b: tuple[float, ...]
    t_w: tuple[float, ...]
    t_comm: float
    mem_b: tuple[float, ...]
    mem_w: tuple[float, ...]
    memory_limit: float | None
    dp_reduce: DPReduceModel | None = None  # resolved: one byte count per stage
    vocab: VocabCosts | None = None  # per rank; resolved by the timing kernel, which knows the ranks
    t_bw: tuple[float, ...] | None = None  # fused backward per stage; None: t_b + t_w

    def vocab_for(self, num_ranks: int) -> VocabCosts:
        """The vocabulary passes' costs resolved for ``num_ranks`` (``VocabCosts()`` when unset)."""
        return (self.vocab or VocabCosts()).resolve(num_ranks)

    def duration(self, op: Op | str, stage: int) -> float:
        """Time of one compute action ``op`` on ``stage``."""
        if op == Op.F:
            return self.t_f[stage]
        if op == Op.B:
            return self.t_b[stage]
        if op == Op.W:
            return self.t_w[stage]
        if op == Op.BW:
            return self.t_b[stage] + self.t_w[stage] if self.t_bw is None else self.t_bw[stage]
        raise ScheduleError(f"{op} is not a compute action")

    def backward_alloc(self, stage: int) -> float:
        """What ``B`` on ``stage`` allocates, ``max(0, mem_w - mem_b)`` (``0.0`` exactly when ``B``
        frees): a memory-limited generator reserves it when it admits an ``F`` and checks it at ``B``."""
        extra = self.mem_w[stage] - self.mem_b[stage]
        return extra if extra > 0 else 0.0

    def microbatch_peak(self, stages: Sequence[int]) -> float:
        """The least peak a rank holding ``stages`` (ascending) reaches for one microbatch alone: all
        their ``F`` (``sum mem_b``), or right after the ``B`` of stage ``q`` with the rank's
        shallower stages still held (``sum_{s < q} mem_b[s] + mem_w[q]``), whichever is larger. Any
        schedule passes both points, so no memory limit below this works; running one microbatch
        at a time (``W`` right after its ``B``) needs no more. Equals ``sum mem_b`` (the same float)
        when no ``B`` allocates."""
        total = sum(self.mem_b[s] for s in stages)
        if not any(self.backward_alloc(s) > 0 for s in stages):
            return total
        held, peak = 0.0, total
        for s in stages:
            peak = max(peak, held + self.mem_w[s])
            held += self.mem_b[s]
        return peak

    def memory_delta(self, op: Op | str, stage: int) -> float:
        """Change of held activation memory when ``op`` on ``stage`` runs (``B``: ``mem_w - mem_b``,
        positive when ``B`` allocates)."""
        if op == Op.F:
            return self.mem_b[stage]
        if op == Op.B:
            return self.mem_w[stage] - self.mem_b[stage]
        if op == Op.W:
            return -self.mem_w[stage]
        if op == Op.BW:
            return -self.mem_b[stage]
        return 0.0

"""Sharded gradients (ZeRO-2, ``--data-parallel-sharding-strategy optim_grads``) in the plan: the model state
of each rank, and the weight-gradient group size ``k`` (``--zero-bubble-wgrad-group``) per schedule.

Model state per rank, bytes (``d`` the data-parallel size), as :mod:`megatron_zb.runtime.sharded_grads` keeps it:

* per parameter, :func:`~.memory.bytes_per_parameter`: the 16-bit weight, the fp32 shard of its gradient and
  the distributed optimizer's shard of its state (``2 + 16/d`` in mixed precision, ``4 + 12/d`` in fp32);
* two fp32 work buffers the size of the rank's largest bucket. megatron-core closes a bucket once it holds
  ``--ddp-bucket-size`` elements, so a bucket holds less than that plus its largest parameter: the plan takes
  ``min(stage's deferred parameters, bucket size + largest deferred parameter)``, an upper bound;
* the residual gradient, fp32, of the parameters whose gradient ``B`` adds (not deferred to ``W``): norms,
  biases, the first stage's word and position embeddings (their lookup) and an output layer tied to the word
  embedding (a V: both on rank 0).

Time: the family's schedule with its ``W``'s grouped (:func:`~megatron_zb.schedules.wgrad_groups.group_wgrads`)
is simulated with each bucket of deferred gradients reduce-scattered once per group on the data-parallel
channel (:class:`~megatron_zb.schedules.costs.DPReduceModel` with ``wgrad_group = k``; ring: a bucket of ``n``
bytes sends ``n (d-1)/d`` per GPU at ``Hardware.dp_bytes_per_ms`` and waits ``d - 1`` latencies), written into
the two work buffers in turn (``work_buffers = 2``: a bucket waits for the reduce of the bucket two before it);
with ``Hardware.host_collectives`` (a CPU) the reduces block the compute (``blocks_compute``). The residual
gradients are reduce-scattered once, after the last ``W`` (added to the iteration, not overlapped). The
distributed optimizer (``baseline``) is the same schedule ungrouped, its whole buffer reduce-scattered as
megatron-core does with ``--overlap-grad-reduce``: buckets on the first stage, one per later stage.

The recommendation (``wgrad_group`` ``None``: ``auto``): among the candidates ``k`` (:func:`group_candidates`)
whose peak fits, the smallest -- the least activation memory, as a group holds its ``W`` inputs until it runs
-- whose predicted iteration time is within :data:`GROUP_TIME_TOLERANCE` of the fastest candidate's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

from megatron_zb.schedules import CostModel, Schedule, SimResult, simulate
from megatron_zb.schedules.costs import DPReduceModel
from megatron_zb.schedules.limits import fits as fits_limit
from megatron_zb.schedules.wgrad_groups import group_wgrads

from .hardware import Hardware
from .layout import StageShape
from .memory import FP32, _sizes, bytes_per_parameter
from .model import PlanLayout, PlanModel

__all__ = ["GROUP_TIME_TOLERANCE", "GroupRow", "ShardedStage", "choose_group", "group_candidates", "plan_groups",
           "rank_model_state", "ring_reduce_scatter", "sharded_stage"]

GROUP_TIME_TOLERANCE = 0.05
"""Predicted iteration time a smaller group may cost over the fastest candidate and still be recommended."""
WORK_BUFFERS = 2


@dataclass(frozen=True)
class ShardedStage:
    """What one stage's gradients need with sharded gradients (elements on one GPU).

    Attributes:
        deferred: parameters whose gradient ``W`` adds (the linear layers' weights, an untied output layer).
        largest: the largest of them.
        residual: parameters whose gradient ``B`` adds (norms, biases, embeddings, a tied output layer).
    """

    deferred: float
    largest: float
    residual: float


def sharded_stage(model: PlanModel, par: PlanLayout, shape: StageShape, *, tied_on_rank: bool) -> ShardedStage:
    """The split of ``shape``'s parameters; ``tied_on_rank``: an output layer tied to the word embedding on the
    same rank (a V) keeps a residual gradient, else the output layer is deferred (pretrain_gpt_zb.py refuses a
    tie across ranks with ``optim_grads``)."""
    _, _, q, kv, f, _, gl = _sizes(model, par)
    h = float(model.hidden_size)
    weights = (h * (q + 2 * kv), q * h, h * f * gl, f * h)
    bias = (q + 2 * kv + h + f * gl + h) if model.add_bias_linear else 0.0
    norm = 2 * h if model.normalization == "LayerNorm" else h
    n = shape.num_layers
    deferred, largest, residual = sum(weights) * n, max(weights) if n else 0.0, (bias + 2 * norm) * n
    word = model.padded_vocab_size(par.tp) / par.tp * h
    if shape.embedding:
        residual += word + (model.max_position_embeddings * h if model.position_embedding_type == "learned_absolute"
                            else 0.0)
    if shape.loss:
        residual += norm
        tied = not model.untie_embeddings_and_output_weights and tied_on_rank
        if tied:
            residual += word
        else:
            deferred, largest = deferred + word, max(largest, word)
    return ShardedStage(deferred, largest, residual)


@dataclass
class GroupRow:
    """One candidate's prediction (``k`` ``None``: the distributed optimizer's whole buffer, the baseline).

    Attributes:
        k: micro batches per W group.
        reduces_per_bucket: reduce-scatters of each deferred bucket per iteration (``m / k``; 1 for the baseline).
        iteration_time_ms: simulated makespan (compute and overlapped reduces) + the residual reduce + the
            optimizer step, ms.
        exposed_reduce_ms: reduce time after the last compute action (largest over ranks, residual included), ms.
        activation_bytes, model_state_bytes: per pipeline rank, bytes (peak activations; parameters, gradients,
            optimizer state and, sharded, the work buffers and residual gradients).
        fits: the largest rank's total within the usable memory.
        result: the simulation.
    """

    k: int | None
    reduces_per_bucket: int
    iteration_time_ms: float
    exposed_reduce_ms: float
    activation_bytes: list[float]
    model_state_bytes: list[float]
    fits: bool
    result: SimResult = field(repr=False)

    @property
    def peak_bytes(self) -> float:
        """The largest rank's activations plus model state, bytes."""
        return max(a + p for a, p in zip(self.activation_bytes, self.model_state_bytes))


def group_candidates(m: int) -> list[int]:
    """``1, 2, 4, ...`` dividing ``m``, and ``m`` itself."""
    out, k = [], 1
    while k <= m:
        if m % k == 0:
            out.append(k)
        k *= 2
    return sorted(set(out + [m]))


def ring_reduce_scatter(par: PlanLayout, hw: Hardware) -> tuple[float, float]:
    """``(bandwidth, latency)`` of a ring reduce-scatter over the data-parallel ranks, in bytes of the bucket
    per ms and ms (``bandwidth`` grows by ``d / (d-1)``: each GPU sends ``(d-1)/d`` of the bucket)."""
    d = par.dp
    return hw.dp_bytes_per_ms * d / (d - 1), (d - 1) * hw.p2p_latency_ms


def _reduce_model(stages: Sequence[ShardedStage], par: PlanLayout, hw: Hardware, *, baseline: bool,
                  k: int | None) -> DPReduceModel | None:
    """The reduce of one candidate (``None`` at ``dp`` 1: nothing to reduce)."""
    if par.dp == 1:
        return None
    bandwidth, latency = ring_reduce_scatter(par, hw)
    bucket = FP32 * par.bucket_elements
    if baseline:  # megatron-core: every parameter's gradient, buckets on the first stage only
        sizes = [FP32 * (s.deferred + s.residual) for s in stages]
        return DPReduceModel(stage_bytes=sizes, bucket_bytes=[bucket] + [None] * (len(stages) - 1),
                             bandwidth=bandwidth, latency=latency, blocks_compute=hw.host_collectives)
    return DPReduceModel(stage_bytes=[FP32 * s.deferred for s in stages], bucket_bytes=bucket, bandwidth=bandwidth,
                         latency=latency, wgrad_group=k, work_buffers=WORK_BUFFERS, blocks_compute=hw.host_collectives)


def rank_model_state(stages: Sequence[ShardedStage], ranks: Sequence[int], params: Sequence[float], model: PlanModel,
                 par: PlanLayout, *, sharded: bool) -> list[float]:
    """Per rank, model-state bytes (module doc); ``params`` per rank, ``ranks`` each stage's rank."""
    if not sharded:
        base = dataclasses.replace(par, data_parallel_sharding_strategy="optim")
        return [n * bytes_per_parameter(model, base) for n in params]
    out = [n * bytes_per_parameter(model, par) for n in params]
    bucket = float(par.bucket_elements)
    for r in range(len(out)):
        mine = [s for s, rank in zip(stages, ranks) if rank == r]
        work = max((min(s.deferred, bucket + s.largest) for s in mine), default=0.0)
        out[r] += FP32 * (WORK_BUFFERS * work + sum(s.residual for s in mine))
    return out


def _residual_reduce_ms(stages: Sequence[ShardedStage], ranks: Sequence[int], par: PlanLayout, hw: Hardware) -> float:
    """The largest rank's reduce-scatter of its residual gradients after its last W, ms (0 at ``dp`` 1)."""
    if par.dp == 1:
        return 0.0
    bandwidth, latency = ring_reduce_scatter(par, hw)
    per_rank: dict[int, float] = {}
    for s, r in zip(stages, ranks):
        per_rank[r] = per_rank.get(r, 0.0) + FP32 * s.residual
    return max(latency + b / bandwidth for b in per_rank.values())


def plan_groups(schedule: Schedule, costs: CostModel, *, stages: Sequence[ShardedStage], ranks: Sequence[int],
                params: Sequence[float], model: PlanModel, par: PlanLayout, hw: Hardware, optimizer_ms: float,
                usable_bytes: float, candidates: Sequence[int] | None = None) -> list[GroupRow]:
    """The baseline row, then one row per candidate ``k`` for the split-backward ``schedule`` of stage costs
    ``costs`` (``stages`` and ``ranks`` per stage, ``params`` per rank). ``candidates`` default:
    ``par.wgrad_group`` alone when given, else :func:`group_candidates`."""
    rows = []
    residual_ms = _residual_reduce_ms(stages, ranks, par, hw)
    m = par.num_microbatches
    if candidates is None:
        candidates = [par.wgrad_group] if par.wgrad_group is not None else group_candidates(m)
    for k in [None, *candidates]:
        sched = schedule if k is None else group_wgrads(schedule, k)
        reduce = _reduce_model(stages, par, hw, baseline=k is None, k=k)
        res = simulate(sched, dataclasses.replace(costs, dp_reduce=reduce), enforce_memory=False)
        extra = 0.0 if k is None else residual_ms
        state = rank_model_state(stages, ranks, params, model, par, sharded=k is not None)
        acts = list(res.peak_memory)
        rows.append(GroupRow(k, 1 if k is None else -(-m // k), res.makespan + extra + optimizer_ms,
                             max(res.exposed_reduce) + extra,
                             acts, state, False, res))
        rows[-1].fits = fits_limit(rows[-1].peak_bytes, usable_bytes)
    return rows


def choose_group(rows: Sequence[GroupRow], tolerance: float = GROUP_TIME_TOLERANCE) -> GroupRow | None:
    """The recommended candidate (module doc) among ``rows``' sharded ones, or ``None`` if none fits."""
    ok = [r for r in rows if r.k is not None and r.fits]
    if not ok:
        return None
    fastest = min(r.iteration_time_ms for r in ok)
    return min((r for r in ok if r.iteration_time_ms <= fastest * (1 + tolerance)), key=lambda r: r.k)

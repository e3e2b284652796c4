"""Benchmark section ``dp``: data-parallel gradient reduce, overlapped with the pipeline or not.

An emulated PP x DP cluster (default PP=4 x DP=2, 8 processes): every stage's compute is a sleep
(:class:`~megatron_zb.bench.emulated.SleepClock`, as in :mod:`megatron_zb.bench.emulated`), the
runtime, the weight-gradient store, gloo p2p and megatron-core's ``DistributedDataParallel``
are the real ones. A stage holds ``layers`` weights; its B queues one W entry per weight (last
weight first, each sleeping ``T_W / layers`` and adding into the weight's ``main_grad``), so a
stage's W reports its weights ready one by one, as a real layer stack does. The gradient buffer
of one rank's share is sized so that a gloo all-reduce of it over the data-parallel group takes
about ``reduce_tf`` x ``T_F`` (measured at start-up, once per entry of ``reduce_tfs``). DDP's
bucket size is one weight, so the first stage has ``layers`` buckets (``layers / 2`` on the V);
megatron-core keeps one bucket on every other pipeline rank and on every model chunk after the
first (:func:`reduce_model` describes the same buckets to the simulator).

Each schedule is built once per reduce size with that :class:`~megatron_zb.schedules.costs.DPReduceModel`
in its costs (so the V family's tail is reduce-aware), on global rank 0, and installed on every
rank; overlap off and on run this same schedule. Each round runs, for every schedule, one
iteration with ``overlap_grad_reduce`` off (the whole reduce in ``finalize_model_grads``, after
the rank's last compute action) and one with it on (megatron-zb's
:class:`~megatron_zb.runtime.grad_sync.GradSync` launches each bucket when its weights' last W is
done). Per iteration and rank it records the iteration's ``(start, end)`` (after a barrier), the end
of the rank's last compute action, when ``finalize_model_grads`` returned (every bucket reduced:
the *exposed reduce* is the time between the two) and, with overlap, each bucket launch.

The report (:mod:`megatron_zb.bench.dp_report`) compares the exposed reduce per rank, off and on,
with the simulator's (:func:`~megatron_zb.schedules.dp_reduce.simulate_dp_reduce` with the
measured action durations, p2p latency and the fitted reduce latency and bandwidth).
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..schedules.ir import Op
from .progress import RoundProgress

__all__ = ["DPBenchSpec", "DPStage", "bench_costs", "dp_bench_rank", "fit_reduce", "reduce_model"]


@dataclass(frozen=True)
class DPBenchSpec:
    """What the ``dp`` section runs.

    Attributes:
        schedules: schedule names (each with overlap off and on).
        pp, dp: pipeline and data-parallel sizes (``pp * dp`` processes).
        m: microbatches per iteration.
        t_f, t_b, t_w: seconds of one microbatch through one rank's share of the model.
        layers: weights per rank's share (split alike over its chunks); W entries per W.
        reduce_tfs: target times of the all-reduce of one rank's gradients, in units of ``t_f``;
            each is a row set of its own (gradient buffers sized and schedules built per entry).
        warmup, repeats: untimed and timed rounds per reduce size.
        timeout: seconds a p2p wait may take inside the runtime.
    """

    schedules: tuple[str, ...] = ("zb", "zbv")
    pp: int = 4
    dp: int = 2
    m: int = 8
    t_f: float = 0.03
    t_b: float = 0.03
    t_w: float = 0.03
    layers: int = 4
    reduce_tfs: tuple[float, ...] = (1.0, 3.0)
    warmup: int = 2
    repeats: int = 6
    timeout: float = 120.0


# ---------------------------------------------------------------------- the emulated stage
class _Compute(torch.autograd.Function):
    """F sleeps ``t_f``; B sleeps ``t_b`` and queues one W entry per weight (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, stage, *weights):  # noqa: D401 - autograd signature
        stage.clock.sleep(stage.t_f, Op.F)
        ctx.stage, ctx.in_shape = stage, None if x is None else tuple(x.shape)
        return weights[0].new_zeros(()) if stage.is_last else weights[0].new_zeros(stage.shape)

    @staticmethod
    def backward(ctx, grad):  # noqa: D401 - autograd signature
        from ..runtime.wgrad_store import current_store

        stage: DPStage = ctx.stage
        store = current_store()
        grad_in = None if ctx.in_shape is None else grad.new_zeros(ctx.in_shape)
        if store is None:
            raise RuntimeError("the dp benchmark stage needs split backward (B and W)")
        stage.clock.sleep(stage.t_b, Op.B)
        for w in reversed(stage.weights):   # the last layer's weight gradient first, as in a real stack
            def weight_grad(w: torch.Tensor = w) -> None:
                stage.clock.sleep(stage.t_w / len(stage.weights), Op.W)
                w.main_grad.add_(1.0)
            store.put(weight_grad, params=(w,))
        # what a real deferred-W layer returns (megatron-core's convention): a placeholder weight
        # gradient flagged as already in main_grad, so DDP's hook (which asserts a grad under
        # overlap) adds nothing; the W entries above do the accumulation
        dummies = []
        for w in stage.weights:
            w.grad_added_to_main_grad = True
            dummies.append(torch.empty_like(w))
        return (grad_in, None, *dummies)


class DPStage(torch.nn.Module):
    """One stage (model chunk): ``num_weights`` weights of ``numel`` fp32 elements, sleeping compute.

    Times in seconds (``t_f``, ``t_b``, ``t_w`` of one microbatch through this stage); ``shape``
    is the transfer shape ``[seq, micro_batch, hidden]``; ``config`` an
    :class:`~megatron_zb.bench.emulated.EmulatedConfig` (one per DDP model: its ``no_sync_func``
    and ``finalize_model_grads_func`` are set per run).
    """

    def __init__(self, *, stage: int, num_stages: int, num_weights: int, numel: int, t_f: float, t_b: float,
                 t_w: float, shape: Sequence[int], clock: Any, config: Any) -> None:
        super().__init__()
        from megatron.core.transformer.enums import ModelType

        self.stage, self.is_first, self.is_last = stage, stage == 0, stage == num_stages - 1
        self.t_f, self.t_b, self.t_w = t_f, t_b, t_w
        self.shape, self.clock, self.config = tuple(shape), clock, config
        self.model_type = ModelType.encoder_or_decoder
        self.weights = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(numel)) for _ in range(num_weights)])
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, input_tensor: Any) -> None:
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, (list, tuple)) else input_tensor

    def forward(self, batch: Any = None) -> torch.Tensor:
        return _Compute.apply(None if self.is_first else self.input_tensor, self, *self.weights)


def _config(hidden: int) -> Any:
    """An :class:`~megatron_zb.bench.emulated.EmulatedConfig` with the two fields megatron-core's
    ``MegatronModule.set_is_first_microbatch`` (called on a DDP-wrapped chunk) reads."""
    from .emulated import EmulatedConfig

    config = EmulatedConfig(hidden_size=hidden)
    config.fp8 = config.fp4 = None  # type: ignore[attr-defined]
    return config


def _grad_sync_finisher(marks: dict[str, float]) -> Callable[..., None]:
    """A ``finalize_model_grads_func`` that waits for (overlap) or runs (no overlap) every chunk's
    reduce, then puts the time (``time.perf_counter()``, s) in ``marks["synced"]``."""
    def finish(model: list[Any], *_: Any, **__: Any) -> None:
        for chunk in model:
            chunk.finish_grad_sync()
        marks["synced"] = time.perf_counter()
    return finish


def _build(name: str, spec: DPBenchSpec, *, overlap: bool, numel: int, clock: Any, shape: Sequence[int],
           costs: Any) -> dict[str, Any]:
    """This rank's chunks of schedule ``name`` wrapped in megatron-core DDP by the product's wiring
    (:func:`~megatron_zb.training.wiring.wrap_chunks`; the finalize hook then timestamps the sync), and
    the runtime."""
    from megatron.core import parallel_state

    from ..runtime import get_forward_backward_func
    from ..testing.tiny_gpt import placement_for
    from ..training.run_config import ParallelConfig, PrecisionConfig
    from ..training.wiring import wrap_chunks

    s2r = placement_for(name, spec.pp)
    v = len(s2r) // spec.pp
    rank = parallel_state.get_pipeline_model_parallel_rank()
    config = _config(shape[-1])
    per_chunk = max(1, spec.layers // v)
    stages = [DPStage(stage=s, num_stages=len(s2r), num_weights=per_chunk, numel=numel // (per_chunk * v),
                      t_f=spec.t_f / v, t_b=spec.t_b / v, t_w=spec.t_w / v, shape=shape, clock=clock, config=config)
              for s in range(len(s2r)) if s2r[s] == rank]
    parallel = ParallelConfig(overlap_grad_reduce=overlap, ddp_bucket_size=numel // (per_chunk * v))
    chunks = wrap_chunks(stages, first_last=[(False, False)] * len(stages), parallel=parallel,
                         precision=PrecisionConfig(), device=torch.device("cpu"))
    marks: dict[str, float] = {}
    config.finalize_model_grads_func = _grad_sync_finisher(marks)
    fb = get_forward_backward_func(name, costs=costs, timeout=spec.timeout)
    return dict(fb=fb, chunks=chunks, s2r=s2r, marks=marks)


# ---------------------------------------------------------------------- the reduce and the schedules
def reduce_model(name: str, spec: DPBenchSpec, *, grad_bytes: float, latency: float, bandwidth: float) -> Any:
    """The :class:`~megatron_zb.schedules.costs.DPReduceModel` of schedule ``name`` in this benchmark.

    ``grad_bytes`` per rank's share (each of a rank's ``v`` chunks holds ``1/v``), ``latency`` in
    ms, ``bandwidth`` in bytes/ms. Buckets as megatron-core makes them here: one per weight on
    stage 0, one per stage elsewhere (see the module docstring).
    """
    from ..schedules.dp_reduce import DPReduceModel
    from ..schedules.registry import get_spec

    v = get_spec(name).chunks_per_rank(2)
    per_chunk = max(1, spec.layers // v)
    return DPReduceModel(stage_bytes=grad_bytes / v,
                         bucket_bytes=[grad_bytes / v / per_chunk] + [None] * (spec.pp * v - 1),
                         bandwidth=bandwidth, latency=latency)


def bench_costs(name: str, spec: DPBenchSpec, *, t_comm: float, dp_reduce: Any = None) -> Any:
    """Per-stage target costs in ms (a V chunk is half a rank's share), ``t_comm`` in ms."""
    from ..schedules import CostModel
    from ..schedules.registry import get_spec

    v = get_spec(name).chunks_per_rank(2)
    return CostModel(t_f=spec.t_f * 1e3 / v, t_b=spec.t_b * 1e3 / v, t_w=spec.t_w * 1e3 / v, t_comm=t_comm,
                     dp_reduce=dp_reduce)


def _install_agreed(fb: Any, spec: DPBenchSpec, schedule: Any = None) -> Any:
    """Install global rank 0's ``schedule`` (without one: ``fb``'s own, built by rank 0) in ``fb`` on
    every rank, by the runtime's install protocol. Returns the schedule."""
    from ..runtime import NotBuilt

    outcome = fb.install(spec.pp, spec.m, schedule=schedule)
    if isinstance(outcome, NotBuilt):
        raise RuntimeError(f"schedule not built for p={spec.pp}, m={spec.m}: {outcome.reason}")
    return outcome.schedule


# ---------------------------------------------------------------------- measurements
def _timed_all_reduce(numel: int, group: Any, reps: int) -> float:
    """Median seconds of an all-reduce of ``numel`` fp32 over ``group`` (every DP group at once),
    global rank 0's value on every rank."""
    import torch.distributed as dist

    buf = torch.ones(numel)
    out = []
    for i in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf, group=group)
        if i:
            out.append(time.perf_counter() - t0)
    agreed = torch.tensor([statistics.median(out)], dtype=torch.float64)
    dist.broadcast(agreed, src=0)
    return float(agreed)


def fit_reduce(t_full: float, t_bucket: float, full_bytes: float, bucket_bytes: float) -> tuple[float, float]:
    """``(latency, bandwidth)`` of ``t = latency + bytes / bandwidth`` through two measured sizes
    (seconds, bytes; latency clipped at 0). Raises ``ValueError`` when the sizes are equal."""
    if full_bytes <= bucket_bytes:
        raise ValueError(f"need two different sizes, got {full_bytes:g} and {bucket_bytes:g} bytes")
    slope = (t_full - t_bucket) / (full_bytes - bucket_bytes)
    if slope <= 0:   # noise: the bigger reduce was not slower; one bandwidth through the full size
        return 0.0, full_bytes / t_full
    latency = max(0.0, t_full - slope * full_bytes)
    return latency, (full_bytes / (t_full - latency))


def _gradient_numel(spec: DPBenchSpec, reduce_tf: float, group: Any) -> int:
    """Elements of one rank's gradients whose all-reduce takes about ``reduce_tf * t_f`` (same on all ranks)."""
    unit = 2 * spec.layers
    n = 1 << 20
    for _ in range(2):   # a probe, then once more at the size it suggests
        t = _timed_all_reduce(n, group, 3)
        n = max(unit, int(n * reduce_tf * spec.t_f / t) // unit * unit)
    return n


def dp_bench_rank(spec_dict: dict[str, Any]) -> dict[str, Any]:
    """Per-process body of the ``dp`` section (run under :func:`megatron_zb.testing.run_distributed`).

    Returns, on every rank: ``pp_rank``, the p2p latency ``t_comm`` (s) and per entry of
    ``spec.reduce_tfs`` a dict (:func:`_size_rounds`): the gradient elements of one rank's share,
    the measured all-reduce times ``t_full`` and ``t_bucket`` and the fitted ``(latency,
    bandwidth)`` in (s, bytes/s) -- global rank 0's, the same on every rank --, the schedules run,
    and per variant ``"<schedule>/off|on"`` one record per timed iteration of this rank (times in
    ``time.perf_counter()`` seconds): ``start``, ``end``, ``compute_end`` (end of the rank's last
    compute action), ``synced`` (``finalize_model_grads`` returned), ``launches`` (per bucket
    launch ``(stage, bucket, time)``; empty without overlap), plus this rank's compute-action
    durations per op (s) in ``durations``.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    from ..testing.distributed import init_parallel_state
    from .emulated import SleepClock, measure_p2p_latency

    spec = DPBenchSpec(**{k: tuple(v) if k in ("schedules", "reduce_tfs") else v for k, v in spec_dict.items()})
    init_parallel_state(pipeline_model_parallel_size=spec.pp, seed=None)
    shape = (16, 1, 32)
    t_comm = measure_p2p_latency(shape, peer_pairs=((0, 1),))
    progress = RoundProgress("dp", len(spec.reduce_tfs) * (spec.warmup + spec.repeats),
                             enabled=dist.get_rank() == 0)
    sizes = [_size_rounds(spec, tf, shape=shape, t_comm=t_comm, clock=SleepClock(), progress=progress)
             for tf in spec.reduce_tfs]
    return dict(pp_rank=parallel_state.get_pipeline_model_parallel_rank(), t_comm=t_comm, sizes=sizes)


def _size_rounds(spec: DPBenchSpec, reduce_tf: float, *, shape: Sequence[int], t_comm: float, clock: Any,
                 progress: RoundProgress) -> dict[str, Any]:
    """The rounds of one reduce size (see :func:`dp_bench_rank`)."""
    from megatron.core import parallel_state

    dp_group = parallel_state.get_data_parallel_group()
    numel = _gradient_numel(spec, reduce_tf, dp_group)
    t_full = _timed_all_reduce(numel, dp_group, 5)
    t_bucket = _timed_all_reduce(numel // spec.layers, dp_group, 5)
    latency, bandwidth = fit_reduce(t_full, t_bucket, 4.0 * numel, 4.0 * numel / spec.layers)
    runs, schedules = {}, {}
    for name in spec.schedules:
        model = reduce_model(name, spec, grad_bytes=4.0 * numel, latency=latency * 1e3, bandwidth=bandwidth / 1e3)
        costs = bench_costs(name, spec, t_comm=t_comm * 1e3, dp_reduce=model)
        for overlap in (False, True):
            r = _build(name, spec, overlap=overlap, numel=numel, clock=clock, shape=shape, costs=costs)
            schedules[name] = _install_agreed(r["fb"], spec, schedules.get(name))
            runs[f"{name}/{'on' if overlap else 'off'}"] = r
    out: dict[str, Any] = dict(reduce_tf=reduce_tf, numel=numel, t_full=t_full, t_bucket=t_bucket, latency=latency,
                               bandwidth=bandwidth, schedules=schedules, records={k: [] for k in runs},
                               durations={k: {} for k in runs})
    for rnd in range(spec.warmup + spec.repeats):
        round_ms: dict[str, float] = {}
        keys = list(runs)
        if rnd % 2:   # off before on in even rounds, on before off in odd ones (drift cancels in pairs)
            keys = [k for pair in zip(keys[1::2], keys[0::2]) for k in pair]
        for key in keys:
            rec, timing = _iteration(runs[key], spec.m, shape)
            round_ms[key] = (rec["end"] - rec["start"]) * 1e3
            if rnd < spec.warmup:
                continue
            out["records"][key].append(rec)
            for a, a0, a1 in timing.records:
                out["durations"][key].setdefault(a.op, []).append(a1 - a0)
        progress.round(m=spec.m, times_ms=round_ms,
                       what=f"reduce {reduce_tf:g} T_F, {'warm-up round' if rnd < spec.warmup else 'round'}")
    del runs
    gc.collect()   # the next size's buffers replace these
    return out


def _iteration(r: dict[str, Any], m: int, shape: Sequence[int]) -> tuple[dict[str, Any], Any]:
    """One training iteration's forward-backward (gradient buffers zeroed first); its record and its
    actions' timing."""
    import torch.distributed as dist

    from ..runtime import Measure
    from .emulated import emulated_forward_step

    chunks, marks = r["chunks"], r["marks"]
    for c in chunks:
        c.zero_grad_buffer()
    data = [iter(range(m)) for _ in chunks]
    marks.clear()
    dist.barrier()
    t0 = time.perf_counter()
    fb = r["fb"]
    measured = fb.run(Measure(time_actions=True), forward_step_func=emulated_forward_step,
                      data_iterator=data if len(data) > 1 else data[0], model=chunks if len(chunks) > 1 else chunks[0],
                      num_microbatches=m, seq_length=shape[0], micro_batch_size=shape[1])
    t1 = time.perf_counter()
    rep = measured.grad_sync
    launches = [] if rep is None else [(x.stage, x.bucket, x.time) for x in rep.launches]
    return dict(start=t0, end=t1, compute_end=max(e for _, _, e in measured.timing.records),
                synced=marks["synced"], launches=launches), measured.timing

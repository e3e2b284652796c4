"""Benchmark section ``dp``: data-parallel gradient reduce, overlapped with the pipeline or not.

An emulated PP x DP cluster (default PP=4 x DP=2, 8 processes): every stage's compute is a sleep
(:class:`~megatron_zb.bench.emulated.SleepClock`, as in :mod:`megatron_zb.bench.emulated`), the
runtime, the weight-gradient store, gloo p2p and megatron-core's ``DistributedDataParallel``
are the real ones. A stage holds ``layers`` weights; its B queues one W entry per weight (last
weight first, each sleeping ``T_W / layers`` and adding into the weight's ``main_grad``), so a
stage's W reports its weights ready one by one, as a real layer stack does. The gradient buffer
of one rank's share is sized so that a gloo all-reduce of it over the data-parallel group takes
about ``reduce_tf`` x ``T_F`` (measured at start-up). DDP's bucket size is one weight, so the
first stage has ``layers`` buckets; megatron-core keeps one bucket on every other pipeline rank
and on every model chunk after the first.

Each round runs, for every schedule, one iteration with ``overlap_grad_reduce`` off (the whole
reduce in ``finalize_model_grads``, after the rank's last compute action) and one with it on
(megatron-zb's :class:`~megatron_zb.runtime.grad_sync.GradSync` launches each bucket when its
weights' last W is done). Iteration time = last rank's end - first rank's start (after a barrier).

:func:`dp_section` (called by ``scripts/benchmark.py``) compares the measured time the overlap
saves with the simulator's prediction (:func:`~megatron_zb.schedules.dp_reduce.simulate_dp_reduce`
with the measured action durations, p2p latency and the fitted reduce latency and bandwidth).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch

from .progress import RoundProgress

__all__ = ["DPBenchSpec", "DPStage", "dp_bench_rank", "dp_prediction", "dp_section", "fit_reduce"]


@dataclass(frozen=True)
class DPBenchSpec:
    """What the ``dp`` section runs.

    Attributes:
        schedules: schedule names (each with overlap off and on).
        pp, dp: pipeline and data-parallel sizes (``pp * dp`` processes).
        m: microbatches per iteration.
        t_f, t_b, t_w: seconds of one microbatch through one rank's share of the model.
        layers: weights per rank's share (split alike over its chunks); W entries per W.
        reduce_tf: target time of the all-reduce of one rank's gradients, in units of ``t_f``.
        warmup, repeats: untimed and timed rounds.
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
    reduce_tf: float = 1.0
    warmup: int = 2
    repeats: int = 6
    timeout: float = 120.0


# ---------------------------------------------------------------------- the emulated stage
class _Compute(torch.autograd.Function):
    """F sleeps ``t_f``; B sleeps ``t_b`` and queues one W entry per weight (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, stage, *weights):  # noqa: D401 - autograd signature
        stage.clock.sleep(stage.t_f, "F")
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
        stage.clock.sleep(stage.t_b, "B")
        for w in reversed(stage.weights):   # the last layer's weight gradient first, as in a real stack
            def weight_grad(w: torch.Tensor = w) -> None:
                stage.clock.sleep(stage.t_w / len(stage.weights), "W")
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


def _finish_grad_sync(model: list[Any], *_: Any, **__: Any) -> None:
    """``finalize_model_grads_func``: wait for (overlap) or run (no overlap) every chunk's reduce."""
    for chunk in model:
        chunk.finish_grad_sync()


def _build(name: str, spec: DPBenchSpec, *, overlap: bool, numel: int, clock: Any, shape: Sequence[int],
           costs: Any) -> dict[str, Any]:
    """This rank's chunks of schedule ``name`` wrapped in megatron-core DDP, and the runtime."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from ..runtime import get_forward_backward_func
    from ..testing.tiny_gpt import placement_for

    s2r = placement_for(name, spec.pp)
    v = len(s2r) // spec.pp
    rank = parallel_state.get_pipeline_model_parallel_rank()
    config = _config(shape[-1])
    per_chunk = max(1, spec.layers // v)
    chunks = []
    for i, s in enumerate(st for st in range(len(s2r)) if s2r[st] == rank):
        stage = DPStage(stage=s, num_stages=len(s2r), num_weights=per_chunk, numel=numel // (per_chunk * v),
                        t_f=spec.t_f / v, t_b=spec.t_b / v, t_w=spec.t_w / v, shape=shape, clock=clock,
                        config=config)
        ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=overlap, bucket_size=numel // (per_chunk * v))
        chunks.append(DistributedDataParallel(config=config, ddp_config=ddp_config, module=stage,
                                              disable_bucketing=i > 0))
    config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
    config.finalize_model_grads_func = _finish_grad_sync
    fb = get_forward_backward_func(name, costs=costs, time_actions=True, timeout=spec.timeout)
    return dict(fb=fb, chunks=chunks, s2r=s2r)


# ---------------------------------------------------------------------- measurements
def _timed_all_reduce(numel: int, group: Any, reps: int) -> float:
    """Median seconds of an all-reduce of ``numel`` fp32 over ``group`` (every DP group at once)."""
    import torch.distributed as dist

    buf = torch.ones(numel)
    out = []
    for i in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf, group=group)
        if i:
            out.append(time.perf_counter() - t0)
    return statistics.median(out)


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


def _gradient_numel(spec: DPBenchSpec, group: Any) -> int:
    """Elements of one rank's gradients whose all-reduce takes about ``reduce_tf * t_f`` (same on all ranks)."""
    import torch.distributed as dist

    unit = 2 * spec.layers
    n = 1 << 20
    for _ in range(2):   # a probe, then once more at the size it suggests
        t = _timed_all_reduce(n, group, 3)
        size = torch.tensor([n * spec.reduce_tf * spec.t_f / t])
        dist.broadcast(size, src=0)
        n = max(unit, int(float(size) // unit) * unit)
    return n


def dp_bench_rank(spec_dict: dict[str, Any]) -> dict[str, Any]:
    """Per-process body of the ``dp`` section (run under :func:`megatron_zb.testing.run_distributed`).

    Returns, on every rank: the gradient elements of one rank's share, the fitted reduce
    ``(latency, bandwidth)`` in (s, bytes/s), the p2p latency (s), and per variant
    ``"<schedule>/off|on"`` the timed iterations ``(start, end)`` of this rank, this rank's
    compute-action durations per op (s) and the overlap evidence (per iteration, how long before the
    end of the rank's last compute action its first bucket group was launched, s; bucket groups),
    plus ``pp_rank``.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    from ..schedules import CostModel
    from ..testing.distributed import init_parallel_state
    from .emulated import SleepClock, measure_p2p_latency

    spec = DPBenchSpec(**{k: tuple(v) if k == "schedules" else v for k, v in spec_dict.items()})
    init_parallel_state(pipeline_model_parallel_size=spec.pp, seed=None)
    dp_group = parallel_state.get_data_parallel_group()
    shape = (16, 1, 32)
    numel = _gradient_numel(spec, dp_group)
    t_full = _timed_all_reduce(numel, dp_group, 5)
    t_bucket = _timed_all_reduce(numel // spec.layers, dp_group, 5)
    latency, bandwidth = fit_reduce(t_full, t_bucket, 4.0 * numel, 4.0 * numel / spec.layers)
    t_comm = measure_p2p_latency(shape, peer_pairs=((0, 1),))
    clock = SleepClock()
    ms = 1e3
    runs = {}
    for name in spec.schedules:
        costs = CostModel(t_f=spec.t_f * ms, t_b=spec.t_b * ms, t_w=spec.t_w * ms, t_comm=t_comm * ms)
        for overlap in (False, True):
            runs[f"{name}/{'on' if overlap else 'off'}"] = _build(name, spec, overlap=overlap, numel=numel,
                                                                  clock=clock, shape=shape, costs=costs)
    out: dict[str, Any] = dict(numel=numel, latency=latency, bandwidth=bandwidth, t_full=t_full, t_bucket=t_bucket,
                               t_comm=t_comm, pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
                               times={k: [] for k in runs}, durations={k: {} for k in runs},
                               early={k: [] for k in runs}, buckets={})
    rounds = spec.warmup + spec.repeats
    progress = RoundProgress("dp", rounds, enabled=dist.get_rank() == 0)
    for rnd in range(rounds):
        round_ms: dict[str, float] = {}
        keys = list(runs)
        if rnd % 2:   # off before on in even rounds, on before off in odd ones (drift cancels in pairs)
            keys = [k for pair in zip(keys[1::2], keys[0::2]) for k in pair]
        for key in keys:
            r = runs[key]
            t0, t1 = _iteration(r, spec.m, shape)
            round_ms[key] = (t1 - t0) * 1e3
            if rnd < spec.warmup:
                continue
            out["times"][key].append((t0, t1))
            for a, a0, a1 in r["fb"].last_timing.records:
                out["durations"][key].setdefault(a.op, []).append(a1 - a0)
            rep = r["fb"].last_grad_sync
            if rep is not None:
                out["early"][key].append(max(rep.hidden_window(), default=0.0))
                out["buckets"][key] = rep.num_buckets
        progress.round(m=spec.m, times_ms=round_ms, what="warm-up round" if rnd < spec.warmup else "round")
    return out


def _iteration(r: dict[str, Any], m: int, shape: Sequence[int]) -> tuple[float, float]:
    """One training iteration's forward-backward (gradient buffers zeroed first); its (start, end)."""
    import torch.distributed as dist

    from .emulated import emulated_forward_step

    chunks = r["chunks"]
    for c in chunks:
        c.zero_grad_buffer()
    data = [iter(range(m)) for _ in chunks]
    dist.barrier()
    t0 = time.perf_counter()
    r["fb"](forward_step_func=emulated_forward_step, data_iterator=data if len(data) > 1 else data[0],
            model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=m, seq_length=shape[0],
            micro_batch_size=shape[1])
    return t0, time.perf_counter()


# ---------------------------------------------------------------------- prediction and report
def dp_prediction(name: str, spec: DPBenchSpec, *, t_f: float, t_b: float, t_w: float, t_comm: float,
                  grad_bytes: float, latency: float, bandwidth: float) -> Any:
    """The simulator's :class:`~megatron_zb.schedules.dp_reduce.DPReduceResult` for schedule ``name``.

    Times in ms per rank's share (each of a rank's ``v`` chunks gets ``1/v``), ``grad_bytes`` per
    rank's share, ``latency`` in ms, ``bandwidth`` in bytes/ms. Buckets as megatron-core makes
    them here: one per weight on stage 0, one per stage elsewhere (see the module docstring).
    """
    from ..schedules import CostModel
    from ..schedules.dp_reduce import DPReduceModel, simulate_dp_reduce
    from ..schedules.registry import build_schedule, get_spec
    from ..schedules.simulator import simulate

    v = get_spec(name).chunks_per_rank(2)
    n = spec.pp * v
    per_chunk = max(1, spec.layers // v)
    model = DPReduceModel(stage_bytes=grad_bytes / v, bucket_bytes=[grad_bytes / v / per_chunk] + [None] * (n - 1),
                          bandwidth=bandwidth, latency=latency)
    costs = CostModel(t_f=t_f / v, t_b=t_b / v, t_w=t_w / v, t_comm=t_comm)
    target = CostModel(t_f=spec.t_f * 1e3 / v, t_b=spec.t_b * 1e3 / v, t_w=spec.t_w * 1e3 / v, t_comm=t_comm)
    sched = build_schedule(name, num_ranks=spec.pp, num_microbatches=spec.m, costs=target)
    return simulate_dp_reduce(simulate(sched, costs), model)


def _iteration_ms(res: list[dict[str, Any]], key: str) -> list[float]:
    """Per timed round: last end - first start over all ranks, ms."""
    rounds = len(res[0]["times"][key])
    return [(max(r["times"][key][i][1] for r in res) - min(r["times"][key][i][0] for r in res)) * 1e3
            for i in range(rounds)]


def dp_section(*, quick: bool, timeout: float, rows: list[Any], md: list[str], log: Any) -> dict[str, Any]:
    """Run the section (8 processes) and append its rows and markdown; returns the figures per schedule."""
    from ..schedules.registry import get_spec
    from ..testing import run_distributed
    from .report import Row

    spec = DPBenchSpec(t_f=0.03, t_b=0.03, t_w=0.03, warmup=2, repeats=4) if quick else DPBenchSpec(
        t_f=0.06, t_b=0.06, t_w=0.06, repeats=10)
    log(f"dp: PP={spec.pp} x DP={spec.dp}, m={spec.m}, T_F={spec.t_f * 1e3:g} ms, schedules {', '.join(spec.schedules)}")
    res = run_distributed(dp_bench_rank, world_size=spec.pp * spec.dp, args=(asdict(spec),), timeout=timeout,
                          threads=1)
    r0 = res[0]
    grad_bytes = 4.0 * r0["numel"]
    t_comm = statistics.median(r["t_comm"] for r in res) * 1e3
    latency = statistics.median(r["latency"] for r in res) * 1e3
    bandwidth = statistics.median(r["bandwidth"] for r in res) / 1e3
    md.append("\n## Data-parallel reduce overlapped with the pipeline (emulated PP x DP)\n")
    md.append(f"`megatron_zb.bench.dp`: PP={spec.pp} x DP={spec.dp} ({spec.pp * spec.dp} processes), m={spec.m}, "
              f"sleep-for-compute stages (T_F = T_B = T_W = {spec.t_f * 1e3:g} ms per rank's share, half per chunk "
              f"on the V), {spec.layers} weights per rank's share with one W entry each, megatron-core DDP over "
              f"gloo; gradients {grad_bytes / 2**20:.1f} MiB per rank (all-reduce measured {r0['t_full'] * 1e3:.1f} ms "
              f"for all, {r0['t_bucket'] * 1e3:.1f} ms for one weight; fitted latency {latency:.2f} ms, "
              f"bandwidth {bandwidth / 2**20 * 1e3:.0f} MiB/s); p2p latency {t_comm:.2f} ms. {spec.warmup} warm-up "
              f"and {spec.repeats} timed rounds, overlap off and on back to back (order alternating); medians "
              f"(range over the rounds in brackets). 'predicted' = `simulate_dp_reduce` with the measured median "
              f"F/B/W durations; 'hideable' = predicted time without overlap - with; 'hidden' = median over the "
              f"rounds of measured off - on. 'lead' = how long before the end of pipeline rank 0's last compute "
              f"action its first bucket group was launched (median over the rounds; its bucket groups in "
              f"brackets). Target: hidden >= half of hideable ('-' when the simulator finds less than 1% of "
              f"the iteration to hide).\n")
    md.append("| schedule | measured off (ms) | measured on (ms) | predicted off | predicted on | hideable (ms) | "
              "hidden (ms) | hidden / hideable | lead (ms) | target |")
    md.append("|---|---|---|---|---|---|---|---|---|---|")
    figures = {}
    for name in spec.schedules:
        offs, ons = (_iteration_ms(res, f"{name}/{k}") for k in ("off", "on"))
        off, on = statistics.median(offs), statistics.median(ons)
        dur = {op: statistics.median(d for r in res for k in ("off", "on")
                                     for d in r["durations"][f"{name}/{k}"].get(op, []))
               for op in ("F", "B", "W")}
        v = get_spec(name).chunks_per_rank(2)
        pred = dp_prediction(name, spec, t_f=dur["F"] * 1e3 * v, t_b=dur["B"] * 1e3 * v, t_w=dur["W"] * 1e3 * v,
                             t_comm=t_comm, grad_bytes=grad_bytes, latency=latency, bandwidth=bandwidth)
        hidden, hideable = statistics.median(a - b for a, b in zip(offs, ons)), pred.hideable
        frac = hidden / hideable if hideable > 0 else math.nan
        first = next(r for r in res if r["pp_rank"] == 0)
        early = first["early"][f"{name}/on"]
        verdict = "-" if hideable < 0.01 * pred.time_serial else ("PASS" if frac >= 0.5 else "FAIL")
        md.append(f"| {name} | {off:.1f} [{min(offs):.0f}-{max(offs):.0f}] | {on:.1f} [{min(ons):.0f}-{max(ons):.0f}] | "
                  f"{pred.time_serial:.1f} | {pred.time_overlapped:.1f} | {hideable:.1f} | {hidden:.1f} | "
                  f"{'-' if frac != frac else f'{frac:.2f}'} | "
                  f"{statistics.median(early) * 1e3 if early else math.nan:.1f} "
                  f"[{first['buckets'].get(f'{name}/on', '-')}] | {verdict} |")
        for metric, value in (("measured_off_ms", off), ("measured_on_ms", on), ("predicted_off_ms", pred.time_serial),
                              ("predicted_on_ms", pred.time_overlapped), ("hideable_ms", hideable),
                              ("hidden_ms", hidden), ("hidden_over_hideable", frac)):
            rows.append(Row("dp", spec.pp, spec.m, name, metric, value, "ms" if metric.endswith("ms") else ""))
        figures[name] = dict(off=off, on=on, predicted_off=pred.time_serial, predicted_on=pred.time_overlapped,
                             hideable=hideable, hidden=hidden, fraction=frac, early=early)
    return figures


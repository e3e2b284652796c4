"""Benchmark bodies on the real tiny megatron-core GPT (CPU, gloo), one function per process.

Run them with :func:`megatron_zb.testing.run_distributed`; the ``cpu`` benchmark (:mod:`megatron_zb.bench.cpu`) does.

* :func:`timing_rank` -- PP=2 iteration times of megatron-core's own 1F1B
  (``forward_backward_pipelining_without_interleaving``) against megatron-zb's runtime running
  1F1B, ZB-H1, ZB-2p and ZB-V, interleaved round-robin over repeats. Cost-aware schedules
  (ZB-2p, ZB-V) are re-planned with T_F/T_B/T_W measured by ``time_actions`` on this very model
  and the p2p latency measured on this very machine before they are timed.
* :func:`memory_rank` -- peak saved-activation bytes per rank (``track_memory=True``) of each
  schedule, next to what the simulator predicts from each stage's measured bytes per microbatch.
* :func:`post_validation_rank` -- one zero-bubble schedule with megatron-core's synchronous
  optimizer step versus :class:`megatron_zb.optimizer.PostValidationOptimizer`.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..runtime.executor import LoopOverhead
from ..runtime.measure import Measure, Measured
from ..schedules.ir import Op, Placement
from ..testing.tiny_gpt import (TinyGPT, build_chunks, forward_backward, forward_step, measured_forward_backward,
                                random_microbatches)
from .progress import RoundProgress

TIMED = Measure(time_actions=True)
"""What the timed calls measure: every action's times."""

MEGATRON_1F1B = "megatron-1f1b"
"""Variant name of megatron-core's own 1F1B (not a schedule of the library)."""


@dataclass(frozen=True)
class ModelSpec:
    """The GPT used by the real-compute benchmarks (sizes in elements)."""

    num_layers: int = 8
    hidden: int = 256
    heads: int = 8
    seq: int = 128
    vocab: int = 1024
    micro_batch: int = 2
    seed: int = 1234

    def describe(self) -> str:
        return (f"GPT {self.num_layers} layers, hidden {self.hidden}, {self.heads} heads, seq {self.seq}, "
                f"vocab {self.vocab}, micro batch {self.micro_batch}, fp32")

    def tiny_gpt(self, pp: int) -> TinyGPT:
        """The same model as a :class:`~megatron_zb.testing.tiny_gpt.TinyGPT` at PP=``pp`` (TP=DP=1)."""
        return TinyGPT(pp=pp, **asdict(self))


# ---------------------------------------------------------------------- helpers (inside a rank)
def _data(spec: ModelSpec, n: int) -> list[dict[str, torch.Tensor]]:
    return random_microbatches(n, vocab=spec.vocab, micro_batch=spec.micro_batch, seq=spec.seq, seed=spec.seed + 7)


def _build(spec: ModelSpec, pp: int, placements: list[Placement]) -> dict[Placement, list[Any]]:
    """This rank's chunks per placement kind (plain, V); parallel state must be initialised."""
    return {kind: build_chunks(spec.tiny_gpt(pp), Placement(kind).stage_to_rank(pp)) for kind in placements}


def placement_kind(name: str) -> Placement:
    """The chunks a benchmark variant runs on: ``Placement.V`` for a V schedule, else ``Placement.PLAIN``
    (megatron-core's own 1F1B included); its measured costs are those of that kind's chunks."""
    from ..schedules.registry import get_spec

    if name == MEGATRON_1F1B:
        return Placement.PLAIN
    return Placement.V if get_spec(name).placement is Placement.V else Placement.PLAIN


def _gather(obj: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _stage_map(per_rank: list[dict[int, Any]]) -> dict[int, Any]:
    merged: dict[int, Any] = {}
    for d in per_rank:
        merged.update(d)
    return merged


def measure_stage_memory(chunks: list[Any], spec: ModelSpec) -> dict[int, tuple[int, int]]:
    """Per stage of this rank: (bytes saved by one microbatch's F, bytes still held after its B).

    Runs megatron-core's ``forward_step`` / ``backward_step`` on one microbatch in isolation (a
    random input / output gradient stands in for the neighbours), inside the runtime's activation
    tracker; the B runs in the weight-gradient store's deferring window, so the second number is
    what the W closures keep alive (the simulator's ``M_W``).
    """
    from ..megatron_compat import pipeline_step_functions
    from ..runtime import ActivationMemoryTracker, WeightGradStore, install_routes

    steps = pipeline_step_functions()
    megatron_forward_step, backward_step = steps.forward_step, steps.backward_step
    install_routes()
    store = WeightGradStore()
    out: dict[int, tuple[int, int]] = {}
    shape = (spec.seq, spec.micro_batch, spec.hidden)
    g = torch.Generator().manual_seed(3)
    for ch in chunks:
        model = ch.module
        stage = ch.plan.stage
        tracker = ActivationMemoryTracker(model.parameters())
        inp = None if ch.plan.pre_process else torch.randn(shape, generator=g).requires_grad_(True)
        with tracker.saving():
            o, _ = megatron_forward_step(forward_step, iter(_data(spec, 1)), model, 1, inp, [], model.config, 1,
                                         current_microbatch=0, is_last_stage=ch.plan.post_process)
        gc.collect()
        mem_b = tracker.current_bytes
        steps.deallocate_output_tensor(o[0] if isinstance(o, list) else o, model.config.deallocate_pipeline_outputs)
        grad = None if ch.plan.post_process else torch.randn(shape, generator=g)
        key = 1 << 30
        with store.deferring(stage, key):
            backward_step(inp, o, grad, model.config)
        del o, grad, inp
        gc.collect()
        mem_w = tracker.current_bytes
        store.run(stage, key)
        model.zero_grad(set_to_none=True)
        out[stage] = (int(mem_b), int(mem_w))
    return out


def measured_costs(t: Any, stages: list[int]) -> dict[int, tuple[float, float, float]]:
    """Per stage of this rank: median (T_F, T_B, T_W) in ms of the records of the timing ``t``."""
    out = {}
    for s in stages:
        vals = []
        for op in (Op.F, Op.B, Op.W):
            d = t.durations(op).get(s, [])
            vals.append(1e3 * statistics.median(d) if d else float("nan"))
        out[s] = tuple(vals)
    return out


def _cost_model(times: dict[int, tuple[float, float, float]], mem: dict[int, tuple[int, int]] | None,
                t_comm_ms: float) -> Any:
    from ..schedules import CostModel

    n = len(times)
    kw = {}
    if mem is not None:
        kw = dict(mem_b=[float(mem[s][0]) for s in range(n)], mem_w=[float(mem[s][1]) for s in range(n)])
    return CostModel(t_f=[times[s][0] for s in range(n)], t_b=[times[s][1] for s in range(n)],
                     t_w=[times[s][2] for s in range(n)], t_comm=t_comm_ms, **kw)


def _measure_costs(chunks_by_kind: dict[Placement, list[Any]], spec: ModelSpec, m: int, iters: int,
                   t_comm_ms: float, log: Any = None) -> dict[str, Any]:
    """Measure per-stage T_F/T_B/T_W (ms) with ``time_actions`` and M_B/M_W (bytes), per placement.

    Times come from ZB-H1 (plain) and ZB-V with unit costs (V) -- both split B and W -- over
    ``iters`` iterations after one warm-up; the result is gathered so that every rank builds the
    same cost model (hence the same schedule).
    """
    from ..runtime import get_forward_backward_func

    out: dict[str, Any] = {}
    data = _data(spec, m)

    import torch.distributed as dist

    runs = ([("zb-h1" if kind == Placement.PLAIN else "zbv") for kind in chunks_by_kind]
            + ["1f1b"] * (Placement.PLAIN in chunks_by_kind))
    progress = RoundProgress("cost measurement", len(runs) * (iters + 1), enabled=dist.get_rank() == 0)

    def timed(name: str, mods: list[Any]) -> Any:
        """The actions' timing of ``iters`` iterations after one warm-up (records of all of them)."""
        fb = get_forward_backward_func(name)
        recs: list[Any] = []
        for it in range(iters + 1):
            for mod in mods:
                mod.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            timing = measured_forward_backward(fb, mods, data, seq=spec.seq, micro_batch=spec.micro_batch,
                                               measure=TIMED).timing
            progress.round(m=m, times_ms={name: 1e3 * (time.perf_counter() - t0)},
                           what="warm-up iteration" if it == 0 else "iteration")
            if it > 0:
                recs.extend(timing.records)
        timing.records = recs
        return timing

    for kind, chunks in chunks_by_kind.items():
        mods = [c.module for c in chunks]
        stages = [c.plan.stage for c in chunks]
        timing = timed("zb-h1" if kind == Placement.PLAIN else "zbv", mods)
        times = _stage_map(_gather(measured_costs(timing, stages)))
        bw: dict[int, float] = {}
        if kind == Placement.PLAIN:  # the fused backward of 1F1B, to compare with T_B + T_W
            fused = timed("1f1b", mods).durations(Op.BW)
            bw = _stage_map(_gather({s: 1e3 * statistics.median(fused[s]) for s in stages if fused.get(s)}))
        mem = _stage_map(_gather(measure_stage_memory(chunks, spec)))
        out[kind] = dict(times=times, mem=mem, bw=bw, costs=_cost_model(times, mem, t_comm_ms))
    return out


def _iteration(fb: Any, mods: list[Any], data: list[dict[str, torch.Tensor]], spec: ModelSpec,
               ours: bool) -> tuple[float, float, Measured]:
    """One timed forward/backward over ``data`` (one micro batch each): zero grads, barrier, run;
    (start, end) on this rank's clock, and what the call measured (ours: every action's times)."""
    import torch.distributed as dist

    from ..runtime import install_routes, uninstall_routes

    for mod in mods:
        mod.zero_grad(set_to_none=True)
    if ours:
        install_routes()
    else:  # megatron-core exactly as shipped: its own layers, no route into the store
        uninstall_routes()
    dist.barrier()
    t0 = time.perf_counter()
    if ours:
        measured = measured_forward_backward(fb, mods, data, seq=spec.seq, micro_batch=spec.micro_batch, measure=TIMED)
    else:
        measured = Measured(data=forward_backward(fb, mods, data, seq=spec.seq, micro_batch=spec.micro_batch))
    t1 = time.perf_counter()
    return t0, t1, measured


# ---------------------------------------------------------------------- rank bodies
def timing_rank(cfg: dict[str, Any]) -> dict[str, Any]:
    """PP=2 (any PP) timing of megatron-core's 1F1B and our schedules (see the module docstring).

    ``cfg`` keys: ``model`` (a :class:`ModelSpec` as dict), ``variants`` (names; ``"megatron-1f1b"``
    is megatron-core's own schedule), ``ms`` (microbatch counts), ``warmup``, ``repeats``,
    ``measure_iters``, ``measure_m``, ``memory_schedules`` and ``memory_m`` (also measure peak
    activation bytes, after the timings; empty to skip).

    Returns per rank: timings ``{m: {variant: [(start, end), ...]}}``, the measured costs,
    losses per variant of the first timed iteration (last rank), memory results.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func as megatron_fb

    from ..bench.emulated import measure_p2p_latency
    from ..runtime import get_forward_backward_func
    from ..testing.distributed import init_parallel_state

    spec = ModelSpec(**cfg["model"])
    pp = dist.get_world_size()
    init_parallel_state(pipeline_model_parallel_size=pp, seed=spec.seed)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    variants = list(cfg["variants"])
    kinds = sorted({placement_kind(v) for v in variants}
                   | {placement_kind(s) for s in cfg.get("memory_schedules", [])})
    chunks = _build(spec, pp, kinds)
    shape = (spec.seq, spec.micro_batch, spec.hidden)
    pairs = [(i, i + 1) for i in range(pp - 1)]
    t_comm = measure_p2p_latency(shape, peer_pairs=pairs) * 1e3
    comm_samples: list[float] = []  # ms, measured again before every timed round
    measured = _measure_costs(chunks, spec, cfg.get("measure_m", 8), cfg.get("measure_iters", 3), t_comm)

    fbs: dict[str, Any] = {}
    for v in variants:
        kind = placement_kind(v)
        if v == MEGATRON_1F1B:
            fbs[v] = megatron_fb()
        else:
            from ..schedules.registry import get_spec
            costs = measured[kind]["costs"] if get_spec(v).cost_aware else None
            fbs[v] = get_forward_backward_func(v, costs=costs)

    timings: dict[int, dict[str, list[tuple[float, float]]]] = {}
    losses: dict[int, dict[str, list[float]]] = {}
    achieved: dict[int, dict[str, dict[str, dict[int, list[float]]]]] = {}  # m -> variant -> op -> stage -> s
    overhead: dict[int, dict[str, Any]] = {}  # m -> variant -> LoopOverhead of the timed rounds
    cpu: dict[int, dict[str, dict[str, dict[int, list[float]]]]] = {}  # as achieved, CPU seconds
    data_all = _data(spec, max(cfg["ms"]))
    progress = RoundProgress("real", len(cfg["ms"]) * (cfg["warmup"] + cfg["repeats"]), enabled=rank == 0)
    for m in cfg["ms"]:
        data = data_all[:m]
        timings[m] = {v: [] for v in variants}
        achieved[m] = {v: {} for v in variants if v != MEGATRON_1F1B}
        cpu[m] = {v: {} for v in achieved[m]}
        losses[m] = {}
        for rnd in range(cfg["warmup"] + cfg["repeats"]):
            timed = rnd >= cfg["warmup"]
            if timed:
                comm_samples.append(1e3 * measure_p2p_latency(shape, peer_pairs=pairs, rounds=10, warmup=2, passes=1))
            if rnd == cfg["warmup"]:
                overhead[m] = {v: LoopOverhead() for v in achieved[m]}   # the timed rounds' sums
            order = variants[rnd % len(variants):] + variants[:rnd % len(variants)]  # rotate the start
            this_round = {}
            for v in order:
                mods = [c.module for c in chunks[placement_kind(v)]]
                t0, t1, call = _iteration(fbs[v], mods, data, spec, ours=(v != MEGATRON_1F1B))
                out = call.data
                this_round[v] = 1e3 * (t1 - t0)
                if timed:
                    timings[m][v].append((t0, t1))
                    if v in achieved[m]:
                        overhead[m][v].merge(call.overhead)
                        for op in (Op.F, Op.B, Op.W, Op.BW):
                            for st, xs in call.timing.durations(op).items():
                                achieved[m][v].setdefault(op, {}).setdefault(st, []).extend(xs)
                            for st, xs in call.timing.cpu_durations(op).items():
                                cpu[m][v].setdefault(op, {}).setdefault(st, []).extend(xs)
                    if v not in losses[m] and out:
                        losses[m][v] = [float(d["lm loss"]) for d in out]
            progress.round(m=m, times_ms={v: this_round[v] for v in variants},
                           what="warm-up round" if not timed else "round")

    memory = {}
    if cfg.get("memory_schedules"):
        memory = _memory(chunks, spec, measured, cfg["memory_schedules"], cfg["memory_m"])
    return dict(rank=rank, t_comm_ms=t_comm, comm_samples_ms=comm_samples, timings=timings, losses=losses,
                achieved=achieved, achieved_cpu=cpu, overhead=overhead,
                measured={k: dict(times=v["times"], mem=v["mem"], bw=v["bw"]) for k, v in measured.items()},
                costs={k: v["costs"] for k, v in measured.items()}, memory=memory)


def _memory(chunks: dict[str, list[Any]], spec: ModelSpec, measured: dict[str, Any], schedules: list[str],
            m: int) -> dict[str, Any]:
    """Peak saved-activation bytes of one iteration per schedule on this rank (``track_memory=True``)."""
    import torch.distributed as dist

    from ..runtime import get_forward_backward_func, install_routes
    from ..schedules.registry import get_spec

    install_routes()
    data = _data(spec, m)
    out: dict[str, Any] = {}
    progress = RoundProgress(f"memory PP={dist.get_world_size()}", len(schedules), enabled=dist.get_rank() == 0)
    for name in schedules:
        kind = placement_kind(name)
        costs = measured[kind]["costs"]
        fb = get_forward_backward_func(name, costs=costs if get_spec(name).cost_aware else None)
        mods = [c.module for c in chunks[kind]]
        for mod in mods:
            mod.zero_grad(set_to_none=True)
        gc.collect()
        t0 = time.perf_counter()
        tracked = measured_forward_backward(fb, mods, data, seq=spec.seq, micro_batch=spec.micro_batch,
                                            measure=Measure(track_memory=True))
        progress.round(m=m, times_ms={name: 1e3 * (time.perf_counter() - t0)}, what="tracked iteration")
        out[name] = dict(peak_bytes=tracked.peak_bytes, schedule=fb.schedule_for(dist.get_world_size(), m))
    return out


def memory_rank(cfg: dict[str, Any]) -> dict[str, Any]:
    """Activation memory only (any PP; timing-insensitive): measure costs, then one tracked
    iteration per schedule. ``cfg``: ``model``, ``memory_schedules``, ``memory_m``, ``measure_m``."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from ..testing.distributed import init_parallel_state

    spec = ModelSpec(**cfg["model"])
    pp = dist.get_world_size()
    init_parallel_state(pipeline_model_parallel_size=pp, seed=spec.seed)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    kinds = sorted({placement_kind(s) for s in cfg["memory_schedules"]})
    chunks = _build(spec, pp, kinds)
    measured = _measure_costs(chunks, spec, cfg.get("measure_m", 2 * pp), cfg.get("measure_iters", 1), 0.0)
    memory = _memory(chunks, spec, measured, cfg["memory_schedules"], cfg["memory_m"])
    return dict(rank=rank, memory=memory, costs={k: v["costs"] for k, v in measured.items()},
                measured={k: dict(times=v["times"], mem=v["mem"], bw=v["bw"]) for k, v in measured.items()})


def post_validation_rank(cfg: dict[str, Any]) -> dict[str, Any]:
    """Synchronous optimizer step versus post-validation, same zero-bubble schedule, interleaved.

    ``cfg``: ``model``, ``schedule``, ``costs`` (a CostModel for cost-aware schedules, e.g. measured
    by :func:`timing_rank`), ``m``, ``block`` (iterations per timed block), ``warmup`` and
    ``repeats`` (rounds of one block per variant), ``clip_grad``.

    Each variant has its own DDP-wrapped copy of the model and its own megatron-core Adam (same
    initial weights), so both optimizers see the same kind of gradients. A block is ``block``
    back-to-back iterations (forward/backward + step) with no barrier in between; the post-
    validated block ends with ``finalize()`` (validation of its last step), inside the timing.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    from ..runtime import get_forward_backward_func, install_routes
    from ..testing.distributed import init_parallel_state
    from ..training.run_config import OptimConfig, ParallelConfig, PostValidationConfig, PrecisionConfig
    from ..training.wiring import megatron_optimizer, wrap_chunks, wrap_post_validation

    spec = ModelSpec(**cfg["model"])
    pp = dist.get_world_size()
    init_parallel_state(pipeline_model_parallel_size=pp, seed=spec.seed)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    install_routes()
    m = cfg["m"]
    data = _data(spec, m)
    variants = {}
    for name in ("sync", "post-validation"):
        [chunk] = _build(spec, pp, [Placement.PLAIN])[Placement.PLAIN]
        # The product's wiring (pretrain_gpt_zb.py's): DDP without overlap, megatron-core's Adam.
        parallel, precision = ParallelConfig(), PrecisionConfig()
        [ddp] = wrap_chunks([chunk.module], first_last=[(chunk.plan.pre_process, chunk.plan.post_process)],
                            parallel=parallel, precision=precision, device=torch.device("cpu"))
        opt = megatron_optimizer(OptimConfig(lr=1e-4, clip_grad=cfg["clip_grad"]), precision=precision,
                                 parallel=parallel, modules=[ddp])
        if name == "post-validation":
            opt = wrap_post_validation(PostValidationConfig(warmup_iters=0, clean_iters_required=1,
                                                            timeout=120.0), opt, announce=False)
        fb = get_forward_backward_func(cfg["schedule"], costs=cfg.get("costs"))
        variants[name] = dict(ddp=ddp, opt=opt, fb=fb)

    def block(name: str) -> tuple[float, float]:
        v = variants[name]
        pv = name == "post-validation"
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(cfg["block"]):
            if pv:
                v["opt"].begin_iteration()
            v["ddp"].zero_grad_buffer()
            v["opt"].zero_grad()
            forward_backward(v["fb"], [v["ddp"]], data, seq=spec.seq, micro_batch=spec.micro_batch)
            v["opt"].step()
        if pv:
            v["opt"].finalize()
        return t0, time.perf_counter()

    times: dict[str, list[tuple[float, float]]] = {n: [] for n in variants}
    names = list(variants)
    progress = RoundProgress("postval", cfg["warmup"] + cfg["repeats"], enabled=rank == 0)
    for rnd in range(cfg["warmup"] + cfg["repeats"]):
        round_ms = {}
        for n in (names if rnd % 2 == 0 else names[::-1]):
            t = block(n)
            round_ms[n] = 1e3 * (t[1] - t[0]) / cfg["block"]
            if rnd >= cfg["warmup"]:
                times[n].append(t)
        progress.round(m=m, times_ms=round_ms, what="warm-up round" if rnd < cfg["warmup"] else "round")
    counters = variants["post-validation"]["opt"].counters()
    return dict(rank=rank, times=times, counters=asdict(counters))

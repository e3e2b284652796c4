"""An emulated pipeline stage: compute replaced by calibrated sleeps, everything else real.

:class:`EmulatedStage` is an ``nn.Module`` that the zero-bubble runtime drives exactly as it
drives a megatron-core GPT chunk: megatron-core's ``forward_step`` / ``backward_step`` run it,
activations and gradients travel between processes through the runtime's tagged gloo p2p, and
split backward goes through the real weight-gradient store. Only the arithmetic is replaced:

* forward (``F``): an autograd function sleeps ``T_F`` and returns a zero tensor of the transfer
  shape ``[seq, micro_batch, hidden]`` (the last stage returns a scalar "loss");
* backward: sleeps ``T_B``; when a weight-gradient store is current (a ``B`` action) it queues
  a closure that sleeps ``T_W`` with :meth:`WeightGradStore.put` (run by the matching ``W``);
  otherwise (``BW``) it sleeps ``T_W`` inline.

Sleeping (not busy-waiting) lets 8 emulated ranks share 2 cores. The sleeps are *calibrated*:
:class:`SleepClock` subtracts a per-action offset so that each compute action, as measured by
the runtime's ``time_actions`` (framework overhead included), lasts its target time; the offsets
are learned during warm-up (:meth:`SleepClock.update`).

Optionally the stage also holds activation memory like a real one: ``mem_b_bytes`` saved for
backward by ``F`` (freed with the graph after ``B``/``BW``) of which ``mem_w_bytes`` stay alive in
the W closure until ``W`` -- which the runtime's activation tracker counts.

:func:`emulated_rank` is the per-process benchmark body used by the ``cpu`` benchmark (:mod:`megatron_zb.bench.cpu`)
(run it with :func:`megatron_zb.testing.run_distributed`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from ..schedules.ir import COMPUTE_OPS, Op
from .progress import RoundProgress

__all__ = [
    "EmulatedConfig",
    "EmulatedCosts",
    "EmulatedStage",
    "SleepClock",
    "build_emulated_stages",
    "emulated_forward_step",
    "emulated_loss_func",
    "emulated_check_rank",
    "emulated_rank",
    "measure_p2p_latency",
]


@dataclass
class EmulatedConfig:
    """The fields of a megatron-core ``TransformerConfig`` that the runtime and megatron-core's
    ``forward_step`` / ``backward_step`` read (``get_model_config(model)`` returns this)."""

    hidden_size: int = 64
    pipeline_dtype: torch.dtype = torch.float32
    sequence_parallel: bool = False
    timers: Any = None
    barrier_with_L1_time: bool = False
    enable_autocast: bool = False
    autocast_dtype: Any = None
    grad_scale_func: Any = None
    deallocate_pipeline_outputs: bool = False
    calculate_per_token_loss: bool = False
    no_sync_func: Any = None
    grad_sync_func: Any = None
    finalize_model_grads_func: Any = None
    param_sync_func: Any = None
    num_moe_experts: Any = None
    mtp_num_layers: Any = None
    variable_seq_lengths: bool = False


@dataclass(frozen=True)
class EmulatedCosts:
    """Target durations (seconds) of one microbatch's compute on one stage, and its memory."""

    t_f: float
    t_b: float
    t_w: float
    mem_b_bytes: int = 0
    mem_w_bytes: int = 0


@dataclass
class SleepClock:
    """Sleeps that hit a target duration per compute action, framework overhead included.

    ``offset[op]`` (seconds) is subtracted from every sleep belonging to action ``op`` (``F``,
    ``B``, ``W``, ``BW``); :meth:`update` learns it from the runtime's measured action durations.
    """

    offset: dict[Op, float] = field(default_factory=lambda: dict.fromkeys(COMPUTE_OPS, 0.0))
    enabled: bool = True

    def sleep(self, seconds: float, op: Op) -> None:
        if not self.enabled:
            return
        t = seconds - self.offset.get(op, 0.0)
        if t > 0:
            time.sleep(t)

    def update(self, errors: dict[Op, list[float]], gain: float = 1.0) -> None:
        """Add ``gain *`` the median error (measured - target, seconds) of each op to its offset."""
        for op, errs in errors.items():
            if errs:
                self.offset[op] = self.offset.get(op, 0.0) + gain * statistics.median(errs)


class _EmulatedCompute(torch.autograd.Function):
    """Sleep-for-compute autograd function (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, stage):  # noqa: D401 - autograd signature
        c: EmulatedCosts = stage.costs
        stage.clock.sleep(c.t_f, Op.F)
        ctx.stage = stage
        ctx.in_shape = None if x is None else tuple(x.shape)
        held = []
        if c.mem_b_bytes > 0:
            w_part = max(0, min(c.mem_w_bytes, c.mem_b_bytes))
            held = [torch.empty(c.mem_b_bytes - w_part, dtype=torch.uint8),
                    torch.empty(w_part, dtype=torch.uint8)]
        ctx.save_for_backward(*held)
        if stage.is_last:
            return weight.new_zeros(())
        return weight.new_zeros(stage.shape)

    @staticmethod
    def backward(ctx, grad):  # noqa: D401 - autograd signature
        from ..runtime.wgrad_store import current_store

        stage: EmulatedStage = ctx.stage
        c = stage.costs
        saved = ctx.saved_tensors
        store = current_store()
        grad_in = None if ctx.in_shape is None else grad.new_zeros(ctx.in_shape)
        if store is not None:  # B now, W later
            stage.clock.sleep(c.t_b, Op.B)
            keep = saved[1] if len(saved) > 1 and saved[1].numel() > 0 else None
            weight, clock = stage.weight, stage.clock

            def weight_grad(keep=keep) -> None:  # holds mem_w until W
                clock.sleep(c.t_w, Op.W)
                if weight.grad is None:
                    weight.grad = torch.ones_like(weight)
                else:
                    weight.grad += 1.0
                del keep

            store.put(weight_grad, params=(weight,))
            stage.deferred += 1
            return grad_in, None, None
        stage.clock.sleep(c.t_b + c.t_w, Op.BW)  # fused backward
        return grad_in, torch.ones_like(stage.weight), None


class EmulatedStage(torch.nn.Module):
    """One pipeline stage whose compute is a calibrated sleep (see the module docstring).

    Args:
        stage, num_stages: this stage's index and the number of stages.
        costs: target durations and held memory of one microbatch on this stage.
        shape: the transfer shape ``[seq, micro_batch, hidden]``.
        clock: shared by the stages of one rank (one offset table per process).
        config: an :class:`EmulatedConfig` (``hidden_size`` must equal ``shape[-1]``).

    The stage has one parameter (``weight``, shape ``[1]``); every microbatch's weight gradient
    adds 1 to ``weight.grad`` (inline in ``BW``, in ``W`` for split schedules), so after an
    iteration ``weight.grad == m`` whatever the schedule.
    """

    def __init__(self, *, stage: int, num_stages: int, costs: EmulatedCosts, shape: Sequence[int],
                 clock: SleepClock | None = None, config: EmulatedConfig | None = None) -> None:
        super().__init__()
        from megatron.core.transformer.enums import ModelType

        self.stage, self.num_stages = stage, num_stages
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.costs = costs
        self.shape = tuple(shape)
        self.clock = clock if clock is not None else SleepClock()
        self.config = config if config is not None else EmulatedConfig(hidden_size=self.shape[-1])
        if self.config.hidden_size != self.shape[-1]:
            raise ValueError(f"config.hidden_size {self.config.hidden_size} != transfer shape {self.shape}")
        self.model_type = ModelType.encoder_or_decoder
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.input_tensor: torch.Tensor | None = None
        self.deferred = 0  # B passes that queued their W (for tests and stats)

    def set_input_tensor(self, input_tensor: Any) -> None:
        """megatron-core's hook: the received activation (``[None]`` on the first stage)."""
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, (list, tuple)) else input_tensor

    def forward(self, batch: Any = None) -> torch.Tensor:
        x = None if self.is_first else self.input_tensor
        if not self.is_first and x is None:
            raise RuntimeError(f"emulated stage {self.stage}: no input tensor was set")
        return _EmulatedCompute.apply(x, self.weight, self)


def emulated_loss_func(output: torch.Tensor):
    """megatron-style loss function: (loss, {"lm loss": detached loss})."""
    loss = output.float().mean()
    return loss, {"lm loss": loss.detach()}


def emulated_forward_step(data_iterator: Iterator[Any] | None, model: torch.nn.Module):
    """megatron-style forward step: draw the microbatch (when an iterator is given), run the stage."""
    batch = next(data_iterator) if data_iterator is not None else None
    return model(batch), emulated_loss_func


def build_emulated_stages(*, stage_to_rank: Sequence[int], rank: int, costs: Sequence[EmulatedCosts],
                          shape: Sequence[int], clock: SleepClock | None = None) -> list[EmulatedStage]:
    """This rank's stages of a placement, in ascending stage order (the runtime's chunk order)."""
    clock = clock if clock is not None else SleepClock()
    n = len(stage_to_rank)
    if len(costs) != n:
        raise ValueError(f"{len(costs)} cost entries for {n} stages")
    return [EmulatedStage(stage=s, num_stages=n, costs=costs[s], shape=shape, clock=clock)
            for s in range(n) if stage_to_rank[s] == rank]


# ---------------------------------------------------------------------- benchmark body
def measure_p2p_latency(shape: Sequence[int], *, peer_pairs: Sequence[tuple[int, int]] = ((0, 1),),
                        rounds: int = 30, warmup: int = 5, passes: int = 3, group: Any = None) -> float:
    """One-way latency (seconds) of a ``shape`` float32 transfer over ``torch.distributed``.

    Collective over the default group: the ranks of each pair in ``peer_pairs`` ping-pong
    (isend/irecv + wait, as the runtime does), the others wait. Each of ``passes`` passes takes
    the median over all pairs' round trips / 2; the result is the smallest pass median (a pass
    disturbed by other processes on the machine does not count) and is the same on every rank.
    """
    import torch.distributed as dist

    me = dist.get_rank()
    medians = []
    for _ in range(passes):
        lat: list[float] = []
        for a, b in peer_pairs:
            if me not in (a, b):
                continue
            peer = b if me == a else a
            buf = torch.zeros(tuple(shape))
            for i in range(warmup + rounds):
                t0 = time.perf_counter()
                if me == a:
                    dist.isend(buf, dst=peer, tag=7).wait()
                    dist.irecv(buf, src=peer, tag=8).wait()
                else:
                    dist.irecv(buf, src=peer, tag=7).wait()
                    dist.isend(buf, dst=peer, tag=8).wait()
                if i >= warmup and me == a:
                    lat.append((time.perf_counter() - t0) / 2)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, lat, group=group)
        allv = [x for g in gathered for x in g]
        medians.append(statistics.median(allv) if allv else 0.0)
    return min(medians)


def _stage_costs(schedule_name: str, p: int, base: EmulatedCosts) -> list[EmulatedCosts]:
    """Per-stage targets: one full stage per rank, or half a stage per chunk on the V placement."""
    from ..schedules.registry import get_spec

    v = get_spec(schedule_name).chunks_per_rank(2)
    c = EmulatedCosts(base.t_f / v, base.t_b / v, base.t_w / v, base.mem_b_bytes // v, base.mem_w_bytes // v)
    return [c] * (p * v)


def _sleep_errors(timing: Any, chunks: Sequence["EmulatedStage"]) -> dict[Op, list[float]]:
    """Measured - target (seconds) of each compute action of one iteration's ``timing``, per op."""
    by_stage = {c.stage: c.costs for c in chunks}
    out: dict[Op, list[float]] = {}
    for a, t0, t1 in timing.records:
        c = by_stage[a.stage]
        target = {Op.F: c.t_f, Op.B: c.t_b, Op.W: c.t_w, Op.BW: c.t_b + c.t_w}[a.op]
        out.setdefault(a.op, []).append((t1 - t0) - target)
    return out


def emulated_rank(spec: dict[str, Any]) -> dict[str, Any]:
    """Benchmark body for one rank of the emulated cluster (run under ``run_distributed``).

    ``spec`` keys: ``schedules`` (names), ``m``, ``t_f``/``t_b``/``t_w`` (seconds per full stage),
    ``mem_w_ratio`` (M_W / M_B for the schedule builders), ``shape`` (transfer shape),
    ``warmup``, ``repeats``, ``calibrate`` (bool), ``timeout``.

    Steps: measure the p2p latency ``T_comm``; build every schedule with the cost model (times in
    ms, ``T_comm`` measured, memory in units of one full stage's ``M_B``); warm up round-robin
    while calibrating the sleeps; then time ``repeats`` rounds, round-robin over the schedules.
    Returns, per schedule: every timed iteration's (start, end) on this rank, the delay from
    entering ``forward_backward`` to this rank's first compute action, the measured durations of
    every compute action (per op and stage), every timed iteration's compute-action records
    ``(op, mb, stage, start, end)``, the duration of every ``isend`` call, the cost model the schedules were built with, and checks
    (losses returned, W deferred, weight grads).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    from ..runtime import Measure, get_forward_backward_func
    from ..schedules import CostModel
    from ..testing.distributed import init_parallel_state
    from ..testing.tiny_gpt import placement_for

    p = dist.get_world_size()
    init_parallel_state(pipeline_model_parallel_size=p, seed=None)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    shape = tuple(spec["shape"])
    m = int(spec["m"])
    base = EmulatedCosts(spec["t_f"], spec["t_b"], spec["t_w"])
    pairs = [(i, i + 1) for i in range(0, p - 1, 2)]
    t_comm = measure_p2p_latency(shape, peer_pairs=pairs)
    clock = SleepClock()

    runs = {}
    for name in spec["schedules"]:
        s2r = placement_for(name, p)
        v = len(s2r) // p
        stage_costs = _stage_costs(name, p, base)
        ms = 1e3
        cost_model = CostModel(t_f=[c.t_f * ms for c in stage_costs], t_b=[c.t_b * ms for c in stage_costs],
                               t_w=[c.t_w * ms for c in stage_costs], t_comm=t_comm * ms,
                               mem_b=1.0 / v, mem_w=spec.get("mem_w_ratio", 0.5) / v)
        fb = get_forward_backward_func(name, costs=cost_model, timeout=spec.get("timeout", 60.0))
        chunks = build_emulated_stages(stage_to_rank=s2r, rank=rank, costs=stage_costs, shape=shape, clock=clock)
        runs[name] = dict(fb=fb, chunks=chunks, costs=cost_model, s2r=s2r)

    def one_iteration(name: str) -> tuple[float, float, Any]:
        r = runs[name]
        for c in r["chunks"]:
            c.weight.grad = None
        data = [iter(range(m)) for _ in r["chunks"]]
        dist.barrier()
        t0 = time.perf_counter()
        measured = r["fb"].run(Measure(time_actions=True), forward_step_func=emulated_forward_step,
                               data_iterator=data if len(data) > 1 else data[0],
                               model=r["chunks"] if len(r["chunks"]) > 1 else r["chunks"][0],
                               num_microbatches=m, seq_length=shape[0], micro_batch_size=shape[1])
        t1 = time.perf_counter()
        for c in r["chunks"]:
            if c.weight.grad is None or float(c.weight.grad) != m:
                raise RuntimeError(f"{name}: stage {c.stage} accumulated weight grad "
                                   f"{None if c.weight.grad is None else float(c.weight.grad)}, expected {m}")
        if r["fb"].store.pending():
            raise RuntimeError(f"{name}: weight-gradient work left pending: {r['fb'].store.pending()}")
        return t0, t1, measured

    calibrate = spec.get("calibrate", True)
    progress = RoundProgress(f"emulated p={p}", int(spec["warmup"]) + int(spec["repeats"]), enabled=rank == 0)
    for it in range(int(spec["warmup"])):
        errs: dict[str, list[float]] = {}
        round_ms = {}
        for name in spec["schedules"]:
            t0, t1, measured = one_iteration(name)
            round_ms[name] = 1e3 * (t1 - t0)
            for op, e in _sleep_errors(measured.timing, runs[name]["chunks"]).items():
                errs.setdefault(op, []).extend(e)
        progress.round(m=m, times_ms=round_ms, what="warm-up (calibration) round")
        if calibrate and it >= 1:  # the first round pays one-time costs: do not learn from it
            clock.update(errs, gain=0.8)

    comm_samples: list[float] = []  # p2p latency measured again before every timed round
    times: dict[str, list[tuple[float, float]]] = {n: [] for n in spec["schedules"]}
    records: dict[str, list[list[tuple[str, int, int, float, float]]]] = {n: [] for n in spec["schedules"]}
    startup: dict[str, list[float]] = {n: [] for n in spec["schedules"]}
    send_calls: dict[str, list[float]] = {n: [] for n in spec["schedules"]}  # isend call, seconds
    achieved: dict[str, dict[Op, dict[int, list[float]]]] = {}
    losses_ok: dict[str, bool] = {}
    for _ in range(int(spec["repeats"])):
        comm_samples.append(measure_p2p_latency(shape, peer_pairs=pairs, rounds=10, warmup=2, passes=1))
        for name in spec["schedules"]:
            t0, t1, measured = one_iteration(name)
            times[name].append((t0, t1))
            losses, timing = measured.data, measured.timing
            recs = timing.records
            records[name].append([(a.op, a.mb, a.stage, a0, a1) for a, a0, a1 in recs])
            if recs:  # from entering forward_backward to this rank's first compute action
                startup[name].append(recs[0][1] - t0)
            send_calls[name].extend(b - a for act, a, b in timing.comm
                                    if act.op.startswith("SEND"))
            rec = achieved.setdefault(name, {})
            for op in COMPUTE_OPS:
                for st, ds in timing.durations(op).items():
                    rec.setdefault(op, {}).setdefault(st, []).extend(ds)
            holds_loss = runs[name]["s2r"][-1] == rank
            losses_ok[name] = losses_ok.get(name, True) and len(losses) == (m if holds_loss else 0)
        progress.round(m=m, times_ms={n: 1e3 * (times[n][-1][1] - times[n][-1][0]) for n in spec["schedules"]})
    return dict(rank=rank, t_comm=t_comm, comm_samples=comm_samples, times=times, startup=startup,
                send_calls=send_calls,
                records=records, achieved=achieved, offsets=dict(clock.offset),
                costs={n: runs[n]["costs"] for n in runs}, s2r={n: runs[n]["s2r"] for n in runs},
                losses_ok=losses_ok, deferred={n: sum(c.deferred for c in runs[n]["chunks"]) for n in runs})


def emulated_check_rank(schedules: Sequence[str], m: int, t_ms: float = 1.0,
                        shape: Sequence[int] = (8, 1, 16)) -> dict[str, Any]:
    """One untimed iteration per schedule on emulated stages (run under ``run_distributed``).

    Returns per schedule, for this rank: number of losses returned, B passes whose W was
    deferred, W work executed by the store, pending W after the iteration, the weight
    gradients of this rank's stages (each must equal ``m``), the communication actions
    ``time_actions`` timed next to those of the rank's plan, the plan's compute actions and the
    executor's :class:`~megatron_zb.runtime.executor.LoopOverhead` of the call.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    from ..runtime import Measure, get_forward_backward_func
    from ..testing.distributed import init_parallel_state
    from ..testing.tiny_gpt import placement_for

    p = dist.get_world_size()
    init_parallel_state(pipeline_model_parallel_size=p, seed=None)
    rank = parallel_state.get_pipeline_model_parallel_rank()
    t = t_ms * 1e-3
    out: dict[str, Any] = {}
    for name in schedules:
        s2r = placement_for(name, p)
        chunks = build_emulated_stages(stage_to_rank=s2r, rank=rank,
                                       costs=_stage_costs(name, p, EmulatedCosts(t, t, t)), shape=shape)
        fb = get_forward_backward_func(name, timeout=30.0)
        store = fb.store
        data = [iter(range(m)) for _ in chunks]
        before = store.executed
        measured = fb.run(Measure(time_actions=True), forward_step_func=emulated_forward_step,
                          data_iterator=data if len(data) > 1 else data[0],
                          model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=m, seq_length=shape[0],
                          micro_batch_size=shape[1])
        losses = measured.data
        out[name] = dict(losses=len(losses), deferred=sum(c.deferred for c in chunks),
                         w_executed=store.executed - before, pending=store.pending(),
                         weight_grads=[None if c.weight.grad is None else float(c.weight.grad) for c in chunks],
                         holds_loss=s2r[-1] == rank,
                         comm_timed=[(a.op, a.mb, a.stage, t1 >= t0) for a, t0, t1 in measured.timing.comm],
                         comm_planned=[(a.op, a.mb, a.stage, True) for a in fb.plan_for(p, m, rank).actions
                                       if not a.is_compute],
                         compute_planned=sum(a.is_compute for a in fb.plan_for(p, m, rank).actions),
                         overhead=measured.overhead)
    return out

"""Profile-then-replan for ``pretrain_gpt_zb.py``: measure T_F/T_B/T_W/T_comm, rebuild the schedule.

During the profiled iterations ``[--zero-bubble-pipeline-timers-start-iter,
--zero-bubble-pipeline-timers-end-iter)`` the runtime records the time of every compute action
(``Measure(time_actions=True)``; :class:`~megatron_zb.runtime.action_timing.ActionTiming`): ``perf_counter``
seconds on CPU; on CUDA, CUDA events around each action, not synchronised per action --
:class:`~megatron_zb.training.cost_window.CostWindow` keeps the window's iterations and resolves them all with one
synchronisation when the window ends, so the durations are GPU time (verified on CPU with a mocked
event only, not run on a GPU). :class:`ActionProfile` collects them per stage (the
profile's costs are the **medians** per ``(op, stage)``: one action the OS descheduled, or the
first iterations' allocator warm-up, must not set a stage's cost), together with each rank's busy
time (sum of its compute actions) and the wall time of its ``forward_backward_func`` calls, and two
measured times the simulator does not produce itself (medians over the profiled iterations):

* the runtime's own time per compute action (:func:`runtime_seconds`: the executor loop, ``isend``
  calls, receives posted ahead; not the waits for a peer's data) -- the profile's
  ``action_overhead_ms``, mean over pipeline ranks;
* the time from an iteration's last compute action to the start of the next iteration
  (``finalize_model_grads`` with the tied-embedding and DP reduces, the optimizer step, zeroing,
  loss reduction, logging; one sample per pair of consecutive profiled iterations, so a window of
  ``n`` iterations gives ``n - 1``) -- the profile's ``step_ms``, the minimum over pipeline ranks
  (the rank that ends the pipeline last waits least in the reduces that follow).

Both are host times: the runtime's loop runs on the host, and the next iteration's start is the
host's. On CUDA the last compute action's end is its resolved GPU time, placed on the host clock by
the iteration's start event (exact when the device had no work queued when the iteration began;
not run on a GPU). The busy time is GPU time on CUDA, the elapsed time the host's wall time of the
calls (which on CUDA can end before the device does).

The durations themselves also give the profile's **spread**: each action divided by the median of
its ``(op, stage)``, pooled over all stages per op, as quantiles
(:class:`~megatron_zb.schedules.spread.DurationSpread`; ``plan --profile`` predicts the median
iteration over draws from it, not the iteration of the medians).

Every action is kept on both clocks: ``costs_ms`` holds the device medians (above), ``host_ms`` the
medians of the host time from the action's start to the return of its code (on CPU the same clock:
host = device), and on CUDA ``waited_ms`` the median of each action's upper bound on the time the
device waited for the host inside it
(:func:`~megatron_zb.runtime.action_timing.device_waits`), from which
:mod:`megatron_zb.training.host_bound` flags host-bound ops (verified with a mocked CUDA clock on CPU
only, never on a GPU).

After the window:

1. :func:`measure_t_comm`: a short ping-pong of one activation-sized tensor between every pair of
   neighbouring pipeline ranks (one pair at a time); ``T_comm`` is half the median round trip.
2. :func:`agree_on_profile`: every rank all-gathers its stages' medians over its pipeline group;
   then the numbers of global rank 0's pipeline are broadcast to *every* rank, so all ranks
   (all pipelines, all tensor-parallel ranks) build the same schedule from identical inputs.
3. :func:`cost_model`: the :class:`~megatron_zb.schedules.CostModel` in milliseconds and bytes.

Memory is measured too (the runtime's activation tracker is on in the window's first iteration --
its hooks slow the actions down by 10-15% at hidden 64, so with two or more window iterations the
first gives the bytes only and the others the times only -- with recomputation as configured): per action the net change of the bytes autograd keeps saved for backward
(:meth:`~megatron_zb.runtime.memory.ActivationMemoryTracker.bytes_between` its start and end).
Per stage, ``M_B`` is the mean change over its F actions (what one microbatch's forward leaves
allocated until its B) and ``M_W = M_B + (mean change over its B actions)`` (what B leaves for W:
the weight-gradient closures' inputs, including tensors a recomputed block saved in B), capped at
``M_B`` (with full recomputation the uncapped value is larger; the report then prints a warning
with both); with a fused ``BW`` ``M_W = 0``. The cost model itself accepts ``M_W > M_B`` (``B``
allocates the difference); the re-plan keeps the cap because its limit, ``N x chunks x max_s M_B``
below, can be smaller than what one microbatch holds after its ``B`` -- no schedule would fit it,
and raising a limit the user set is not this module's call (issue 30; not decided). The cost model then holds these bytes and the
activation limit ``--zero-bubble-max-pending-backward N`` becomes ``N x chunks x max_s M_B``
bytes (the registry's own limits, e.g. ZB-2p's ``2p x max M_B``, follow the measured ``mem_b``).
Without measured bytes (a stage measured ``M_B <= 0``) the unit model of before is used, with a
warning: ``mem_b = 1`` and ``mem_w / mem_b = 32h / (34h + 5as)`` (:func:`mem_w_ratio`).

Fused ``BW`` actions (1F1B) are reported as ``T_BW`` (there is no separate T_W to measure);
the cost model then uses ``t_b = T_BW`` and ``t_w = 0``, which simulates the fused backward exactly.

With vocabulary parallelism (``--enable-vocab-parallel``) the passes ``IF``/``S``/``T``/``IB`` are actions
too (their stage is the rank) and are timed the same way; their collectives are steps of the rank's
program between actions (waits included), so no action holds a wait for another rank; a ``W``'s share of
``T``'s deferred weight gradient is taken out of it (``ActionTiming.intervals`` ``("TW", stage, mb)``, the
actions' own clock); per rank their medians become the cost model's
:class:`~megatron_zb.schedules.costs.VocabCosts`, with ``t_collective`` from the forward barriers
(``("C0", mb)``, :func:`collective_ms`) and the deferred weight gradients added to their ``W``'s ``t_w``
(:func:`cost_model`; docs/vocab_parallel.md, "The flag").
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..runtime.action_timing import ActionTiming
from ..schedules.costs import CostModel, VocabCosts
from ..schedules.ir import Op
from ..planning.memory import mem_w_ratio
from ..schedules.spread import DurationSpread

__all__ = ["ActionProfile", "AgreedProfile", "agree_on_profile", "collective_ms", "cost_model", "mem_w_ratio",
           "measure_t_comm", "vocab_line"]

MemoryTracker = Any  # megatron_zb.runtime.memory.ActivationMemoryTracker (imported lazily with the runtime)


@dataclass
class ActionProfile:
    """Per-stage action times (seconds), activation bytes per action, and per-rank busy/elapsed
    time over the profiled iterations."""

    durations: dict[tuple[str, int], list[float]] = field(default_factory=dict)  # (op, stage) -> seconds each
    byte_sums: dict[tuple[str, int], float] = field(default_factory=dict)  # (op, stage) -> net bytes kept
    byte_counts: dict[tuple[str, int], int] = field(default_factory=dict)
    busy: float = 0.0      # seconds this rank spent in compute actions
    elapsed: float = 0.0   # seconds this rank spent in forward_backward_func calls
    iterations: int = 0
    overhead: list[float] = field(default_factory=list)  # per iteration: runtime seconds per compute action
    outside: list[float] = field(default_factory=list)   # per sample: seconds outside the schedule's actions
    t_weight: dict[int, float] = field(default_factory=dict)  # W's stage -> seconds of T's weight gradients it ran
    barriers: list[dict[int, float]] = field(default_factory=list)  # per iteration: mb -> the forward barrier [s]
    host_durations: dict[tuple[str, int], list[float]] = field(default_factory=dict)  # (op, stage) -> host s each
    waits: dict[tuple[str, int], list[float]] = field(default_factory=dict)  # CUDA: (op, stage) -> device s waited
    clock: str = "host"  # "host": the device times are the host's (CPU); "cuda_events": CUDA events

    def add(self, timing: ActionTiming, elapsed: float, memory: MemoryTracker | None = None, *,
            times: bool = True) -> None:
        """Add one iteration: ``timing`` is the call's :attr:`~megatron_zb.runtime.measure.Measured.timing`,
        resolved (on CUDA :class:`~megatron_zb.training.cost_window.CostWindow` resolves the window's timings
        with one synchronisation), ``elapsed`` the seconds of the call, ``memory`` its ``Measured.memory`` (the
        activation tracker, or ``None``: no bytes measured); ``times=False``: the bytes only (an
        iteration slowed down by the tracker). Durations come from ``timing.records`` (GPU time on
        CUDA), ``host_durations`` from ``timing.host_records`` (the same on CPU), a ``W`` less ``T``'s
        weight gradients it ran (``timing.intervals``); on CUDA ``waits`` gets each action's
        bound on the device's wait for the host (:meth:`~megatron_zb.runtime.action_timing.ActionTiming.host_waits`);
        the bytes come from ``timing.host_records`` (the tracker logs host ``perf_counter`` times)."""
        if times:
            if timing.records:
                self.overhead.append(runtime_seconds(timing) / len(timing.records))
            intervals = timing.intervals  # vocabulary passes: T's weight gradients inside W's, the barriers
            waits = timing.host_waits()
            if waits is not None:
                self.clock = "cuda_events"
            for i, ((action, t0, t1), (_, h0, h1)) in enumerate(zip(timing.records, timing.host_records)):
                tw = ("TW", action.stage, action.mb) if action.op is Op.W else None
                key = (action.op, action.stage)
                d = max(0.0, t1 - t0 - intervals.get(tw, 0.0))
                self.durations.setdefault(key, []).append(d)
                self.host_durations.setdefault(key, []).append(max(0.0, h1 - h0 - timing.host_intervals.get(tw, 0.0)))
                if waits is not None:
                    self.waits.setdefault(key, []).append(waits[i])
                self.busy += d
            for key, seconds in intervals.items():
                if key[0] == "TW":
                    self.t_weight[key[1]] = self.t_weight.get(key[1], 0.0) + seconds
            barriers = {key[1]: seconds for key, seconds in intervals.items() if key[0] == "C0"}
            if barriers:
                self.barriers.append(barriers)
            self.elapsed += elapsed
            self.iterations += 1
        if memory is not None:
            for action, h0, h1 in timing.host_records:
                key = (action.op, action.stage)
                self.byte_sums[key] = self.byte_sums.get(key, 0.0) + memory.bytes_between(h0, h1)
                self.byte_counts[key] = self.byte_counts.get(key, 0) + 1

    def medians_ms(self) -> dict[tuple[str, int], float]:
        """Median duration per ``(op, stage)`` in milliseconds (robust to an action the OS descheduled);
        with vocabulary passes also ``("TW", stage)``: ``T``'s weight gradients run by the stage's ``W``'s,
        per ``W`` (their sum over the number of ``W``'s: the share each ``W`` carries on average)."""
        out = _medians_ms(self.durations)
        for stage, seconds in self.t_weight.items():
            out[("TW", stage)] = 1e3 * seconds / len(self.durations[(Op.W, stage)])
        return out

    def host_medians_ms(self) -> dict[tuple[str, int], float]:
        """Median host time per ``(op, stage)`` in milliseconds (on CPU the same as :meth:`medians_ms`,
        without its ``TW`` entries)."""
        return _medians_ms(self.host_durations)

    def wait_medians_ms(self) -> dict[tuple[str, int], float]:
        """CUDA: median per ``(op, stage)`` of the bound on the device's wait for the host inside an
        action, in milliseconds (:func:`~megatron_zb.runtime.action_timing.device_waits`); empty on CPU."""
        return _medians_ms(self.waits)

    def mean_bytes(self) -> dict[tuple[str, int], float]:
        """Mean net change of the saved-activation bytes per ``(op, stage)`` action [bytes]."""
        return {k: self.byte_sums[k] / self.byte_counts[k] for k in self.byte_sums}

    def add_outside(self, seconds: float) -> None:
        """Add one measured time from the end of an iteration's last compute action to the start of
        the next iteration's ``forward_backward_func`` work (:func:`runtime_seconds`' complement)."""
        self.outside.append(seconds)

    @property
    def idle_fraction(self) -> float:
        """``1 - busy / elapsed`` over the profiled iterations (0 when nothing was profiled)."""
        return max(0.0, 1.0 - self.busy / self.elapsed) if self.elapsed > 0 else 0.0


def runtime_seconds(timing: ActionTiming) -> float:
    """The runtime's own time in one iteration of one rank, seconds: from the start of the executor
    call to the end of its last compute action, minus the compute actions, minus the receive
    actions (posting plus waiting for a peer's data: the wait is what the simulator's dependencies
    and ``T_comm`` model) and minus the vocabulary collectives' steps (what the simulator's barriers
    and ``t_collective`` model). What is left is the loop and its bookkeeping, the ``isend`` calls and the
    receives posted ahead -- the time between compute actions the simulator does not see. Host
    time (``timing.host_records``, ``timing.comm``): the loop runs on the host; on CUDA a compute
    action's host time is its kernel launches, which count as compute here too."""
    host = timing.host_records
    last = max(t1 for _, _, t1 in host)
    compute = sum(t1 - t0 for _, t0, t1 in host)
    recv = sum(t1 - t0 for a, t0, t1 in timing.comm if a.op.is_recv and t1 <= last)
    collectives = sum(t1 - t0 for _, t0, t1 in timing.collectives if t1 <= last)
    return max(0.0, last - timing.start - compute - recv - collectives)


def _median_ms(values: Sequence[float]) -> float | None:
    return 1e3 * statistics.median(values) if values else None


def _medians_ms(samples: dict[tuple[str, int], list[float]]) -> dict[tuple[str, int], float]:
    """The median of each ``(op, stage)``'s seconds, in milliseconds."""
    return {k: 1e3 * statistics.median(v) for k, v in samples.items()}


def measure_t_comm(*, shape: Sequence[int], dtype: torch.dtype, device: torch.device, group: Any,
                   rounds: int = 10, warmup: int = 2) -> float | None:
    """Half the median round-trip time (ms) of ``shape`` between this rank and its next pipeline rank
    (the median: one round trip the OS delayed must not set the cost of every transfer).

    Collective over ``group`` (the pipeline group): the pairs ``(r, r+1)`` take turns, the other
    ranks wait. Returns the measurement on the lower rank of each pair (``None`` on the last rank
    and with a single pipeline rank).
    """
    size, me = dist.get_world_size(group), dist.get_rank(group)
    if size == 1:
        return None
    buf = torch.zeros(*shape, dtype=dtype, device=device)
    result = None
    for r in range(size - 1):
        if me not in (r, r + 1):
            continue
        peer = dist.get_global_rank(group, r + 1 if me == r else r)
        trips = []
        for i in range(warmup + rounds):
            t0 = time.perf_counter()
            if me == r:
                dist.send(buf, peer, group=group)
                dist.recv(buf, peer, group=group)
            else:
                dist.recv(buf, peer, group=group)
                dist.send(buf, peer, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                trips.append(time.perf_counter() - t0)
        if me == r:
            result = 1e3 * statistics.median(trips) / 2
    dist.barrier(group=group)
    return result


@dataclass(frozen=True)
class AgreedProfile:
    """The profile every rank uses (global rank 0's pipeline): per-stage median action times (ms), T_comm (ms),
    idle fraction per pipeline rank, mean net activation bytes per action (``bytes``: empty when
    memory was not measured), and the runtime's measured time per compute action and outside the
    schedule's actions (ms, ``None`` when not measured; :func:`agree_on_profile`); per ``(op, stage)``
    also the median host time (``host_ms``) and, on CUDA, the median bound on the device's wait for the
    host inside an action (``waited_ms``; the device times are ``costs_ms``)."""

    costs_ms: dict[tuple[str, int], float]
    t_comm: float
    idle_fraction: list[float]  # per pipeline rank
    iterations: int
    bytes: dict[tuple[str, int], float] = field(default_factory=dict)
    action_overhead_ms: float | None = None  # runtime time per compute action (mean over ranks of medians)
    step_ms: float | None = None  # time outside the schedule's actions per iteration (min over ranks of medians)
    spread: DurationSpread | None = None  # how single F / B / W durations vary around their medians (all stages)
    t_collective: float | None = None  # vocabulary passes: one collective's time (ms; agree_on_profile)
    host_ms: dict[tuple[str, int], float] = field(default_factory=dict)  # median host time per (op, stage) [ms]
    waited_ms: dict[tuple[str, int], float] = field(default_factory=dict)  # CUDA: median bound on the device's
    #                     wait for the host per (op, stage) [ms] (ActionProfile.wait_medians_ms); empty on CPU
    clock: str = "host"  # the device times' clock: "host" (CPU: host = device) or "cuda_events"

    def per_stage(self, op: str, num_stages: int) -> list[float] | None:
        vals = [self.costs_ms.get((op, s)) for s in range(num_stages)]
        return None if any(v is None for v in vals) else [float(v) for v in vals]

    def activation_bytes(self, num_stages: int) -> tuple[list[float], list[float]] | None:
        """Measured ``(M_B, M_W)`` per stage [bytes] (module doc), or ``None`` when not measured
        (or a stage's ``M_B`` is not positive)."""
        m_b = [self.bytes.get(("F", s)) for s in range(num_stages)]
        if any(v is None or v <= 0 for v in m_b):
            return None
        m_w = self.bytes_held_for_w(num_stages)
        if m_w is None:
            return None
        return [float(v) for v in m_b], [min(b, w) for b, w in zip(m_b, m_w)]  # type: ignore[type-var]

    def bytes_held_for_w(self, num_stages: int) -> list[float] | None:
        """``M_B + (mean change over B)`` per stage [bytes], *not* capped at ``M_B`` (0 with a fused BW;
        ``None`` when not measured). With full recomputation it can exceed ``M_B``: B rebuilds the
        activations and the W closures keep the linear layers' inputs, while F kept only block inputs."""
        if not self.split_backward(num_stages):
            return [0.0] * num_stages
        vals = [(self.bytes.get(("F", s)), self.bytes.get(("B", s))) for s in range(num_stages)]
        if any(f is None or b is None for f, b in vals):
            return None
        return [max(0.0, f + b) for f, b in vals]  # type: ignore[operator]

    def vocab_costs(self, num_ranks: int) -> VocabCosts | None:
        """The vocabulary passes' measured :class:`VocabCosts` (ms, per rank: the medians of ``IF``, ``S``,
        ``T``, ``IB`` without their waits, ``t_collective``), or ``None`` when a pass was not timed on every rank.
        ``mem_s`` is not measured (0)."""
        times = [self.per_stage(op, num_ranks) for op in ("IF", "S", "T", "IB")]
        if any(v is None for v in times):
            return None
        t_if, t_s, t_t, t_ib = times
        return VocabCosts(t_if=t_if, t_s=t_s, t_t=t_t, t_ib=t_ib, t_collective=self.t_collective or 0.0)

    def split_backward(self, num_stages: int) -> bool:
        return self.per_stage("B", num_stages) is not None and self.per_stage("W", num_stages) is not None

    def report_costs(self, num_stages: int) -> dict[str, float]:
        """Mean over stages of each measured cost (ms), for the schedule report."""
        out: dict[str, float] = {}
        for op, name in (("F", "T_F"), ("B", "T_B"), ("W", "T_W"), ("BW", "T_BW")):
            vals = self.per_stage(op, num_stages)
            if vals is not None:
                out[name] = sum(vals) / len(vals)
        out["T_comm"] = self.t_comm
        return out


def agree_on_profile(profile: ActionProfile, t_comm: float | None, *, pp_group: Any) -> AgreedProfile:
    """Gather the profile over the pipeline group, then broadcast global rank 0's to every rank.

    Collective over ``pp_group`` and then over the default group.
    """
    mine = {"costs": profile.medians_ms(), "t_comm": t_comm, "idle": profile.idle_fraction,
            "iterations": profile.iterations, "bytes": profile.mean_bytes(),
            "overhead": _median_ms(profile.overhead), "outside": _median_ms(profile.outside),
            "durations": profile.durations, "barriers": profile.barriers, "host": profile.host_medians_ms(),
            "waited": profile.wait_medians_ms(), "clock": profile.clock}
    gathered: list[Any] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(gathered, mine, group=pp_group)
    costs: dict[tuple[str, int], float] = {}
    nbytes: dict[tuple[str, int], float] = {}
    host: dict[tuple[str, int], float] = {}
    waited: dict[tuple[str, int], float] = {}
    for g in gathered:
        costs.update(g["costs"])
        nbytes.update(g["bytes"])
        host.update(g["host"])
        waited.update(g["waited"])
    comms = [g["t_comm"] for g in gathered if g["t_comm"] is not None]
    overheads = [g["overhead"] for g in gathered]
    outside = [g["outside"] for g in gathered]
    durations = [xs for g in gathered for xs in g["durations"].items()]
    spread = DurationSpread.from_samples({op: [xs for (o, _), xs in durations if o == op] for op in (Op.F, Op.B, Op.W)})
    agreed = [AgreedProfile(costs_ms=costs, t_comm=sum(comms) / len(comms) if comms else 0.0,
                            idle_fraction=[float(g["idle"]) for g in gathered],
                            iterations=min(int(g["iterations"]) for g in gathered), bytes=nbytes,
                            action_overhead_ms=None if None in overheads else sum(overheads) / len(overheads),
                            step_ms=None if None in outside else min(outside),
                            spread=spread if spread.quantiles else None,
                            t_collective=collective_ms([g["barriers"] for g in gathered]), host_ms=host,
                            waited_ms=waited, clock=gathered[0]["clock"])]
    dist.broadcast_object_list(agreed, src=0)
    return agreed[0]


def collective_ms(barriers: list[list[dict[int, float]]]) -> float | None:
    """``t_collective`` (ms) from every pipeline rank's forward barriers (``barriers[rank][iteration][mb]``,
    seconds): per microbatch of an iteration the shortest over the ranks -- the rank that reached the
    barrier last, which waits for no other rank, only for the collectives (and the last rank's loss) --
    then the median over them; ``None`` without barriers."""
    samples = []
    for per_rank in zip(*barriers):  # one iteration, every rank
        for mb in set.intersection(*(set(b) for b in per_rank)):
            samples.append(min(b[mb] for b in per_rank))
    return 1e3 * statistics.median(samples) if samples else None


def cost_model(profile: AgreedProfile, *, num_stages: int, hidden_size: int, num_attention_heads: int,
               seq_length: int, max_pending_microbatches: int | None, num_chunks: int = 1,
               num_ranks: int | None = None) -> CostModel:
    """The schedule library's cost model from ``profile``: times in ms (each compute action's median
    plus the runtime's measured time per action, as ``plan --profile`` simulates it), memory in
    measured bytes (or in units of one stage's M_B when bytes were not measured, see the module doc).

    ``max_pending_microbatches``: ``--zero-bubble-max-pending-backward`` (``None``: the schedule's own
    limit); ``num_chunks``: model chunks per pipeline rank; ``num_ranks``: pipeline ranks, for the
    vocabulary passes' costs (:meth:`AgreedProfile.vocab_costs`, each plus the runtime's time per action,
    as every action; ``T``'s weight gradients run by ``W``'s added to those stages' ``t_w``: their ``TW``
    share), given when they were timed.
    """
    t_f = profile.per_stage("F", num_stages)
    if t_f is None:
        raise ValueError("no forward times were profiled for every stage")
    if profile.split_backward(num_stages):
        t_b, t_w = profile.per_stage("B", num_stages), profile.per_stage("W", num_stages)
    else:
        t_b, t_w = profile.per_stage("BW", num_stages), [0.0] * num_stages
        if t_b is None:
            raise ValueError("no backward times were profiled for every stage")
    floor = 1e-6  # the cost model needs t_f, t_b > 0
    measured = profile.activation_bytes(num_stages)
    if measured is not None:
        mem_b, mem_w = measured
    else:
        ratio = mem_w_ratio(hidden_size=hidden_size, num_attention_heads=num_attention_heads, seq_length=seq_length)
        mem_b, mem_w = [1.0] * num_stages, [ratio] * num_stages
    limit = None if max_pending_microbatches is None else float(max_pending_microbatches * num_chunks * max(mem_b))
    overhead = profile.action_overhead_ms or 0.0
    vocab = None if num_ranks is None else profile.vocab_costs(num_ranks)
    if vocab is not None:
        t_w = [w + profile.costs_ms.get(("TW", s), 0.0) for s, w in enumerate(t_w)]  # type: ignore[arg-type]
        vocab = replace(vocab, **{k: [v + overhead for v in getattr(vocab, k)] for k in ("t_if", "t_s", "t_t", "t_ib")})
    return CostModel(t_f=[max(v, floor) for v in t_f], t_b=[max(v, floor) for v in t_b], t_w=list(t_w),  # type: ignore[arg-type]
                     t_comm=profile.t_comm, mem_b=mem_b, mem_w=mem_w, memory_limit=limit, vocab=vocab
                     ).with_action_overhead(overhead, split_backward=profile.split_backward(num_stages))


def vocab_line(agreed: AgreedProfile, stages: int, num_ranks: int) -> str:
    """The report's line of the vocabulary passes: per rank (ms) the medians of ``IF``, ``S``, ``T``, ``IB``
    without their waits, ``T``'s weight gradient per ``W`` of each stage that ran it, ``t_collective``."""
    vc = agreed.vocab_costs(num_ranks)
    if vc is None:
        return "    vocabulary passes: not timed on every pipeline rank"
    tw = [agreed.costs_ms.get(("TW", s), 0.0) for s in range(stages)]
    return ("    measured vocabulary passes per rank (ms, without their waits): " + "; ".join(
        f"{name}=[{', '.join(f'{v:.3f}' for v in getattr(vc, key))}]"
        for name, key in (("T_IF", "t_if"), ("T_S", "t_s"), ("T_T", "t_t"), ("T_IB", "t_ib")))
        + f"; T's weight gradient per W, by stage: [{', '.join(f'{v:.3f}' for v in tw)}]; t_collective="
        + ("not measured" if agreed.t_collective is None else f"{agreed.t_collective:.3f}"))

"""Which pipeline schedule a run executes: install global rank 0's, profile, re-plan, report.

:class:`SchedulePlanner` owns the run's ``forward_backward_func``: megatron-zb's runtime running
the validated schedule, or megatron-core's own with ``--use-megatron-core-schedule`` (nothing to
plan then). With megatron-zb's runtime:

* every rank runs **global rank 0's** schedule (broadcast), so a generator that is not
  deterministic across processes (e.g. a time-limited solver) cannot give ranks different action
  lists; the placement must be the one the model was built for;
* iterations ``[--zero-bubble-pipeline-timers-start-iter, --zero-bubble-pipeline-timers-end-iter)``
  are profiled (:mod:`megatron_zb.training.profiling`); at the end of the window a cost-aware
  schedule is re-planned from the measured costs (times and activation bytes) on global rank 0
  and installed everywhere, and rank 0 prints the schedule report (with every op's host and device
  time per stage and, on CUDA, the ops the device spent mostly waiting for the host:
  :mod:`megatron_zb.training.host_bound`); with ``--profile-out FILE`` global rank 0 also writes the
  measured costs as a planning profile (:mod:`megatron_zb.planning.profile`, what
  ``megatron-zb plan --profile FILE`` reads; its ``action_times`` carry the host / device times);
* a run resumed after the window rebuilds the schedule from the costs its checkpoint stored;
* when the number of micro batches per iteration changes (``--rampup-batch-size``,
  :meth:`SchedulePlanner.use_microbatches`), global rank 0 builds the schedule for the new ``m`` --
  from the measured costs once the window re-planned (or the checkpoint's), else from unit costs --
  and installs it on every rank, with a report line; a schedule is never reused for another ``m``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch.distributed as dist

from megatron_zb.schedules import ScheduleError, simulate
from megatron_zb.schedules.registry import get_spec
from megatron_zb.schedules.costs import CostModel, VocabCosts
from megatron_zb.schedules.ir import Placement, Schedule
from megatron_zb.planning.profile import ActionTimes
from megatron_zb.training.distributed import DistributedContext
from megatron_zb.training.host_bound import action_times, action_times_lines
from megatron_zb.training.logging_utils import format_schedule_report, print_rank_0
from megatron_zb.training.profiling import (ActionProfile, AgreedProfile, ProfileWindow, agree_on_profile,
                                            cost_model, measure_t_comm, mem_w_ratio, vocab_line)
from megatron_zb.training.run_config import RunConfig

__all__ = ["SchedulePlanner", "planning_model", "planning_parallel"]


class SchedulePlanner:
    """The run's ``forward_backward_func`` and the schedule it runs (see the module docstring).

    Attributes:
        forward_backward: the callable with megatron-core's ``forward_backward_func`` signature.
        runtime: megatron-zb's ``ZeroBubbleForwardBackward`` (the same object), or ``None`` with
            megatron-core's schedule.
        profile: the action times of the profiled iterations (filled when the window ends).
        window: the profiled iterations as measured until then (:class:`ProfileWindow`: on CUDA
            their events are resolved with one synchronisation at the window's end).
        profiled_iterations: the iterations profiled so far.
        restored_costs: the cost model a resumed run re-planned from (``None`` otherwise).
        agreed: the profile the window measured, as every rank agreed on it (``None`` before the window ends).
        measured_costs: its cost model (ms, bytes; ``None`` before the window ends or when unusable),
            whether or not the schedule is cost-aware.
        num_microbatches: micro batches per iteration per data-parallel rank of the next training
            iteration (changes with ``--rampup-batch-size``).
    """

    def __init__(self, config: RunConfig, *, schedule: Schedule, dist_ctx: DistributedContext,
                 runtime: Any = None, vocab: Any = None) -> None:
        """Build the ``forward_backward_func`` (or own ``runtime``, megatron-zb's
        ``ZeroBubbleForwardBackward`` built elsewhere, e.g. by :func:`megatron_zb.patch_megatron`)
        and install global rank 0's ``schedule``. ``config``: the run (its ``schedule`` section, the
        model's sizes, the parallel layout, the training length). Collective. ``vocab``
        (``--enable-vocab-parallel``): the model's vocabulary slices
        (:class:`~megatron_zb.runtime.vocab_runtime.VocabParallelModel`), given to the runtime; the
        window then also times the passes ``IF``/``S``/``T``/``IB`` and the collectives
        (:meth:`~megatron_zb.training.profiling.AgreedProfile.vocab_costs`), and the re-plan uses them."""
        self.config = config
        self._dist = dist_ctx
        self._initial = schedule
        self._stage_to_rank = list(schedule.stage_to_rank)
        self.profile = ActionProfile()
        self.window = ProfileWindow()
        self.profiled_iterations: list[int] = []
        self.restored_costs: CostModel | None = None
        self.agreed: AgreedProfile | None = None  # the window's agreed profile, once it re-planned
        self.measured_costs: CostModel | None = None  # the cost model of that profile
        self.runtime: Any = None
        self.num_microbatches: int = schedule.num_microbatches
        self._installed: set[int] = {schedule.num_microbatches}  # m's whose schedule is rank 0's, current costs
        self._timed_previous = False  # the last profiled iteration measured times (its end starts a step_ms sample)
        self._bookkeeping = 0.0  # seconds the profiler itself spent after that iteration (left out of step_ms)
        self._bytes_only = self._times_tracked = False  # this iteration measures activation bytes (only)
        self._track_memory = False  # the runtime's track_memory outside the window
        self._vocab_parallel = vocab is not None
        self.vocab: Any = vocab  # the runtime's VocabParallelModel (its data_iterator is set by the trainer)
        if config.schedule.use_megatron_core_schedule:
            from megatron.core.pipeline_parallel import get_forward_backward_func as megatron_func
            self.forward_backward: Any = megatron_func()
            return
        if runtime is None:
            from megatron_zb.runtime import get_forward_backward_func

            extra: dict[str, Any] = {} if vocab is None else {"vocab_parallel": vocab}
            runtime = get_forward_backward_func(config.schedule.name, memory_limit=config.schedule.memory_limit,
                                                num_chunks=config.schedule.num_model_chunks,
                                                timeout=config.schedule.pipeline_timeout_seconds, **extra)
        self.runtime = runtime
        self._initial = self._rank0_schedule(schedule)
        self.runtime.install_schedule(self._initial)
        self.forward_backward = self.runtime
        self._track_memory = self.runtime.options.track_memory  # outside the window

    # ------------------------------------------------------------------ the profiling window
    @property
    def _window(self) -> tuple[int, int]:
        sched = self.config.schedule
        return sched.zero_bubble_pipeline_timers_start_iter, sched.zero_bubble_pipeline_timers_end_iter

    def profiles_after(self, iteration: int) -> bool:
        """Whether iterations after ``iteration`` will be profiled (for the start-of-training line)."""
        return self.runtime is not None and iteration < self._window[1] - 1

    def begin_iteration(self, iteration: int) -> bool:
        """Turn action timing on for a profiled ``iteration`` (off otherwise); returns whether it is profiled.

        Call it first thing in an iteration: when the previous iteration was profiled too, the time
        since that iteration's last compute action is the profile's time outside the schedule."""
        now = time.perf_counter()
        start, end = self._window
        profiling = self.runtime is not None and start <= iteration < end
        if profiling and self._timed_previous and self.profiled_iterations[-1:] == [iteration - 1]:
            self.window.add_next_start(now - self._bookkeeping)  # not the profiler's own time
        self._timed_previous = False
        # the activation tracker's hooks slow the actions down (10-15% at hidden 64): with two or more
        # window iterations the first measures the bytes only, the others the times only
        last = min(end - 1, self.config.train_iters)
        self._bytes_only = profiling and not self.profiled_iterations and iteration < last
        self._times_tracked = profiling and not self._bytes_only and not self.profiled_iterations
        if self.runtime is not None:
            self.runtime.iteration = iteration  # names the iteration of a late data-parallel reduce
            self.runtime.options.time_actions = profiling
            self.runtime.options.track_memory = self._bytes_only or self._times_tracked or self._track_memory
        return profiling

    def end_iteration(self, iteration: int, *, profiling: bool, seconds: float) -> bool:
        """Record a profiled iteration (``seconds``: wall time of its ``forward_backward_func`` call).

        Returns whether the window is over and :meth:`replan` is due now; then the window's timings
        are resolved (one synchronisation on CUDA) and added to :attr:`profile`.
        """
        timing = self.runtime.last_timing if profiling else None
        if timing is not None:
            t0 = time.perf_counter()
            memory = self.runtime.last_memory if (self._bytes_only or self._times_tracked) else None
            self.window.add(timing, seconds, memory, times=not self._bytes_only)
            self._bookkeeping = time.perf_counter() - t0
            self.profiled_iterations.append(iteration)
            self._timed_previous = not self._bytes_only and bool(timing.host_records)
        end = self._window[1]
        due = profiling and iteration == min(end - 1, self.config.train_iters) and bool(self.profiled_iterations)
        if due:
            self.window.close(self.profile)
        return due

    # ------------------------------------------------------------------ re-planning
    def replan(self) -> dict[str, Any] | None:
        """After the window: measure T_comm, agree on the costs, re-plan (cost-aware schedules), report,
        write ``--profile-out``. Each step is a method below.

        Returns the cost model the new schedule was built from, as checkpoints store it
        (:attr:`~megatron_zb.training.state.TrainState.schedule_costs`), or ``None`` when the
        schedule was kept. Collective.
        """
        self.runtime.options.time_actions = False
        self.runtime.options.track_memory = self._track_memory
        agreed = self.agreed = self._agreed_profile()
        costs = self.measured_costs = self._measured_costs(agreed)
        if costs is None:
            return None
        replanned, note = self._replan_from(costs)
        stages = self.config.schedule.num_pipeline_stages
        ranks = self.config.parallel.pipeline_model_parallel_size if self._vocab_parallel else None
        times = action_times(agreed, self.config)  # host / device per action, the host-bound diagnosis
        print_rank_0(self._window_report(agreed, costs) + "\n" + measured_lines(agreed, stages, num_ranks=ranks)
                     + "\n" + action_times_lines(times) + "\n" + note)
        if self.config.schedule.profile_out:
            self._write_profile(agreed, times)
        dist.barrier()
        return replanned

    def _agreed_profile(self) -> AgreedProfile:
        """Step 1: measure T_comm (one stage output sent to the next rank) and agree with the other
        pipeline ranks on the window's per-stage costs. Collective."""
        c = self.config
        tp = c.parallel.tensor_model_parallel_size
        seq = c.model.seq_length // tp if c.parallel.sequence_parallel else c.model.seq_length
        t_comm = measure_t_comm(shape=(seq, c.micro_batch_size, c.model.hidden_size), dtype=c.precision.params_dtype,
                                device=self._dist.device, group=self._dist.pp_group)
        return agree_on_profile(self.profile, t_comm, pp_group=self._dist.pp_group)

    def _measured_costs(self, agreed: AgreedProfile) -> CostModel | None:
        """Step 2: the schedule library's cost model of the agreed profile (``None``, with a warning:
        no usable costs, the schedule stays)."""
        c, stages = self.config, self.config.schedule.num_pipeline_stages
        try:
            costs = cost_model(agreed, num_stages=stages, hidden_size=c.model.hidden_size,
                               num_attention_heads=c.model.num_attention_heads, seq_length=c.model.seq_length,
                               max_pending_microbatches=c.schedule.max_pending_backward,
                               num_chunks=c.schedule.num_model_chunks,
                               num_ranks=c.parallel.pipeline_model_parallel_size if self._vocab_parallel else None)
        except ValueError as e:
            print_rank_0(f"WARNING: profiling gave no usable costs ({e}); keeping the schedule")
            return None
        if self._vocab_parallel and costs.vocab is None:
            print_rank_0("WARNING: the vocabulary passes were not timed on every pipeline rank; re-planning with "
                         "their default costs (VocabCosts())")
        if agreed.activation_bytes(stages) is None:
            print_rank_0("WARNING: no activation bytes were measured for every stage; planning memory in units "
                         "of M_B with M_W/M_B = 32h/(34h+5as)")
        return costs

    def _replan_from(self, costs: CostModel) -> tuple[dict[str, Any] | None, str]:
        """Step 3: a cost-aware schedule re-planned from ``costs`` on global rank 0 and installed
        everywhere; returns the costs as checkpoints store them (``None``: kept) and the report's
        last line. Collective."""
        name = self.config.schedule.name
        before = simulate(self._current(), costs, enforce_memory=False)
        if not self.config.schedule.cost_aware:
            return None, f"    schedule {name!r} is not cost-aware: kept as is"
        status, payload, seconds = self._replan_on_rank0(costs)
        if status != "ok":  # the unit-cost schedule stays
            return None, f"    WARNING: re-planning failed ({payload}); keeping the unit-cost schedule"
        return dataclasses.asdict(costs), (
            f"    re-planned {name!r} from the measured costs in {seconds:.2f} s; the unit-cost schedule "
            f"would have a predicted bubble rate of {100 * before.bubble_rate:.1f}% under them")

    def _window_report(self, agreed: AgreedProfile, costs: CostModel) -> str:
        """Step 4: the schedule report of the schedule now installed, under the measured ``costs``."""
        sim = simulate(self._current(), costs, enforce_memory=False)
        first, last = self.profiled_iterations[0], self.profiled_iterations[-1]
        peak, limit, unit = _memory_in_report(costs, sim.peak_memory)
        return format_schedule_report(
            schedule=self.config.schedule.name, num_ranks=self.config.parallel.pipeline_model_parallel_size,
            num_microbatches=self.num_microbatches, predicted_bubble_rate=sim.bubble_rate,
            peak_activation_memory=peak, memory_limit=limit, memory_unit=unit,
            measured_idle_fraction=agreed.idle_fraction,
            measured_costs=agreed.report_costs(self.config.schedule.num_pipeline_stages),
            title=f"schedule report after profiling iterations {first}-{last} "
                  f"(costs: mean over stages, ms; idle: 1 - busy/elapsed per pipeline rank)")

    def _write_profile(self, agreed: AgreedProfile, times: ActionTimes) -> None:
        """``--profile-out``: global rank 0 writes the measured costs as a planning profile, with
        ``times`` (every op's host and device time, the host-bound flags) as its ``action_times``."""
        if dist.get_rank() != 0:
            return
        from megatron_zb.planning.model import PlanError
        from megatron_zb.planning.profile import StageProfile, write_profile
        c, stages = self.config, self.config.schedule.num_pipeline_stages
        out = c.schedule.profile_out
        acts = agreed.activation_bytes(stages)
        if acts is None or not agreed.split_backward(stages):
            print_rank_0(f"WARNING: --profile-out {out} not written: T_B, T_W and the activation "
                         f"bytes were not measured for every stage")
            return
        medians = [agreed.per_stage(op, stages) for op in ("F", "B", "W")]  # the compute alone (the overhead: a key)
        rows = [StageProfile(t_f_ms=f, t_b_ms=b, t_w_ms=w, mem_b_bytes=mb, mem_w_bytes=mw)
                for f, b, w, mb, mw in zip(*medians, *acts)]
        try:
            write_profile(out, model=planning_model(c), parallel=planning_parallel(c),
                          schedule=c.schedule.name, placement=get_spec(c.schedule.name).placement,
                          stage_to_rank=self._stage_to_rank, t_comm_ms=agreed.t_comm, stages=rows,
                          device=self._dist.device.type, step_ms=agreed.step_ms,
                          action_overhead_ms=agreed.action_overhead_ms, duration_spread=agreed.spread,
                          action_times=times)
        except (OSError, PlanError) as e:
            print_rank_0(f"WARNING: --profile-out {out} not written: {e}")
            return
        print_rank_0(f"    wrote the measured costs to {out} (--profile-out; "
                     f"read by: megatron-zb plan --profile {out})")

    def restore(self, saved: dict[str, Any] | None, *, iteration: int) -> None:
        """On ``--load``: rebuild the schedule from the checkpoint's profiled ``saved`` costs
        (``dataclasses.asdict`` of a ``CostModel``) when the window is over at ``iteration``. Collective."""
        sched = self.config.schedule
        if (saved is None or self.runtime is None or not sched.cost_aware
                or iteration < sched.zero_bubble_pipeline_timers_end_iter - 1):
            return
        costs = CostModel(**saved)
        if isinstance(costs.vocab, dict):  # dataclasses.asdict flattened the vocabulary passes' costs
            costs = dataclasses.replace(costs, vocab=VocabCosts(**costs.vocab))
        status, payload, _ = self._replan_on_rank0(costs)
        if status == "ok":
            self.restored_costs = costs
        else:
            print_rank_0(f"WARNING: cannot rebuild the schedule from the checkpoint's profiled costs "
                         f"({payload}); using the unit-cost schedule")

    def _replan_on_rank0(self, costs: CostModel) -> tuple[str, Any, float]:
        """Rebuild the schedule from ``costs`` on global rank 0 and install it on every rank.

        Returns ``("ok", schedule, seconds)`` or ``("error", message, seconds)`` (then nothing changes).
        Collective.
        """
        old = self._current()
        outcome: list[Any] = [None]
        if dist.get_rank() == 0:
            t0 = time.perf_counter()
            try:
                self.runtime.replan(costs, memory_limit=costs.memory_limit)
                outcome = [("ok", self._current(), time.perf_counter() - t0)]
            except ScheduleError as e:
                outcome = [("error", str(e), time.perf_counter() - t0)]
        dist.broadcast_object_list(outcome, src=0)
        status, payload, seconds = outcome[0]
        if status == "ok":
            self.runtime.replan(costs, memory_limit=costs.memory_limit)
            self.runtime.install_schedule(self._rank0_schedule(payload))
            self._installed = {self.num_microbatches}  # the other m's: built again from these costs when used
        else:
            self.runtime.install_schedule(old)
        return status, payload, seconds

    def _rank0_schedule(self, mine: Schedule) -> Schedule:
        """Global rank 0's schedule (broadcast); the placement must be the one the model was built for."""
        holder = [mine]
        dist.broadcast_object_list(holder, src=0)
        sched = holder[0]
        if list(sched.stage_to_rank) != self._stage_to_rank:
            raise RuntimeError(f"rank 0's schedule places stages as {sched.stage_to_rank}, this rank built "
                               f"{self._stage_to_rank}")
        return sched

    def _current(self) -> Schedule:
        """The schedule the next iteration runs."""
        if self.runtime is None:
            return self._initial
        return self.runtime.schedule_for(self.config.parallel.pipeline_model_parallel_size, self.num_microbatches)

    # ------------------------------------------------------------------ a new number of micro batches
    def use_microbatches(self, num_microbatches: int, *, why: str) -> None:
        """Run ``num_microbatches`` per training iteration from now on (``--rampup-batch-size``): with
        megatron-zb's runtime, global rank 0's schedule for it is installed (:meth:`ensure_installed`)
        and rank 0 prints one line -- ``why`` (the batch change), how the schedule was built and its
        predicted bubble rate under those costs. Nothing when ``m`` does not change. Collective."""
        if num_microbatches == self.num_microbatches:
            return
        self.num_microbatches = num_microbatches
        if self.runtime is None:
            print_rank_0(f"> {why}: megatron-core's forward_backward_func runs {num_microbatches} micro batches "
                         f"per iteration")
            return
        seconds = self.ensure_installed(num_microbatches)
        measured = self.runtime.options.costs
        if not self.config.schedule.cost_aware:
            source = "(not cost-aware)"
        elif measured is None:
            source = "from unit costs (before profiling)"
        else:
            source = "re-planned from the measured costs"
        model = self.config.model
        costs = measured if measured is not None else CostModel(mem_w=mem_w_ratio(
            hidden_size=model.hidden_size, num_attention_heads=model.num_attention_heads, seq_length=model.seq_length))
        sim = simulate(self._current(), costs, enforce_memory=False)
        built = "built at an earlier evaluation" if seconds is None else f"built in {seconds:.2f} s"
        print_rank_0(f"> {why}: schedule {self.config.schedule.name!r} rebuilt for {num_microbatches} micro batches "
                     f"{source} ({built}); predicted bubble rate {100 * sim.bubble_rate:.1f}%")

    def ensure_installed(self, num_microbatches: int) -> float | None:
        """Make every rank run global rank 0's schedule for ``num_microbatches`` under the current costs;
        returns the seconds rank 0 took to build it (``None``: installed already). Raises
        ``RuntimeError`` on every rank when it cannot be built. Collective (megatron-zb's runtime only)."""
        if self.runtime is None or num_microbatches in self._installed:
            return None
        outcome: list[Any] = [None]
        if dist.get_rank() == 0:
            t0 = time.perf_counter()
            try:
                sched = self.runtime.schedule_for(self.config.parallel.pipeline_model_parallel_size, num_microbatches)
                outcome = [("ok", sched, time.perf_counter() - t0)]
            except ScheduleError as e:
                outcome = [("error", str(e), time.perf_counter() - t0)]
        dist.broadcast_object_list(outcome, src=0)
        status, payload, seconds = outcome[0]
        if status != "ok":
            raise RuntimeError(f"--rampup-batch-size: schedule {self.config.schedule.name!r} cannot be built for "
                               f"{num_microbatches} micro batches per iteration ({payload}); change the ramp or "
                               f"the schedule")
        if list(payload.stage_to_rank) != self._stage_to_rank:
            raise RuntimeError(f"rank 0's schedule places stages as {payload.stage_to_rank}, this rank built "
                               f"{self._stage_to_rank}")
        self.runtime.install_schedule(payload)  # rank 0's (broadcast above)
        self._installed.add(num_microbatches)
        return seconds

    # ------------------------------------------------------------------ the first report
    def report_initial(self) -> None:
        """Rank 0 prints the schedule report before training (unit costs, or the restored costs)."""
        c = self.config
        ratio = mem_w_ratio(hidden_size=c.model.hidden_size, num_attention_heads=c.model.num_attention_heads,
                            seq_length=c.model.seq_length)
        sched = self._current()
        sim = simulate(sched, CostModel(mem_w=ratio), enforce_memory=False)
        name = c.schedule.name + (" (megatron-core's own forward_backward_func)"
                                  if c.schedule.use_megatron_core_schedule else "")
        title = "schedule report (unit costs T_F = T_B = T_W = 1, before profiling)"
        measured = None
        peak, limit, unit = sim.peak_memory, c.schedule.memory_limit, "M_B"
        if self.restored_costs is not None:
            title = "schedule report (rebuilt from the profiled costs stored in the checkpoint)"
            sim = simulate(sched, self.restored_costs, enforce_memory=False)
            sc = self.restored_costs.resolve(c.schedule.num_pipeline_stages)
            measured = {"T_F": sum(sc.t_f) / len(sc.t_f), "T_B": sum(sc.t_b) / len(sc.t_b),
                        "T_W": sum(sc.t_w) / len(sc.t_w), "T_comm": sc.t_comm}
            peak, limit, unit = _memory_in_report(self.restored_costs, sim.peak_memory)
        print_rank_0(format_schedule_report(
            schedule=name, num_ranks=c.parallel.pipeline_model_parallel_size, num_microbatches=self.num_microbatches,
            predicted_bubble_rate=sim.bubble_rate, peak_activation_memory=peak,
            memory_limit=limit, memory_unit=unit, measured_costs=measured, title=title))


def _ms(v: float | None) -> str:
    return "not measured" if v is None else f"{v:.3f}"


def _memory_in_report(costs: CostModel, peak: Any) -> tuple[list[float], float | None, str]:
    """Peak per rank and limit of ``costs`` for the report: in MiB when measured in bytes, else in
    units of M_B (a cost model of unit memory: every ``mem_b`` exactly 1)."""
    mem_b = [costs.mem_b] if isinstance(costs.mem_b, (int, float)) else list(costs.mem_b)
    if all(v == 1.0 for v in mem_b):
        return list(peak), costs.memory_limit, "M_B"
    mib = float(2 ** 20)
    return ([v / mib for v in peak], None if costs.memory_limit is None else costs.memory_limit / mib,
            "MiB (measured bytes)")


def measured_lines(agreed: AgreedProfile, stages: int, *, num_ranks: int | None = None) -> str:
    """The report's lines of what the window measured: per-stage times, with ``num_ranks`` (vocabulary
    parallelism) the passes' per-rank times and ``t_collective``, the runtime's time per action and outside
    the schedule, activation bytes (and a warning when B leaves more for W than F left for B)."""
    lines = "    measured per stage (ms): " + "; ".join(
        f"{name}=[{', '.join(f'{v:.3f}' for v in vals)}]"
        for name, op in (("T_F", "F"), ("T_B", "B"), ("T_W", "W"), ("T_BW", "BW"))
        if (vals := agreed.per_stage(op, stages)) is not None)
    if num_ranks is not None:
        lines += "\n" + vocab_line(agreed, stages, num_ranks)
    lines += "\n    measured runtime time per compute action (ms, mean over ranks of medians): " + _ms(
        agreed.action_overhead_ms) + "; outside the schedule's actions per iteration (ms, min over ranks of " \
        "medians): " + _ms(agreed.step_ms)
    if (acts := agreed.activation_bytes(stages)) is not None:
        lines += "\n    measured activations per stage and micro batch (KiB): " + "; ".join(
            f"{name}=[{', '.join(f'{v / 1024:.1f}' for v in vals)}]" for name, vals in zip(("M_B", "M_W"), acts))
        held = agreed.bytes_held_for_w(stages) or []
        over = [(s, w, b) for s, (w, b) in enumerate(zip(held, acts[0])) if w > b]
        if over:
            lines += ("\n    WARNING: B leaves more for W than F left for B on stage(s) " + ", ".join(
                f"{s} ({w / 1024:.1f} > {b / 1024:.1f} KiB)" for s, w, b in over)
                + " (full recomputation: B rebuilds what W needs); the re-plan caps M_W at M_B (its limit "
                  "--zero-bubble-max-pending-backward x M_B may be below what B leaves) and under-counts "
                  "memory between B and W")
    return lines


def planning_model(config: RunConfig) -> Any:
    """The planner's :class:`~megatron_zb.planning.model.PlanModel` of the run's model: the one
    derivation of the planner's model from a :class:`RunConfig` (``planning/`` imports no torch, so
    it cannot take the ``RunConfig`` itself; ``megatron-zb plan`` builds the same from its flags)."""
    from megatron_zb.planning.model import make_model
    m, p = config.model, config.precision
    return make_model(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        seq_length=m.seq_length, micro_batch_size=config.micro_batch_size, vocab_size=m.vocab_size,
        ffn_hidden_size=m.ffn_hidden_size, num_query_groups=m.num_query_groups,
        group_query_attention=m.num_query_groups is not None, kv_channels=m.kv_channels, swiglu=m.swiglu,
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
        position_embedding_type=m.position_embedding_type, max_position_embeddings=m.max_position_embeddings,
        normalization=m.normalization, add_bias_linear=m.add_bias_linear, hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout, transformer_impl=m.transformer_impl,
        precision="fp16" if p.fp16 else "bf16" if p.bf16 else "fp32")


def planning_parallel(config: RunConfig) -> Any:
    """The planner's :class:`~megatron_zb.planning.model.PlanLayout` of the run's layout (with
    :func:`planning_model`, the one derivation)."""
    from megatron_zb.planning.model import make_parallel
    par, sched = config.parallel, config.schedule
    return make_parallel(
        planning_model(config), pp=par.pipeline_model_parallel_size, tp=par.tensor_model_parallel_size,
        dp=par.data_parallel_size, num_microbatches=config.num_microbatches, sequence_parallel=par.sequence_parallel,
        use_distributed_optimizer=par.use_distributed_optimizer, allow_padding_num_layers=par.allow_padding_num_layers,
        num_virtual_stages=sched.num_model_chunks if get_spec(sched.name).placement == Placement.INTERLEAVED else None,
        decoder_first_pipeline_num_layers=par.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=par.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=par.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=par.account_for_loss_in_pipeline_split)

"""Which pipeline schedule a run executes: install global rank 0's, re-plan from the measured costs.

:class:`SchedulePlanner` owns the run's pipeline (:attr:`SchedulePlanner.pipeline`, whose ``run`` takes
what to measure and returns what was measured: :mod:`megatron_zb.runtime.measure`): megatron-zb's
runtime running the validated schedule, or megatron-core's own with ``--use-megatron-core-schedule``
(nothing to plan then). With megatron-zb's runtime:

* every rank runs **global rank 0's** schedule, through the runtime's one install protocol
  (:mod:`megatron_zb.runtime.install`: rank 0 builds, broadcasts, every rank checks the placement the
  model was built for and installs), so a generator that is not deterministic across processes (e.g. a
  time-limited solver) cannot give ranks different action lists;
* after the profiling window (:class:`~megatron_zb.training.cost_window.CostWindow`) :meth:`SchedulePlanner.replan`
  measures ``T_comm``, agrees on the costs (times and activation bytes), re-plans a cost-aware schedule on
  global rank 0 and installs it everywhere, and rank 0 prints the schedule report
  (:mod:`megatron_zb.training.schedule_report`; with every op's host and device time per stage and, on
  CUDA, the ops the device spent mostly waiting for the host: :mod:`megatron_zb.training.host_bound`);
  with ``--profile-out FILE`` global rank 0 also writes the measured costs as a planning profile
  (:mod:`megatron_zb.training.profile_out`);
* a run resumed after the window rebuilds the schedule from the costs its checkpoint stored;
* when the number of micro batches per iteration changes (``--rampup-batch-size``,
  :meth:`SchedulePlanner.use_microbatches`), the schedule for the new ``m`` is installed the same way --
  from the measured costs once the window re-planned (or the checkpoint's), else from unit costs --
  with a report line; a schedule is never reused for another ``m``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

import torch.distributed as dist

from megatron_zb.runtime.forward_backward import ZeroBubbleForwardBackward
from megatron_zb.runtime.install import Installed, NotBuilt
from megatron_zb.runtime.measure import Measure, Measured
from megatron_zb.schedules import simulate
from megatron_zb.schedules.costs import CostModel, VocabCosts
from megatron_zb.schedules.ir import Schedule
from megatron_zb.training.cost_window import CostWindow
from megatron_zb.training.distributed import DistributedContext
from megatron_zb.training.host_bound import action_times, action_times_lines
from megatron_zb.training.logging_utils import print_rank_0
from megatron_zb.training.profile_out import write_profile_out
from megatron_zb.training.profiling import AgreedProfile, agree_on_profile, cost_model, measure_t_comm, mem_w_ratio
from megatron_zb.training.run_config import RunConfig
from megatron_zb.training.schedule_report import initial_report, measured_lines, window_report

if TYPE_CHECKING:
    from megatron_zb.runtime.vocab_runtime import VocabParallelModel

__all__ = ["MegatronCorePipeline", "Pipeline", "SchedulePlanner"]


class MegatronCorePipeline:
    """megatron-core's own ``forward_backward_func`` (``--use-megatron-core-schedule``) behind the
    runtime's ``run``: it measures nothing (every request is answered with only the data)."""

    def __init__(self) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.forward_backward: Callable[..., list[Any]] = get_forward_backward_func()

    def run(self, measure: Measure, **kwargs: Any) -> Measured:
        """One call of megatron-core's function (``measure`` is not honoured: nothing is timed there)."""
        return Measured(data=self.forward_backward(**kwargs))


Pipeline = ZeroBubbleForwardBackward | MegatronCorePipeline
"""What runs a training or evaluation call: ``run(measure, **forward_backward_func keywords) -> Measured``."""


class SchedulePlanner:
    """The run's pipeline and the schedule it runs (see the module docstring).

    Attributes:
        pipeline: what runs each call (:data:`Pipeline`).
        runtime: megatron-zb's runtime (the same object as ``pipeline``), or ``None`` with megatron-core's schedule.
        restored_costs: the cost model a resumed run re-planned from (``None`` otherwise).
        agreed: the profile the window measured, as every rank agreed on it (``None`` before the window ends).
        measured_costs: its cost model (ms, bytes; ``None`` before the window ends or when unusable),
            whether or not the schedule is cost-aware.
        num_microbatches: micro batches per iteration per data-parallel rank of the next training
            iteration (changes with ``--rampup-batch-size``).
        vocab: the runtime's vocabulary slices (``--enable-vocab-parallel``; their ``data_iterator`` is
            set by the trainer), or ``None``.
    """

    def __init__(self, config: RunConfig, *, dist_ctx: DistributedContext, stage_to_rank: list[int],
                 schedule: Schedule | None = None, runtime: ZeroBubbleForwardBackward | None = None,
                 vocab: VocabParallelModel | None = None) -> None:
        """Build the pipeline (or own ``runtime``, built elsewhere, e.g. by :func:`megatron_zb.patch_megatron`)
        and install global rank 0's schedule for ``config.num_microbatches`` -- ``schedule`` when given
        (the one validation built: rank 0's is installed everywhere), else built by rank 0. ``stage_to_rank``:
        the placement the model was built for. Collective. ``vocab`` (``--enable-vocab-parallel``): the
        model's vocabulary slices (:class:`~megatron_zb.runtime.vocab_runtime.VocabParallelModel`), given to
        the runtime; the window then also times the passes ``IF``/``S``/``T``/``IB`` and the collectives
        (:meth:`~megatron_zb.training.profiling.AgreedProfile.vocab_costs`), and the re-plan uses them."""
        self.config = config
        self._dist = dist_ctx
        self._stage_to_rank = list(stage_to_rank)
        self._initial = schedule
        self.restored_costs: CostModel | None = None
        self.agreed: AgreedProfile | None = None
        self.measured_costs: CostModel | None = None
        self.num_microbatches: int = schedule.num_microbatches if schedule is not None else config.num_microbatches
        self.vocab: VocabParallelModel | None = vocab
        self.runtime: ZeroBubbleForwardBackward | None = None
        if config.schedule.use_megatron_core_schedule:
            self.pipeline: Pipeline = MegatronCorePipeline()
            return
        if runtime is None:
            from megatron_zb.runtime import get_forward_backward_func

            extra: dict[str, Any] = {} if vocab is None else {"vocab_parallel": vocab}
            runtime = get_forward_backward_func(config.schedule.name, memory_limit=config.schedule.memory_limit,
                                                num_chunks=config.schedule.num_model_chunks,
                                                timeout=config.schedule.pipeline_timeout_seconds,
                                                wgrad_group=config.schedule.wgrad_group, **extra)
        self.runtime = self.pipeline = runtime
        self._installed_or_raise(self.num_microbatches, schedule=schedule)

    @property
    def _pp(self) -> int:
        return self.config.parallel.pipeline_model_parallel_size

    def cost_window(self) -> CostWindow:
        """The profiling window of this run (inactive with megatron-core's schedule)."""
        return CostWindow(self.config, active=self.runtime is not None)

    def current(self) -> Schedule:
        """The schedule the next training iteration runs (with megatron-core's: the validated one)."""
        if self.runtime is None:
            assert self._initial is not None
            return self._initial
        return self.runtime.schedule_for(self._pp, self.num_microbatches)

    # ------------------------------------------------------------------ re-planning
    def replan(self, window: CostWindow) -> dict[str, Any] | None:
        """After the ``window``: measure T_comm, agree on the costs, re-plan (cost-aware schedules), report,
        write ``--profile-out``. Each step is a method below or a module of its own.

        Returns the cost model the new schedule was built from, as checkpoints store it
        (:attr:`~megatron_zb.training.state.TrainState.schedule_costs`), or ``None`` when the
        schedule was kept. Collective.
        """
        agreed = self.agreed = self._agreed_profile(window)
        costs = self.measured_costs = self._measured_costs(agreed)
        if costs is None:
            return None
        replanned, note = self._replan_from(costs)
        stages = self.config.schedule.num_pipeline_stages
        ranks = self._pp if self.vocab is not None else None
        times = action_times(agreed, self.config)  # host / device per action, the host-bound diagnosis
        print_rank_0(window_report(self.config, self.current(), agreed, costs, iterations=window.profiled_iterations)
                     + "\n" + measured_lines(agreed, stages, num_ranks=ranks)
                     + "\n" + action_times_lines(times) + "\n" + note)
        if self.config.schedule.profile_out:
            write_profile_out(self.config, agreed, times, stage_to_rank=self._stage_to_rank,
                              device_type=self._dist.device.type)
        dist.barrier()
        return replanned

    def _agreed_profile(self, window: CostWindow) -> AgreedProfile:
        """Step 1: measure T_comm (one stage output sent to the next rank) and agree with the other
        pipeline ranks on the window's per-stage costs. Collective."""
        c = self.config
        tp = c.parallel.tensor_model_parallel_size
        seq = c.model.seq_length // tp if c.parallel.sequence_parallel else c.model.seq_length
        t_comm = measure_t_comm(shape=(seq, c.micro_batch_size, c.model.hidden_size), dtype=c.precision.params_dtype,
                                device=self._dist.device, group=self._dist.pp_group)
        return agree_on_profile(window.profile, t_comm, pp_group=self._dist.pp_group)

    def _measured_costs(self, agreed: AgreedProfile) -> CostModel | None:
        """Step 2: the schedule library's cost model of the agreed profile (``None``, with a warning:
        no usable costs, the schedule stays)."""
        c, stages = self.config, self.config.schedule.num_pipeline_stages
        try:
            costs = cost_model(agreed, num_stages=stages, hidden_size=c.model.hidden_size,
                               num_attention_heads=c.model.num_attention_heads, seq_length=c.model.seq_length,
                               max_pending_microbatches=c.schedule.max_pending_backward,
                               num_chunks=c.schedule.num_model_chunks,
                               num_ranks=self._pp if self.vocab is not None else None)
        except ValueError as e:
            print_rank_0(f"WARNING: profiling gave no usable costs ({e}); keeping the schedule")
            return None
        if self.vocab is not None and costs.vocab is None:
            print_rank_0("WARNING: the vocabulary passes were not timed on every pipeline rank; re-planning with "
                         "their default costs (VocabCosts())")
        if agreed.activation_bytes(stages) is None:
            print_rank_0("WARNING: no activation bytes were measured for every stage; planning memory in units "
                         "of M_B with M_W/M_B = 32h/(34h+5as)")
        return costs

    def _replan_from(self, costs: CostModel) -> tuple[dict[str, Any] | None, str]:
        """Step 3: a cost-aware schedule re-planned from ``costs`` by the install protocol; returns the
        costs as checkpoints store them (``None``: kept) and the report's last line. Collective."""
        name = self.config.schedule.name
        before = simulate(self.current(), costs, enforce_memory=False)
        if not self.config.schedule.cost_aware:
            return None, f"    schedule {name!r} is not cost-aware: kept as is"
        outcome = self.runtime.install(self._pp, self.num_microbatches, costs=costs)
        if isinstance(outcome, NotBuilt):  # the unit-cost schedule stays
            return None, f"    WARNING: re-planning failed ({outcome.reason}); keeping the unit-cost schedule"
        return dataclasses.asdict(costs), (
            f"    re-planned {name!r} from the measured costs in {outcome.seconds:.2f} s; the unit-cost schedule "
            f"would have a predicted bubble rate of {100 * before.bubble_rate:.1f}% under them")

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
        outcome = self.runtime.install(self._pp, self.num_microbatches, costs=costs)
        if isinstance(outcome, Installed):
            self.restored_costs = costs
        else:
            print_rank_0(f"WARNING: cannot rebuild the schedule from the checkpoint's profiled costs "
                         f"({outcome.reason}); using the unit-cost schedule")

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
        measured = self.runtime.costs
        if not self.config.schedule.cost_aware:
            source = "(not cost-aware)"
        elif measured is None:
            source = "from unit costs (before profiling)"
        else:
            source = "re-planned from the measured costs"
        model = self.config.model
        costs = measured if measured is not None else CostModel(mem_w=mem_w_ratio(
            hidden_size=model.hidden_size, num_attention_heads=model.num_attention_heads, seq_length=model.seq_length))
        sim = simulate(self.current(), costs, enforce_memory=False)
        built = "built at an earlier evaluation" if seconds is None else f"built in {seconds:.2f} s"
        print_rank_0(f"> {why}: schedule {self.config.schedule.name!r} rebuilt for {num_microbatches} micro batches "
                     f"{source} ({built}); predicted bubble rate {100 * sim.bubble_rate:.1f}%")

    def ensure_installed(self, num_microbatches: int) -> float | None:
        """Make every rank run global rank 0's schedule for ``num_microbatches`` under the current costs;
        returns the seconds rank 0 took to build it (``None``: installed already). Raises
        ``RuntimeError`` on every rank when it cannot be built. Collective (megatron-zb's runtime only)."""
        if self.runtime is None or self.runtime.installed(self._pp, num_microbatches) is not None:
            return None
        return self._installed_or_raise(num_microbatches).seconds

    def _installed_or_raise(self, num_microbatches: int, *, schedule: Schedule | None = None) -> Installed:
        """The install protocol for ``num_microbatches`` (rank 0's ``schedule`` when given); a
        ``RuntimeError`` on every rank when rank 0 cannot build it. Collective."""
        outcome = self.runtime.install(self._pp, num_microbatches, schedule=schedule)
        if isinstance(outcome, NotBuilt):
            raise RuntimeError(f"schedule {self.config.schedule.name!r} cannot be built for {num_microbatches} "
                               f"micro batches per iteration ({outcome.reason}); with --rampup-batch-size change "
                               f"the ramp or the schedule")
        return outcome

    # ------------------------------------------------------------------ the first report
    def report_initial(self) -> None:
        """Rank 0 prints the schedule report before training (unit costs, or the restored costs)."""
        print_rank_0(initial_report(self.config, self.current(), restored=self.restored_costs))

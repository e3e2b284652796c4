"""The Trainer of ``pretrain_gpt_zb.py``: Megatron's GPT pretraining loop with zero-bubble schedules.

:class:`Trainer` coordinates parts that each do one job:

========================  ===========================================================================
:mod:`.distributed`       process groups, ranks, device, Megatron's seeds (:class:`DistributedContext`)
:mod:`.model_setup`       this rank's GPT chunks, wrapped (:class:`ModelBundle`)
:mod:`.optimizer_setup`   optimizer, post-validation wrapper, LR scheduler (:class:`OptimizerBundle`)
:mod:`.replanning`        the ``forward_backward_func``, its schedule, profiling and re-planning
:mod:`.checkpointing`     save / load, with the :class:`~megatron_zb.training.state.TrainState`
:mod:`.resume`            ``--load`` into the model, optimizer and planner, with Megatron-LM's lines
:mod:`.data_setup`        train / validation / test iterators per chunk (:class:`DataBundle`)
:mod:`.gpt_step`          GPT's ``forward_step`` / ``loss_func``, one batch through the pipeline
:mod:`.training_log`      the log interval, Megatron's lines, TensorBoard, ``--loss-log-json``
:mod:`.evaluation`        forward-only evaluation
========================  ===========================================================================

Construction sets the run up (collective, in this order, each step printing on rank 0 as it
starts): process groups and seeds; the model for the schedule's placement; the optimizer and LR
scheduler; the ``forward_backward_func`` with global rank 0's schedule; ``--load``; the data; the
first schedule report. :meth:`Trainer.run` then trains. One iteration (:meth:`Trainer._train_step`):
post-validation validates the previous step, gradient buffers are zeroed, one
``forward_backward_func`` call runs the global batch's micro batches (profiled inside the
window), the optimizer steps and the LR scheduler follows a successful step. Then, as Megatron:
re-planning at the end of the profiling window, the log line every ``--log-interval``,
evaluation every ``--eval-interval``, a checkpoint every ``--save-interval``, the
``--exit-interval`` check, and with ``--exit-signal-handler`` whether any rank was signalled and with
``--exit-duration-in-mins`` whether any ran out of time (then save and exit 0). After the last
iteration: a checkpoint (if not just saved), the validation and the test set. Around each
iteration, :class:`~.housekeeping.LoopHooks` runs Megatron-LM's manual garbage collection, CUDA
cache emptying and ``--profile`` window.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, NoReturn, Sequence

import torch
import torch.distributed as dist

from megatron_zb.schedules.ir import Schedule
from megatron_zb.training.arguments import initial_schedule
from megatron_zb.training.batch_ramp import BatchRamp
from megatron_zb.training.checkpointing import CheckpointError, save_checkpoint
from megatron_zb.training.data_setup import DataBundle, build_data
from megatron_zb.training.distributed import DistributedContext, init_distributed, shutdown_distributed
from megatron_zb.training.evaluation import evaluate
from megatron_zb.training.gpt_step import device_batches, run_batch, sum_lm_loss
from megatron_zb.training.housekeeping import LoopHooks
from megatron_zb.training.logging_utils import print_rank_0, set_logging_level, tensorboard_writer
from megatron_zb.training.cost_window import CostWindow
from megatron_zb.training.measured_timeline import MeasuredTimeline
from megatron_zb.training.model_setup import ModelBundle, build_model
from megatron_zb.training.mtp_log import take_mtp_losses
from megatron_zb.training.nan_check import LossAndGradCheck, NonFiniteError, NonFiniteFinding
from megatron_zb.training.optimizer_setup import OptimizerBundle, build_optimizer
from megatron_zb.training.params_norm import params_l2_norm
from megatron_zb.training.preemption import ExitDuration, ExitSignalHandler
from megatron_zb.training.replanning import SchedulePlanner
from megatron_zb.training.resume import resume
from megatron_zb.training.run_config import RunConfig, run_config
from megatron_zb.training.state import TrainState
from megatron_zb.training.timing_log import TimingLog, optimizer_configs
from megatron_zb.training.training_log import IterationRecord, TrainingLog

__all__ = ["Trainer"]


class Trainer:
    """One run of ``pretrain_gpt_zb.py`` (see the module docstring).

    The Trainer reads its settings from :attr:`config` only: the ``argparse.Namespace`` it is
    constructed from is converted once (:func:`~megatron_zb.training.run_config.run_config`) and
    goes no further (why: :mod:`megatron_zb.training.run_config`).

    Attributes:
        config: the typed run configuration of ``args`` (:mod:`.run_config`): model, parallel
            layout, precision, optimizer, schedule and re-planning, data, checkpointing, logging.
        dist: process groups and ranks of this process.
        model: this rank's chunks.
        optim: optimizer and LR scheduler.
        planner: the ``forward_backward_func`` and its schedule.
        state: iteration, consumed samples, profiled costs (what checkpoints carry).
        data: this rank's iterators.
        log: the current log interval and the run's history.
        batch: the global batch of the next iteration (:class:`~megatron_zb.training.batch_ramp.BatchRamp`:
            constant, or growing with ``--rampup-batch-size``).
        last_saved: the iteration of the last checkpoint this run saved or loaded (``None``: none).
        exit_signal: with ``--exit-signal-handler``, the handler of ``--exit-signal``
            (:mod:`.preemption`); checked after every iteration.
        exit_duration: with ``--exit-duration-in-mins``, its clock (:mod:`.preemption`); checked
            after every iteration.
        hooks: garbage collection, CUDA cache and ``--profile`` window around iterations (:mod:`.housekeeping`).
        nan_check: ``--check-for-nan-in-loss-and-grad`` (:mod:`.nan_check`; a NaN/Inf stops every rank).
        timing: Megatron-LM's timers of ``--timing-log-level`` (:mod:`.timing_log`).
        timeline: megatron-zb's measured timeline of the ``--profile`` window (:mod:`.measured_timeline`).
        t_start: ``time.perf_counter()`` when the run started [s].
    """

    def __init__(self, args: argparse.Namespace, *, schedule: Schedule | None = None) -> None:
        """Set the run up (collective). ``schedule``: the unit-cost schedule validation built
        (:attr:`~megatron_zb.training.arguments.ValidatedArgs.schedule`); ``None`` builds it again."""
        self.config: RunConfig = run_config(args)
        set_logging_level(self.config.logging.logging_level)
        if self.config.model.enable_experimental:
            from megatron.core.config import set_experimental_flag

            set_experimental_flag(True)
        ckpt = self.config.checkpoint
        self.t_start = time.perf_counter()
        # post-validation: optimizer step index -> (iteration, its global batch size)
        self._iteration_of_step: dict[int, tuple[int, int]] = {}
        self.dist: DistributedContext = init_distributed(self.config.parallel, seed=self.config.seed)
        self.exit_signal = ExitSignalHandler(ckpt.exit_signal).install() if ckpt.exit_signal_handler else None
        minutes = ckpt.exit_duration_in_mins
        self.exit_duration = ExitDuration(minutes, started=self.t_start) if minutes else None
        self.hooks = LoopHooks(self.config, rank=dist.get_rank(), device=self.dist.device)
        parallel = self.config.parallel  # post-validation's found-inf reduction spans every rank unless:
        replicas = parallel.data_parallel_size > 1 and not parallel.use_distributed_optimizer
        self.nan_check = LossAndGradCheck(self.config.precision.checks_nan, device=self.dist.device,
                                          vote=self.config.optim.post_validation is not None and replicas)
        try:
            schedule = schedule if schedule is not None else initial_schedule(args)
            self.model: ModelBundle = build_model(self.config, stage_to_rank=schedule.stage_to_rank, dist=self.dist)
            self.optim: OptimizerBundle = build_optimizer(self.config, model=self.model,
                                                          on_validation_report=self._on_validation_report)
            logging = self.config.logging
            self.timing = TimingLog(level=logging.timing_log_level, option=logging.timing_log_option,
                                    barrier=logging.barrier_with_L1_time)
            self.timing.install([c.module.config for c in self.model.chunks] + optimizer_configs(self.optim.inner))
            self.planner = SchedulePlanner(self.config, schedule=schedule, stage_to_rank=schedule.stage_to_rank,
                                           dist_ctx=self.dist, vocab=self.model.vocab_parallel)
            self.window: CostWindow = self.planner.cost_window()
            self.timeline = MeasuredTimeline(self.config.profiling, runtime=self.planner.runtime,
                                             device=self.dist.device, pp_group=self.dist.pp_group,
                                             train_iters=self.config.train_iters)
            self.state: TrainState = (resume(self.config, model=self.model, optim=self.optim, planner=self.planner)
                                      if ckpt.load else TrainState())
            self.last_saved: int | None = self.state.iteration if ckpt.load else None
            self.data: DataBundle = build_data(self.config, reads_data=self.model.reads_data, state=self.state,
                                               vocab_parallel=self.model.vocab_slices is not None)
            self._use_vocab_data(self.data.vocab_train)
            self.batch: BatchRamp = self._start_batch_ramp()
            self.planner.report_initial()
            self.log = TrainingLog(self.config, stage_to_rank=self.model.stage_to_rank, dist_ctx=self.dist,
                                   tensorboard=tensorboard_writer(self.config.logging.tensorboard_dir))
        except BaseException as e:
            if isinstance(e, CheckpointError):  # raised on every rank alike: rank 0 says it once
                print_rank_0(f"pretrain_gpt_zb.py: error: {e}", file=sys.stderr)
                dist.barrier()  # the other ranks exit after rank 0 printed (a launcher stops the rest then)
            self.nan_check.close()
            shutdown_distributed(self.dist)
            if self.exit_signal is not None:
                self.exit_signal.release()
            raise

    @property
    def optimizer(self) -> Any:
        """The optimizer the loop steps (the post-validation wrapper with post-validation)."""
        return self.optim.optimizer

    def run(self) -> int:
        """Train to ``--train-iters`` (or ``--exit-interval``), then finish; returns the exit status 0."""
        if not self._train():
            self._finish()
        return 0

    def close(self) -> None:
        """Close the TensorBoard writer; destroy the process groups this run started."""
        self.hooks.close()
        self.log.close()
        self.nan_check.close()
        shutdown_distributed(self.dist)
        if self.exit_signal is not None:
            self.exit_signal.release()

    # ------------------------------------------------------------------ the loop
    def _train(self) -> bool:
        """The loop; returns True when it stopped early (``--exit-interval``, ``--exit-signal-handler``)."""
        config = self.config
        for m in self.model.all_modules:
            m.train()
        self.log.start_interval()
        start = config.schedule.zero_bubble_pipeline_timers_start_iter
        end = config.schedule.zero_bubble_pipeline_timers_end_iter
        print_rank_0(f"> training: iterations {self.state.iteration + 1} to {config.train_iters}, "
                     f"{self.batch.num_microbatches} micro batches of {config.micro_batch_size} per iteration per "
                     f"data-parallel rank"
                     + (f" (growing to {config.num_microbatches}: --rampup-batch-size)"
                        if self.batch.num_microbatches != config.num_microbatches else "")
                     + (f"; profiling iterations {start}-{end - 1}, then re-planning"
                        if self.window.profiles_after(self.state.iteration) else ""))
        self.hooks.start(self.state.iteration)
        while self.state.iteration < config.train_iters:
            it = self.state.iteration + 1
            self.hooks.before_iteration(it)
            self._update_batch(it)
            record, replan_due = self._train_step(it)
            self.state.advance(global_batch_size=self.batch.global_batch_size)
            self.log.records.append(record)
            if replan_due:
                with self.log.excluding_time():
                    costs = self.planner.replan(self.window)
                    if costs is not None:
                        self.state.schedule_costs = costs
            if self.timeline.due:  # the --profile window's last iteration: its timeline and PNG
                with self.log.excluding_time():
                    self.timeline.write()
            if self._after_iteration(it):
                return True
        return False

    def _train_step(self, it: int) -> tuple[IterationRecord, bool]:
        """Iteration ``it``: its record, and whether the profiling window ended with it (re-plan due)."""
        opt = self.optim
        measure = self.window.request(it) | self.timeline.request(it)   # what this iteration measures
        if opt.post_validation:
            opt.optimizer.begin_iteration()  # validates the previous step (reports to _on_validation_report)
            self._stop_if_rolled_back()
        self.nan_check.begin(it)
        for m in self.model.all_modules:
            m.zero_grad_buffer()
        opt.optimizer.zero_grad()
        t0 = time.perf_counter()
        gbs = self.batch.global_batch_size
        measured = run_batch(self.planner.pipeline, measure, model=self.model.modules, iterators=self.data.train,
                             config=self.config, device=self.dist.device, forward_only=False,
                             num_microbatches=self.batch.num_microbatches)
        fb_seconds = time.perf_counter() - t0
        self.hooks.after_forward_backward()
        replan_due = self.window.record(it, measured, seconds=fb_seconds)
        self.timeline.record(it, measured, schedule=self.planner.current())
        if opt.post_validation and opt.optimizer.next_step_eager:  # the check's finding rides on its reduction
            opt.optimizer.note_nonfinite(self.nan_check.local is not None)
        elif (finding := self.nan_check.agree()) is not None:  # no step from it: every rank stops
            self._stop_nonfinite(finding, self._record(it, measured, (False, None, None), gbs=gbs))
        if opt.post_validation:
            self._iteration_of_step[opt.optimizer.iteration] = (it, gbs)
        t1 = time.perf_counter()
        self.timing("optimizer", 1).start(barrier=self.timing.barrier)
        update_successful, grad_norm, num_zeros = opt.optimizer.step()
        self.timing("optimizer", 1).stop()
        timers = {"forward-backward": fb_seconds, "optimizer": time.perf_counter() - t1}
        self.hooks.after_optimizer_step()
        if opt.post_validation and not opt.optimizer.pending:
            self._iteration_of_step.pop(opt.optimizer.iteration - 1, None)  # final already (synchronous step)
        if update_successful:
            opt.scheduler.step(increment=gbs)  # samples, as Megatron-LM's scheduler counts
        step = (update_successful, grad_norm, num_zeros)
        return self._record(it, measured, step, gbs=gbs, timers=timers), replan_due

    def _record(self, it: int, measured: Any, step: tuple[Any, Any, Any], *, gbs: int,
                timers: dict[str, float] | None = None) -> IterationRecord:
        """Iteration ``it``'s record: losses of ``measured``, ``step``'s result, ``gbs`` [samples], ``timers`` [s]."""
        update_successful, grad_norm, num_zeros = step
        opt, loss = self.optim, None
        if measured.data:
            total = sum_lm_loss(measured.data)
            loss = (float(total[0]), float(total[1]))
        mtp = take_mtp_losses(self.batch.num_microbatches) if self.config.model.mtp_num_layers else None
        return IterationRecord(iteration=it, loss=loss, skipped=not update_successful, mtp_losses=mtp,
                               grad_norm=None if grad_norm is None else float(grad_norm),
                               lr=opt.learning_rate(), loss_scale=opt.loss_scale(), timers=timers or {},
                               num_zeros=None if num_zeros is None else float(num_zeros), global_batch_size=gbs)

    def _stop_nonfinite(self, finding: NonFiniteFinding, record: IterationRecord | None = None) -> NoReturn:
        """Every rank: log the rest of the interval (``record``: the iteration whose step was not taken,
        skipped; a nan iteration if its loss is), write ``--loss-log-json``, raise :class:`NonFiniteError`."""
        if record is not None:
            self.log.records.append(record)
            self.state.advance(global_batch_size=self.batch.global_batch_size)  # consumed, as Megatron-LM's
        if self.log.records:
            self._log_interval()
        self.log.write_json()
        raise NonFiniteError(finding)

    def _stop_if_rolled_back(self) -> None:
        """After a post-validation (every rank alike): stop if the NaN/Inf check had a step rolled back."""
        if (finding := self.nan_check.stop_after_validation()) is not None:
            self._stop_nonfinite(finding)

    def _after_iteration(self, it: int) -> bool:
        """Megatron's interval actions after iteration ``it``; returns True when the run exits here."""
        ckpt = self.config.checkpoint
        if it % self.config.logging.log_interval == 0:
            self._log_interval()
        if self.config.data.eval_iters > 0 and self.data.has_valid and it % self.config.data.eval_interval == 0:
            with self.log.excluding_time(), self.hooks.evaluation():
                self._evaluate(f"iteration {it}", self.data.valid, valid=True, vocab=self.data.vocab_valid)
        self.hooks.after_iteration(it)  # Megatron-LM's post-step callbacks: the profile window's end, manual GC
        if ckpt.save and ckpt.save_interval and it % ckpt.save_interval == 0:
            with self.log.excluding_time():
                self._finalize_optimizer()
                self._save()
        if self.exit_signal is not None and self.exit_signal.any_rank_received(self.dist.device):
            self._exit_early(it, f"after receiving {ckpt.exit_signal.name} (--exit-signal-handler)")
            return True
        if self.exit_duration is not None and self.exit_duration.any_rank_over(self.dist.device):
            self._exit_early(it, f"after {self.exit_duration.elapsed_minutes():.3f} minutes "
                                 f"(--exit-duration-in-mins {self.exit_duration.minutes})")
            return True
        if ckpt.exit_interval and it % ckpt.exit_interval == 0:
            self._exit_early(it, f"(--exit-interval {ckpt.exit_interval})")
            return True
        return False

    def _exit_early(self, it: int, why: str) -> None:
        """Stop after iteration ``it``: the last interval's exact values, a checkpoint when ``--save``, the JSON log."""
        if self.log.records:
            self._log_interval(print_line=False)
        self._finalize_optimizer()
        save = self.config.checkpoint.save
        if save and self.last_saved != it:
            self._save()
        dist.barrier()
        print_rank_0(f"> exiting program at iteration {it} {why}"
                     + ("" if save else "; no --save: no checkpoint written"))
        self.log.write_json()

    def _finish(self) -> None:
        """After the last iteration: exact values of the last interval, a checkpoint, validation and test."""
        it = self.state.iteration
        if self.log.records:
            self._log_interval(print_line=False)  # the last iterations' exact values (no log line: as Megatron)
        self._finalize_optimizer()
        if self.config.checkpoint.save and self.last_saved != it:
            self._save()
        if self.config.data.eval_iters > 0:
            if self.data.has_valid:
                self._evaluate(f"iteration {it} on validation set", self.data.valid, valid=True,
                               vocab=self.data.vocab_valid)
            if self.data.has_test:
                self._evaluate(f"iteration {it} on test set", self.data.test, valid=False, vocab=self.data.vocab_test)
        self.log.write_json()
        if self.optim.post_validation:
            c = self.optim.optimizer.counters()
            print_rank_0(f"> optimizer post-validation (rank 0): {c.eager_steps} eager steps, {c.sync_steps} "
                         f"synchronous steps, {c.rollbacks} rollbacks, {c.clipped_iterations} clipped, "
                         f"{c.skipped_iterations} skipped iterations")
        dist.barrier()
        print_rank_0(f"> training done: {it} iterations, {self.log.total_skipped} skipped, "
                     f"{time.perf_counter() - self.t_start:.1f} s in all")

    # ------------------------------------------------------------------ the global batch (--rampup-batch-size)
    def _start_batch_ramp(self) -> BatchRamp:
        """The batch of the first iteration of this run (after ``--load``: where the ramp stood); the
        planner's schedule for its micro batches. Collective."""
        batch = self.config.batch_ramp(consumed_samples=self.state.consumed_train_samples)
        if batch.ramps:
            start, increment, samples = self.config.rampup_batch_size  # type: ignore[misc]
            print_rank_0(f"> batch size ramp-up (--rampup-batch-size {start} {increment} {samples}): the global "
                         f"batch grows from {start} by {increment} to {self.config.global_batch_size} over the first "
                         f"{samples} samples; {batch.global_batch_size} at {self.state.consumed_train_samples} "
                         f"consumed samples")
            self.planner.use_microbatches(batch.num_microbatches,
                                          why=f"global batch size {batch.global_batch_size} to start with")
        return batch

    def _update_batch(self, it: int) -> None:
        """Before iteration ``it``: the global batch for the consumed samples (Megatron-LM's
        ``update_num_microbatches``). When it grows, as Megatron-LM: a checkpoint of the iteration
        before (with ``--save``), then the schedule for the new number of micro batches. Collective."""
        before = self.batch.global_batch_size
        if not self.batch.update(self.state.consumed_train_samples):
            return
        with self.log.excluding_time():
            if self.config.checkpoint.save and self.state.iteration > 0 and self.last_saved != self.state.iteration:
                self._finalize_optimizer()
                self._save()
            self.planner.use_microbatches(
                self.batch.num_microbatches,
                why=f"global batch size {before} -> {self.batch.global_batch_size} at iteration {it} "
                    f"({self.state.consumed_train_samples} samples consumed)")

    # ------------------------------------------------------------------ post-validation
    def _finalize_optimizer(self) -> None:
        if self.optim.post_validation:
            self.optim.optimizer.finalize()  # reports through _on_validation_report
            self._stop_if_rolled_back()

    def _on_validation_report(self, report: Any) -> None:
        """A post-validation report of an earlier step: fix the LR schedule and that iteration's record."""
        entry = self._iteration_of_step.pop(report.iteration, None)
        if entry is None:
            return
        it, gbs = entry  # the iteration and its global batch [samples]
        if report.found_inf:
            self.nan_check.mark_rolled_back(it)  # a NaN/Inf step: the check stops the run (when on)
        if report.changed:  # the step was redone or undone: the scheduler follows the validated outcome
            self.optim.scheduler.step(increment=gbs if report.result.update_successful else -gbs)
        record = self.log.find(it)
        if record is not None:
            record.skipped = not report.result.update_successful
            record.grad_norm = report.result.grad_norm
            nz = report.result.num_zeros_in_grad
            record.num_zeros = None if nz is None else float(nz)
            record.lr = self.optim.learning_rate()
            record.loss_scale = self.optim.loss_scale()

    # ------------------------------------------------------------------ logging, evaluation, checkpoints
    def _log_interval(self, print_line: bool = True) -> None:
        opt = self.optim
        if opt.post_validation:
            opt.optimizer.validate()  # the line reports validated values (reports to _on_validation_report)
        now = time.perf_counter()
        rollbacks = None
        if opt.post_validation:  # the most any rank rolled back in the interval
            c = torch.tensor([opt.optimizer.reset_interval_counters().rollbacks], dtype=torch.float64,
                             device=self.dist.device)
            dist.all_reduce(c, op=dist.ReduceOp.MAX)
            rollbacks = int(c.item())
        self.log.close_interval(now=now, consumed_samples=self.state.consumed_train_samples, rollbacks=rollbacks,
                                print_line=print_line, params_norm=self._params_norm())
        if print_line:
            self.timing.log(normalizer=self.config.logging.log_interval)  # Megatron-LM's timers after its line

    def _params_norm(self) -> float | None:
        """``--log-params-norm``: the parameters' L2 norm now (collective), else ``None``."""
        if not self.config.logging.log_params_norm:
            return None
        return params_l2_norm(self.model.all_modules, bf16=self.config.precision.bf16, device=self.dist.device)

    def _use_vocab_data(self, iterator: Any) -> None:
        """``--enable-vocab-parallel``: the micro batches the vocabulary passes read (every rank) from now on."""
        if self.planner.vocab is not None:
            self.planner.vocab.data_iterator = device_batches(iterator, device=self.dist.device)

    def _evaluate(self, prefix: str, iterators: Sequence[Any], *, valid: bool, vocab: Any = None) -> float:
        self._use_vocab_data(vocab)
        if self.optim.post_validation:
            self.optim.optimizer.validate()  # evaluate the validated parameters
            self._stop_if_rolled_back()
        self.nan_check.begin(self.state.iteration)  # Megatron-LM's loss function checks evaluation's losses too
        self.planner.ensure_installed(self.config.num_microbatches)  # as Megatron-LM: --global-batch-size's micro batches
        with self.timing.paused():  # evaluation is not timed, as Megatron-LM
            loss = evaluate(self.config, pipeline=self.planner.pipeline, modules=self.model.modules,
                            iterators=iterators, stage_to_rank=self.model.stage_to_rank, dist_ctx=self.dist,
                            after_step=self.hooks.after_eval_step)
        if (finding := self.nan_check.agree()) is not None:
            self._stop_nonfinite(finding)
        self._use_vocab_data(self.data.vocab_train)
        if valid:
            self.state.consumed_valid_samples += self.config.data.eval_iters * self.config.global_batch_size
        self.log.add_validation(prefix, iteration=self.state.iteration, loss=loss, tensorboard=valid)
        return loss

    def _save(self) -> None:
        t0 = time.perf_counter()
        if self.config.parallel.overlap_param_gather:  # as Megatron: gather the stepped parameters before saving them
            for m in self.model.all_modules:
                m.start_param_sync(force_sync=True)
        path = save_checkpoint(self.config.checkpoint.save, state=self.state, chunks=self.model.gpt_models,
                               optimizer=self.optim.optimizer, scheduler=self.optim.scheduler,
                               config=self.config, vocab=self.model.vocab_slices)
        self.last_saved = self.state.iteration
        print_rank_0(f"  successfully saved checkpoint from iteration {self.state.iteration:7d} to {path} "
                     f"({time.perf_counter() - t0:.1f} s)")

"""What a run reports: Megatron's iteration line per ``--log-interval``, validation lines,
TensorBoard scalars and the exact values of ``--loss-log-json``.

:class:`TrainingLog` keeps the records of the current log interval (one :class:`IterationRecord`
per iteration) and the time to leave out of it (evaluation, checkpointing, re-planning); at the
end of an interval it gathers the losses from the last pipeline stage and prints the line.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from megatron_zb.training.distributed import DistributedContext
from megatron_zb.training.flops import tflops_per_gpu
from megatron_zb.training.run_config import RunConfig
from megatron_zb.training.mtp_log import broadcast_mtp_losses, mtp_loss_names
from megatron_zb.training.logging_utils import WandbWriter, format_iteration_line, is_last_rank, print_rank_last

__all__ = ["IterationRecord", "TrainingLog", "cuda_memory_scalars", "gather_losses"]


@dataclass
class IterationRecord:
    """One training iteration's reported values.

    Attributes:
        iteration: the iteration number (1-based).
        loss: ``(masked loss sum, tokens)`` over this rank's micro batches on ranks holding the
            last stage, ``None`` elsewhere.
        skipped: whether the optimizer skipped the update (inf/nan gradients).
        grad_norm: the global gradient norm, ``None`` when megatron-core computed none.
        lr: the learning rate after the step.
        loss_scale: the loss scale after the step.
        timers: seconds spent in named parts of the iteration (``"forward-backward"``,
            ``"optimizer"``), for ``--log-timers-to-tensorboard``.
        num_zeros: with ``--log-num-zeros-in-grad``, the step's zero gradient elements (megatron-core's
            count over the model-parallel group; validated with post-validation), else ``None``.
        global_batch_size: the iteration's samples, all data-parallel ranks (grows with
            ``--rampup-batch-size``; ``None``: ``--global-batch-size``).
        mtp_losses: with ``--mtp-num-layers``, on ranks holding the MTP layers, the loss of each MTP
            depth (:func:`~megatron_zb.training.mtp_log.take_mtp_losses`), else ``None``; on every pipeline
            rank once its interval closes (:func:`~megatron_zb.training.mtp_log.broadcast_mtp_losses`).
    """

    iteration: int
    loss: tuple[float, float] | None
    skipped: bool
    grad_norm: float | None
    lr: float
    loss_scale: float
    timers: dict[str, float] = field(default_factory=dict)
    num_zeros: float | None = None
    global_batch_size: int | None = None
    mtp_losses: tuple[float, ...] | None = None


def cuda_memory_scalars(stats: dict[str, Any]) -> dict[str, float]:
    """``--log-memory-to-tensorboard``: Megatron-LM's four scalars of ``torch.cuda.memory_stats()``
    (bytes, and the count of live allocations)."""
    return {"mem-reserved-bytes": stats["reserved_bytes.all.current"],
            "mem-allocated-bytes": stats["allocated_bytes.all.current"],
            "mem-max-allocated-bytes": stats["allocated_bytes.all.peak"],
            "mem-allocated-count": stats["allocation.all.current"]}


def gather_losses(values: Sequence[tuple[float, float] | None], *, stage_to_rank: Sequence[int],
                  dist_ctx: DistributedContext) -> list[tuple[float, float]]:
    """``(masked sum, tokens)`` pairs from the last stage, summed over DP, on every rank. Collective."""
    from megatron.core import parallel_state

    count = len(values)
    holder_pp = stage_to_rank[-1]
    buf = torch.zeros(2 * count, dtype=torch.float64, device=dist_ctx.device)
    if dist_ctx.pp_rank == holder_pp:
        buf.copy_(torch.tensor([x for v in values for x in (v if v is not None else (0.0, 0.0))],
                               dtype=torch.float64, device=buf.device))
        if parallel_state.get_data_parallel_world_size() > 1:
            dist.all_reduce(buf, group=parallel_state.get_data_parallel_group())
    if dist.get_world_size(dist_ctx.pp_group) > 1:
        dist.broadcast(buf, src=dist.get_global_rank(dist_ctx.pp_group, holder_pp), group=dist_ctx.pp_group)
    vals = buf.cpu().tolist()
    return [(vals[2 * i], vals[2 * i + 1]) for i in range(count)]


def mtp_interval(records: Sequence[IterationRecord]) -> dict[str, float]:
    """The interval's MTP losses as Megatron-LM's line has them: each depth's sum over the interval's
    iterations divided by the iterations not skipped (empty without MTP layers on this rank)."""
    held = [r.mtp_losses for r in records if r.mtp_losses]
    advanced = max(1, sum(1 for r in records if not r.skipped))
    if not held:
        return {}
    return {name: sum(v[i] for v in held) / advanced for i, name in enumerate(mtp_loss_names(len(held[0])))}


class TrainingLog:
    """The current log interval, the run's exact history and the TensorBoard writer.

    Attributes:
        records: this interval's iterations.
        interval_start: ``time.perf_counter()`` at the interval's start [s].
        excluded: seconds inside the interval not counted as iteration time.
        total_skipped: skipped iterations over the run.
        history: every iteration's exact values (for ``--loss-log-json``).
        valid_history: every evaluation's loss and perplexity.
    """

    def __init__(self, config: RunConfig, *, stage_to_rank: Sequence[int], dist_ctx: DistributedContext | None,
                 tensorboard: Any) -> None:
        """``config``: the run's typed configuration (its :class:`~.run_config.LoggingConfig`, the
        training length and batch of the line, the model of ``--log-throughput``)."""
        self.config = config
        self.logging = config.logging
        self._stage_to_rank = list(stage_to_rank)
        self._dist = dist_ctx
        self.tb = tensorboard
        self.wandb = WandbWriter(config.logging, save=config.checkpoint.save)
        self.records: list[IterationRecord] = []
        self.interval_start = time.perf_counter()
        self.excluded = 0.0
        self.total_skipped = 0
        self.history: list[dict[str, Any]] = []
        self.valid_history: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def excluding_time(self) -> Iterator[None]:
        """Leave the time spent inside out of the interval's iteration time."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.excluded += time.perf_counter() - t0

    def start_interval(self) -> None:
        """Start a new, empty interval now."""
        self.records = []
        self.interval_start = time.perf_counter()
        self.excluded = 0.0

    def find(self, iteration: int) -> IterationRecord | None:
        """This interval's record of ``iteration`` (``None`` when it was logged already)."""
        return next((r for r in self.records if r.iteration == iteration), None)

    def close_interval(self, *, now: float, consumed_samples: int, rollbacks: int | None, print_line: bool,
                       params_norm: float | None = None) -> None:
        """End the interval at ``now``: Megatron's line (when ``print_line``), TensorBoard, the JSON. Collective.

        ``params_norm``: with ``--log-params-norm``, the parameters' norm after the interval's last
        step (line, TensorBoard and the last iteration's JSON record).

        As Megatron: skipped iterations do not enter the average; a skipped iteration whose loss is
        inf/nan counts as a nan iteration; the loss field is left out when nothing is averaged.
        """
        records = self.records
        losses = gather_losses([r.loss for r in records], stage_to_rank=self._stage_to_rank, dist_ctx=self._dist)
        if self.config.model.mtp_num_layers:
            mtp = broadcast_mtp_losses([r.mtp_losses for r in records], depth=self.config.model.mtp_num_layers,
                                       holder_pp=self._stage_to_rank[-1], dist_ctx=self._dist)
            for r, v in zip(records, mtp):
                r.mtp_losses = v
        per_iter = []
        for r, (num, den) in zip(records, losses):
            value = num / den if den > 0 else float("nan")
            per_iter.append(value)
            self.history.append({"iteration": r.iteration, "lm loss": value, "skipped": r.skipped,
                                 "learning rate": r.lr, "grad norm": r.grad_norm, "loss scale": r.loss_scale,
                                 "global batch size": self._batch_size(r),
                                 **({"num zeros": r.num_zeros} if r.num_zeros is not None else {}),
                                 **dict(zip(mtp_loss_names(len(r.mtp_losses or ())), r.mtp_losses or ()))})
        if params_norm is not None and self.history:
            self.history[-1]["params norm"] = params_norm
        kept = [v for r, v in zip(records, per_iter) if not r.skipped]
        nan_iters = sum(1 for r, v in zip(records, per_iter) if r.skipped and not math.isfinite(v))
        skipped = sum(1 for r in records if r.skipped)
        self.total_skipped += skipped
        elapsed = max(0.0, now - self.interval_start - self.excluded) / max(1, len(records))
        last = records[-1]
        batch = self._batch_size(last)  # as Megatron-LM: the current global batch
        tflops = None
        if self.logging.log_throughput and elapsed > 0:
            tflops = tflops_per_gpu(self.config.model, global_batch_size=batch,
                                    world_size=self.config.parallel.world_size, seconds_per_iteration=elapsed)
        if print_line:
            print_rank_last(format_iteration_line(
                iteration=last.iteration, train_iters=self.config.train_iters, consumed_samples=consumed_samples,
                elapsed_ms=1e3 * elapsed, throughput=batch / elapsed if elapsed > 0 else None,
                tflops_per_gpu=tflops,
                learning_rate=last.lr, global_batch_size=self._batch_size(last),
                losses={**({"lm loss": sum(kept) / len(kept)} if kept else {}), **mtp_interval(records)},
                loss_scale=last.loss_scale, grad_norm=last.grad_norm, num_zeros_in_grad=last.num_zeros,
                params_norm=params_norm, skipped_iterations=skipped, nan_iterations=nan_iters, rollbacks=rollbacks))
            self.tensorboard_interval(last, kept, elapsed, tflops, params_norm=params_norm)
        self.write_json()
        self.start_interval()

    def _batch_size(self, record: IterationRecord) -> int:
        """The global batch size of ``record``'s iteration [samples]."""
        return record.global_batch_size if record.global_batch_size is not None else self.config.global_batch_size

    def tensorboard_interval(self, last: IterationRecord, kept: list[float], elapsed: float,
                              tflops: float | None, *, params_norm: float | None = None) -> None:
        """TensorBoard and W&B scalars of the interval (Megatron's names; timers in seconds per iteration)."""
        tb = self.tb is not None and self.tb.enabled
        if not tb and not self.wandb.enabled:
            return
        scalars = {"learning-rate": last.lr, "loss-scale": last.loss_scale, "iteration-time": elapsed}
        if kept:
            scalars["lm loss"] = sum(kept) / len(kept)
        if last.grad_norm is not None:
            scalars["grad-norm"] = last.grad_norm
        if tflops is not None:
            scalars["throughput"] = tflops
        if last.num_zeros is not None:
            scalars["num-zeros"] = last.num_zeros
        if params_norm is not None:
            scalars["params-norm"] = params_norm
        if self.logging.log_memory_to_tensorboard and self._dist is not None and self._dist.device.type == "cuda":
            scalars.update(cuda_memory_scalars(torch.cuda.memory_stats(self._dist.device)))
        if self.logging.log_timers_to_tensorboard:
            for name in sorted({n for r in self.records for n in r.timers}):
                scalars[f"{name}-time"] = sum(r.timers.get(name, 0.0) for r in self.records) / len(self.records)
        if tb:
            self.tb.add_scalars(scalars, last.iteration)
            self.tb.flush()
        self.wandb.log(scalars, last.iteration)

    def add_validation(self, prefix: str, *, iteration: int, loss: float, tensorboard: bool) -> None:
        """Print Megatron's validation lines for ``loss`` (lm loss, perplexity) and record them."""
        ppl = math.exp(min(20.0, loss)) if math.isfinite(loss) else float("nan")
        string = f" validation loss at {prefix} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
        bar = "-" * (len(string) + 1)
        print_rank_last(bar + "\n" + string + "\n" + bar)
        self.valid_history.append({"prefix": prefix, "iteration": iteration, "lm loss": loss, "ppl": ppl})
        if self.tb is not None and self.tb.enabled and tensorboard:
            self.tb.add_scalars({"lm loss validation": loss, "lm loss validation ppl": ppl}, iteration)

    def write_json(self) -> None:
        """Rewrite ``--loss-log-json`` (last rank only) with the history so far."""
        path = self.logging.loss_log_json
        if not path or not is_last_rank():
            return
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            schedule = self.config.schedule
            json.dump({"schedule": schedule.name, "megatron_core_schedule": schedule.use_megatron_core_schedule,
                       "train": self.history, "valid": self.valid_history}, f, indent=1)
        os.replace(tmp, path)

    def close(self) -> None:
        """Close the TensorBoard writer."""
        if self.tb is not None:
            self.tb.close()
        self.wandb.close()

"""The typed run configuration: what a validated command line means, as frozen dataclasses.

:func:`run_config` turns validated Megatron-LM-style ``args`` into one :class:`RunConfig`; the
set-up functions below the entry point (model, DDP, optimizer, process groups, FLOPs) take its
sections, never the ``argparse.Namespace``. Tests and benchmarks build the same sections directly
(every field has Megatron-LM's default), so they run the product's own wiring
(:mod:`megatron_zb.training.wiring`).

Each field is documented with its flag and unit, as megatron-core's ``TransformerConfig`` is.
A field whose name is the ``args`` attribute is read by name (:func:`.fields.read_section`); a field that
sets a ``TransformerConfig`` field of another name or that needs a rule is mapped in one place
(:meth:`ModelConfig.transformer_config_kwargs`). Adding a Megatron-LM flag that only changes a
``TransformerConfig`` field is one field here, with ``metadata=TC`` (same name in both), plus the
parser's ``add_argument``.

The training length (``--train-iters`` / ``--train-samples``) and the batch-size ramp-up are
top-level fields of :class:`RunConfig` beside the batch sizes; the LR schedule's lengths in samples
are :meth:`OptimConfig.scheduler_steps` (Megatron-LM's rule, written once).

The data (:class:`DataConfig`, its tokenizer :class:`TokenizerConfig`) and re-planning (the
profiling window, ``--profile-out`` and the pipeline timeout in :class:`ScheduleConfig`) are typed
too, and so are checkpointing, early exit and the iteration log (:class:`CheckpointConfig`,
:class:`LoggingConfig`), Megatron-LM's ``--profile`` window and memory flags
(:class:`ProfilingConfig`, :class:`MemoryConfig`).

No ``argparse.Namespace`` travels below :func:`run_config`, not even for the two places where
Megatron-LM hands its whole ``args`` on: a checkpoint's ``args`` entry here holds the model's shape
fields (:data:`~megatron_zb.training.checkpointing.SHAPE_ARGS`), which :class:`ModelConfig` carries
under the same names, so save and load take the :class:`RunConfig`; and W&B's run config (Megatron-LM's
``vars(args)``) is captured once as :attr:`LoggingConfig.wandb_config`. Keeping a reference to the
Namespace instead would leave every function below one attribute away from reading a flag untyped.

The modules: :mod:`.model` (the network), :mod:`.layout` (parallel layout, schedule), :mod:`.optim`
(precision, optimizer, LR schedule, post-validation), :mod:`.data` (data, tokenizer), :mod:`.loop`
(checkpoint loading and exit, logging, ``--profile``, memory); :mod:`.fields` the rule they share.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .data import DataConfig, TokenizerConfig
from .fields import TC
from .layout import ParallelConfig, ScheduleConfig
from .loop import CheckpointConfig, LoggingConfig, MemoryConfig, ProfilingConfig
from .model import MLAConfig, ModelConfig, MoEConfig, RecomputeConfig
from .optim import OptimConfig, PostValidationConfig, PrecisionConfig, SchedulerSteps

if TYPE_CHECKING:
    from megatron_zb.training.batch_ramp import BatchRamp

__all__ = ["CheckpointConfig", "DataConfig", "LoggingConfig", "MemoryConfig", "MLAConfig", "ModelConfig", "MoEConfig",
           "OptimConfig",
           "ParallelConfig", "PostValidationConfig", "PrecisionConfig", "ProfilingConfig", "RecomputeConfig",
           "RunConfig", "ScheduleConfig", "SchedulerSteps", "TC", "TokenizerConfig", "run_config"]


@dataclass(frozen=True)
class RunConfig:
    """One run: every section, built once from the validated command line (:func:`run_config`)."""

    model: ModelConfig
    parallel: ParallelConfig
    precision: PrecisionConfig
    optim: OptimConfig
    schedule: ScheduleConfig
    micro_batch_size: int
    """``--micro-batch-size`` [sequences]."""
    global_batch_size: int
    """``--global-batch-size`` [sequences per iteration] (after any ramp-up)."""
    num_microbatches: int
    """Micro batches per iteration per data-parallel rank (after any ramp-up)."""
    train_iters: int
    """``--train-iters``, or with ``--train-samples`` the iterations Megatron-LM derives from it
    (:func:`~megatron_zb.training.batch_ramp.train_iters_from_samples`) [iterations]."""
    train_samples: int | None = None
    """``--train-samples`` [samples]; ``None``: the run counts iterations (``--train-iters``)."""
    rampup_batch_size: tuple[int, int, int] | None = None
    """``--rampup-batch-size START INCREMENT SAMPLES`` [samples]: the global batch grows from START by
    INCREMENT to ``global_batch_size`` over the first SAMPLES samples (:mod:`.batch_ramp`); ``None``:
    constant. ``global_batch_size`` and ``num_microbatches`` above are the final values."""
    seed: int = 1234
    """``--seed``."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """What ``--load`` restores; ``--exit-duration-in-mins``."""
    logging: LoggingConfig = LoggingConfig()
    """Extra statistics of the iteration line and TensorBoard."""
    profiling: ProfilingConfig = ProfilingConfig()
    """Megatron-LM's ``--profile`` window."""
    memory: MemoryConfig = MemoryConfig()
    """Manual garbage collection, ``torch.cuda.empty_cache()``."""
    data: DataConfig = DataConfig()
    """Datasets, loaders and the tokenizer."""

    def batch_ramp(self, *, consumed_samples: int = 0) -> "BatchRamp":
        """The :class:`~megatron_zb.training.batch_ramp.BatchRamp` of this run at ``consumed_samples``."""
        from megatron_zb.training.batch_ramp import BatchRamp

        return BatchRamp(global_batch_size=self.global_batch_size, micro_batch_size=self.micro_batch_size,
                         data_parallel_size=self.parallel.data_parallel_size,
                         rampup_batch_size=self.rampup_batch_size, consumed_samples=consumed_samples)

    def scheduler_steps(self) -> SchedulerSteps:
        """The LR scheduler's lengths of this run (:meth:`OptimConfig.scheduler_steps`) [samples]."""
        return self.optim.scheduler_steps(train_iters=self.train_iters, train_samples=self.train_samples,
                                          global_batch_size=self.global_batch_size)

    def replace(self, **changes: Any) -> "RunConfig":
        """A copy with top-level fields replaced."""
        return dataclasses.replace(self, **changes)


def run_config(args: argparse.Namespace) -> RunConfig:
    """The :class:`RunConfig` of validated ``args`` (after ``validate_args``)."""
    return RunConfig(model=ModelConfig.from_args(args), parallel=ParallelConfig.from_args(args),
                     precision=PrecisionConfig.from_args(args), optim=OptimConfig.from_args(args),
                     schedule=ScheduleConfig.from_args(args), micro_batch_size=args.micro_batch_size,
                     global_batch_size=args.global_batch_size, num_microbatches=args.num_microbatches,
                     train_iters=args.train_iters, train_samples=args.train_samples,
                     rampup_batch_size=(tuple(args.rampup_batch_size) if args.rampup_batch_size is not None
                                        else None), seed=args.seed, checkpoint=CheckpointConfig.from_args(args),
                     logging=LoggingConfig.from_args(args), profiling=ProfilingConfig.from_args(args),
                     memory=MemoryConfig.from_args(args), data=DataConfig.from_args(args))

"""The parallel layout and the pipeline schedule sections of the run configuration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .fields import read_section

__all__ = ["ParallelConfig", "ScheduleConfig"]


@dataclass(frozen=True)
class ParallelConfig:
    """The parallel layout and megatron-core DDP's settings (Megatron-LM's "distributed" flags)."""

    world_size: int = 1
    """Processes in the job (the launcher's ``WORLD_SIZE``)."""
    tensor_model_parallel_size: int = 1
    """``--tensor-model-parallel-size``."""
    pipeline_model_parallel_size: int = 1
    """``--pipeline-model-parallel-size``."""
    data_parallel_size: int = 1
    """``world_size / (TP x PP)``."""
    expert_model_parallel_size: int = 1
    """``--expert-model-parallel-size``."""
    sequence_parallel: bool = False
    """``--sequence-parallel``."""
    distributed_backend: str = "gloo"
    """``--distributed-backend`` as resolved: ``"nccl"`` or ``"gloo"``."""
    distributed_timeout_minutes: int = 10
    """``--distributed-timeout-minutes`` [minutes]."""
    overlap_grad_reduce: bool = False
    """``--overlap-grad-reduce``."""
    overlap_param_gather: bool = False
    """``--overlap-param-gather``."""
    use_distributed_optimizer: bool = False
    """``--use-distributed-optimizer``."""
    ddp_bucket_size: int | None = None
    """``--ddp-bucket-size`` [elements] (``None``: megatron-core's default)."""
    ddp_average_in_collective: bool = False
    """``--ddp-average-in-collective``."""

    @classmethod
    def from_args(cls, args: Any) -> "ParallelConfig":
        """The parallel section of validated ``args``."""
        return read_section(cls, args)


@dataclass(frozen=True)
class ScheduleConfig:
    """The pipeline schedule as validation resolved it (``--enable-zero-bubble`` and friends)."""

    name: str
    """The schedule's registry name (``1f1b`` without a zero-bubble flag)."""
    placement: str
    """``"plain"``, ``"interleaved"`` or ``"v"``."""
    split_backward: bool
    """Whether backward is split into B and W."""
    cost_aware: bool
    """Whether the schedule is rebuilt from profiled costs."""
    num_model_chunks: int
    """Model chunks (pipeline stages) per pipeline rank."""
    layers_per_stage: tuple[int, ...]
    """Transformer layers of each pipeline stage, stage order."""
    max_pending_backward: int | None = None
    """``--zero-bubble-max-pending-backward`` as resolved [micro batches of activations per rank]."""
    memory_limit: float | None = None
    """The same limit in the schedule library's unit (one stage's activation ``M_B``)."""
    use_megatron_core_schedule: bool = False
    """``--use-megatron-core-schedule``: megatron-core's own schedule (the parity reference)."""

    @property
    def num_pipeline_stages(self) -> int:
        """Stages of the whole pipeline."""
        return len(self.layers_per_stage)

    @classmethod
    def from_args(cls, args: Any) -> "ScheduleConfig":
        """The schedule section of validated ``args``."""
        return cls(name=args.schedule, placement=args.schedule_placement, split_backward=args.split_backward,
                   cost_aware=args.schedule_cost_aware, num_model_chunks=args.num_model_chunks,
                   layers_per_stage=tuple(args.num_layers_per_stage),
                   max_pending_backward=args.zero_bubble_max_pending_backward,
                   memory_limit=args.schedule_memory_limit, use_megatron_core_schedule=args.use_megatron_core_schedule)

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
    data_parallel_sharding_strategy: str = "no_shard"
    """``--data-parallel-sharding-strategy``: ``optim_grads`` shards the gradients too
    (:mod:`megatron_zb.runtime.sharded_grads`)."""
    allow_padding_num_layers: bool = False
    """``--allow-padding-num-layers``: the first and last pipeline stages may take fewer layers."""
    decoder_first_pipeline_num_layers: int | None = None
    """``--decoder-first-pipeline-num-layers`` [layers of the first stage]; ``None``: the even split."""
    decoder_last_pipeline_num_layers: int | None = None
    """``--decoder-last-pipeline-num-layers`` [layers of the last stage]; ``None``: the even split."""
    account_for_embedding_in_pipeline_split: bool = False
    """``--account-for-embedding-in-pipeline-split``: the embedding counts as one layer of the first stage."""
    account_for_loss_in_pipeline_split: bool = False
    """``--account-for-loss-in-pipeline-split``: the loss counts as one layer of the last stage."""

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
    wgrad_group: int | None = None
    """``--zero-bubble-wgrad-group``: each stage's W's run in groups of this many micro batches, layer-major
    [micro batches]; ``None``: as the schedule places them."""
    use_megatron_core_schedule: bool = False
    """``--use-megatron-core-schedule``: megatron-core's own schedule (the parity reference)."""
    enable_vocab_parallel: bool = False
    """``--enable-vocab-parallel``: the word embedding and the output layer sliced over the pipeline
    ranks, their passes placed by the (vocabulary-parallel) schedule (docs/vocab_parallel.md)."""
    pipeline_timeout_seconds: float = 300.0
    """``--pipeline-timeout-seconds``: how long the runtime waits for a peer before naming it [s]."""
    zero_bubble_pipeline_timers_start_iter: int = 2
    """``--zero-bubble-pipeline-timers-start-iter``: first profiled iteration [iterations, 1-based]."""
    zero_bubble_pipeline_timers_end_iter: int = 4
    """``--zero-bubble-pipeline-timers-end-iter``: the profiling window ends before it; a cost-aware
    schedule is re-planned after its last iteration [iterations, 1-based]."""
    profile_out: str | None = None
    """``--profile-out FILE``: where global rank 0 writes the measured costs as a planning profile
    (what ``megatron-zb plan --profile`` reads); ``None``: not written."""

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
                   memory_limit=args.schedule_memory_limit, wgrad_group=args.zero_bubble_wgrad_group,
                   use_megatron_core_schedule=args.use_megatron_core_schedule,
                   pipeline_timeout_seconds=args.pipeline_timeout_seconds,
                   zero_bubble_pipeline_timers_start_iter=args.zero_bubble_pipeline_timers_start_iter,
                   zero_bubble_pipeline_timers_end_iter=args.zero_bubble_pipeline_timers_end_iter,
                   profile_out=args.profile_out,
                   enable_vocab_parallel=bool(getattr(args, "enable_vocab_parallel", False)))

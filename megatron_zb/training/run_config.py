"""The typed run configuration: what a validated command line means, as frozen dataclasses.

:func:`run_config` turns validated Megatron-LM-style ``args`` into one :class:`RunConfig`; the
set-up functions below the entry point (model, DDP, optimizer, process groups, FLOPs) take its
sections, never the ``argparse.Namespace``. Tests and benchmarks build the same sections directly
(every field has Megatron-LM's default), so they run the product's own wiring
(:mod:`megatron_zb.training.wiring`).

Each field is documented with its flag and unit, as megatron-core's ``TransformerConfig`` is.
A field whose name is the ``args`` attribute is read by name (:func:`_section`); a field that
sets a ``TransformerConfig`` field of another name or that needs a rule is mapped in one place
(:meth:`ModelConfig.transformer_config_kwargs`). Adding a Megatron-LM flag that only changes a
``TransformerConfig`` field is one field here, with ``metadata=TC`` (same name in both), plus the
parser's ``add_argument``.

The training length (``--train-iters`` / ``--train-samples``) and the batch-size ramp-up are
top-level fields of :class:`RunConfig` beside the batch sizes; the LR schedule's lengths in samples
are :meth:`OptimConfig.scheduler_steps` (Megatron-LM's rule, written once).

Sections still read from ``args`` (not yet typed): data, most of checkpointing and logging, re-planning.
Typed so far of those: what Megatron-LM's loading, exit, logging, profiling and memory flags add
(:class:`CheckpointConfig`, :class:`LoggingConfig`, :class:`ProfilingConfig`, :class:`MemoryConfig`).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from megatron.core.transformer.enums import AttnBackend

if TYPE_CHECKING:
    from megatron_zb.training.batch_ramp import BatchRamp

__all__ = ["CheckpointConfig", "LoggingConfig", "MemoryConfig", "ModelConfig", "MoEConfig", "OptimConfig",
           "ParallelConfig", "PostValidationConfig", "PrecisionConfig", "ProfilingConfig", "RecomputeConfig",
           "RunConfig", "ScheduleConfig", "SchedulerSteps", "TC", "run_config"]

TC = {"transformer_config": True}
"""Field metadata: the field is passed to ``TransformerConfig`` under its own name."""

T = TypeVar("T")


def _section(cls: type[T], args: Any, **given: Any) -> T:
    """``cls`` with every field not in ``given`` read from ``args`` by name (Megatron-LM's ``dest``)."""
    values = {f.name: getattr(args, f.name) for f in fields(cls) if f.name not in given}  # type: ignore[arg-type]
    return cls(**values, **given)


@dataclass(frozen=True)
class RecomputeConfig:
    """Activation recomputation (``--recompute-*``; megatron-core's meanings)."""

    recompute_granularity: str | None = field(default=None, metadata=TC)
    """``--recompute-granularity``: ``"full"``, ``"selective"`` or ``None`` (off)."""
    recompute_method: str | None = field(default=None, metadata=TC)
    """``--recompute-method`` (``"uniform"`` / ``"block"``) with full recomputation."""
    recompute_num_layers: int | None = field(default=None, metadata=TC)
    """``--recompute-num-layers`` [layers]."""
    recompute_modules: tuple[str, ...] | None = None
    """``--recompute-modules`` with selective recomputation (``None``: megatron-core's default)."""


@dataclass(frozen=True)
class MoEConfig:
    """Mixture of experts (``--num-experts`` and the ``--moe-*`` flags)."""

    num_experts: int
    """``--num-experts``: experts per MoE layer."""
    moe_layer_pattern: tuple[int, ...]
    """From ``--moe-layer-freq``: one 0/1 per global layer (1 = MoE MLP)."""
    moe_router_topk: int = 2
    """``--moe-router-topk``: experts per token."""
    moe_ffn_hidden_size: int | None = None
    """``--moe-ffn-hidden-size`` [elements] (validation defaults it to ``--ffn-hidden-size``)."""
    moe_aux_loss_coeff: float = 0.0
    """``--moe-aux-loss-coeff``."""
    moe_router_load_balancing_type: str = "aux_loss"
    """``--moe-router-load-balancing-type``."""
    moe_token_dispatcher_type: str = "allgather"
    """``--moe-token-dispatcher-type``."""
    moe_grouped_gemm: bool = False
    """``--moe-grouped-gemm``."""

    def transformer_config_kwargs(self, *, expert_model_parallel_size: int) -> dict[str, Any]:
        """The MoE fields of ``TransformerConfig``."""
        return dict(num_moe_experts=self.num_experts, moe_router_topk=self.moe_router_topk,
                    moe_ffn_hidden_size=self.moe_ffn_hidden_size, moe_aux_loss_coeff=self.moe_aux_loss_coeff,
                    moe_router_load_balancing_type=self.moe_router_load_balancing_type,
                    moe_token_dispatcher_type=self.moe_token_dispatcher_type,
                    expert_model_parallel_size=expert_model_parallel_size,
                    moe_layer_freq=list(self.moe_layer_pattern), moe_grouped_gemm=self.moe_grouped_gemm)

    @classmethod
    def from_args(cls, args: Any) -> "MoEConfig | None":
        """The MoE section of validated ``args`` (``None`` for a dense model)."""
        if args.num_experts is None:
            return None
        return _section(cls, args, moe_layer_pattern=tuple(args.moe_layer_pattern))


@dataclass(frozen=True)
class ModelConfig:
    """The network (Megatron-LM's "network size" and implementation flags); sizes in elements."""

    num_layers: int = field(metadata=TC)
    """``--num-layers``: transformer layers of the whole model."""
    hidden_size: int = field(metadata=TC)
    """``--hidden-size``."""
    num_attention_heads: int = field(metadata=TC)
    """``--num-attention-heads``."""
    seq_length: int
    """``--seq-length`` [tokens]."""
    padded_vocab_size: int
    """Embedding rows: the vocabulary padded to ``--make-vocab-size-divisible-by`` x TP [tokens]."""
    ffn_hidden_size: int = field(metadata=TC)
    """``--ffn-hidden-size`` (validation: ``4h``, with ``--swiglu`` ``int(8h/3/64)*64``)."""
    kv_channels: int = field(metadata=TC)
    """``--kv-channels`` (validation: ``h / heads``)."""
    max_position_embeddings: int
    """``--max-position-embeddings`` (validation: ``--seq-length``) [positions]."""
    num_query_groups: int | None = None
    """``--num-query-groups`` when ``--group-query-attention`` is given, else ``None`` (one per head)."""
    hidden_dropout: float = field(default=0.1, metadata=TC)
    """``--hidden-dropout`` (probability)."""
    attention_dropout: float = field(default=0.1, metadata=TC)
    """``--attention-dropout`` (probability)."""
    normalization: str = field(default="LayerNorm", metadata=TC)
    """``--normalization``: ``"LayerNorm"`` or ``"RMSNorm"``."""
    norm_epsilon: float = 1e-5
    """``--norm-epsilon`` (``TransformerConfig.layernorm_epsilon``)."""
    layernorm_zero_centered_gamma: bool = field(default=False, metadata=TC)
    """``--apply-layernorm-1p``: LayerNorm weights centred on 0 (apex or Transformer Engine norms)."""
    swiglu: bool = False
    """``--swiglu``: gated linear unit with SiLU (else GeLU)."""
    add_bias_linear: bool = field(default=True, metadata=TC)
    """Cleared by ``--disable-bias-linear``."""
    qk_layernorm: bool = field(default=False, metadata=TC)
    """``--qk-layernorm``."""
    attention_softmax_in_fp32: bool = field(default=False, metadata=TC)
    """``--attention-softmax-in-fp32``."""
    rotary_interleaved: bool = field(default=False, metadata=TC)
    """``--rotary-interleaved``: rotate interleaved pairs of a head's channels instead of its two halves."""
    init_method_std: float = field(default=0.02, metadata=TC)
    """``--init-method-std``."""
    position_embedding_type: str = "learned_absolute"
    """``--position-embedding-type``: ``"learned_absolute"``, ``"rope"`` or ``"none"``."""
    rotary_percent: float = 1.0
    """``--rotary-percent``."""
    rotary_base: int = 10000
    """``--rotary-base``."""
    untie_embeddings_and_output_weights: bool = False
    """``--untie-embeddings-and-output-weights``."""
    calculate_per_token_loss: bool = field(default=False, metadata=TC)
    """``--calculate-per-token-loss``."""
    transformer_impl: str = "local"
    """``--transformer-impl`` as resolved: ``"local"`` or ``"transformer_engine"``."""
    transformer_impl_reason: str = "requested"
    """Why that implementation (a phrase for the start-up log)."""
    gradient_accumulation_fusion: bool = field(default=False, metadata=TC)
    """``--no-gradient-accumulation-fusion`` cleared, as resolved (apex's or megatron-zb's kernels)."""
    wgrad_kernel: str = "autograd"
    """Which kernel accumulates weight gradients (start-up log)."""
    attention_backend: AttnBackend = field(default=AttnBackend.auto, metadata=TC)
    """``--attention-backend``: megatron-core's ``AttnBackend``."""
    masked_softmax_fusion: bool = field(default=False, metadata=TC)
    """Fused scale-mask-softmax: on by Megatron-LM's default where its kernel runs (CUDA), else off
    (``--no-masked-softmax-fusion`` turns it off)."""
    bias_activation_fusion: bool = field(default=False, metadata=TC)
    """Fused bias-GeLU / bias-SwiGLU (``--no-bias-gelu-fusion`` / ``--no-bias-swiglu-fusion``; CUDA only)."""
    bias_dropout_fusion: bool = field(default=False, metadata=TC)
    """Fused bias-dropout-add (``--no-bias-dropout-fusion``; CUDA only)."""
    apply_rope_fusion: bool = field(default=False, metadata=TC)
    """Transformer Engine's fused RoPE (``--no-rope-fusion``; RoPE, CUDA and Transformer Engine)."""
    persist_layer_norm: bool = field(default=False, metadata=TC)
    """apex's persistent LayerNorm (``--no-persist-layer-norm``; CUDA and apex)."""
    cross_entropy_loss_fusion: bool = field(default=False, metadata=TC)
    """``--cross-entropy-loss-fusion``: megatron-core's fused cross entropy."""
    cross_entropy_fusion_impl: str = field(default="native", metadata=TC)
    """``--cross-entropy-fusion-impl``: ``"native"`` (megatron-core's) or ``"te"`` (Transformer Engine's)."""
    fp8: str | None = field(default=None, metadata=TC)
    """``--fp8-format``: ``"e4m3"`` or ``"hybrid"`` FP8 through Transformer Engine (``None``: off)."""
    fp8_recipe: str = field(default="delayed", metadata=TC)
    """``--fp8-recipe``: the FP8 scaling recipe."""
    fp8_margin: int = field(default=0, metadata=TC)
    """``--fp8-margin``: margin of the scaling factor."""
    fp8_interval: int = field(default=1, metadata=TC)
    """``--fp8-interval`` (ignored by Transformer Engine >= 1.8) [iterations]."""
    fp8_amax_history_len: int = field(default=1, metadata=TC)
    """``--fp8-amax-history-len``: the amax history window [iterations]."""
    fp8_amax_compute_algo: str = field(default="most_recent", metadata=TC)
    """``--fp8-amax-compute-algo``: ``"most_recent"`` or ``"max"`` of the history."""
    fp8_param: bool = field(default=False, metadata=TC)
    """``--fp8-param-gather``: parameters kept (and all-gathered) in FP8."""
    tp_comm_overlap: bool = field(default=False, metadata=TC)
    """``--tp-comm-overlap``: Transformer Engine's userbuffer overlap of tensor-parallel communication."""
    recompute: RecomputeConfig = RecomputeConfig()
    """Activation recomputation."""
    moe: MoEConfig | None = None
    """Mixture of experts, ``None`` for a dense model."""

    def transformer_config_kwargs(self) -> dict[str, Any]:
        """The model's ``TransformerConfig`` fields (Megatron-LM's ``core_transformer_config_from_args``
        rules: ``--swiglu`` is a gated linear unit with SiLU, ``--norm-epsilon`` is ``layernorm_epsilon``)."""
        import torch.nn.functional as F

        out = {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("transformer_config")}
        out.update({f.name: getattr(self.recompute, f.name) for f in fields(self.recompute)
                    if f.metadata.get("transformer_config")})
        out.update(layernorm_epsilon=self.norm_epsilon, gated_linear_unit=self.swiglu,
                   activation_func=F.silu if self.swiglu else F.gelu, num_query_groups=self.num_query_groups,
                   recompute_modules=(list(self.recompute.recompute_modules)
                                      if self.recompute.recompute_modules is not None else None))
        return out

    def gpt_model_kwargs(self) -> dict[str, Any]:
        """``GPTModel`` arguments beyond the config: position embeddings and embedding tying."""
        return dict(position_embedding_type=self.position_embedding_type, rotary_percent=self.rotary_percent,
                    rotary_base=self.rotary_base,
                    share_embeddings_and_output_weights=not self.untie_embeddings_and_output_weights)

    @classmethod
    def from_args(cls, args: Any) -> "ModelConfig":
        """The model section of validated ``args``."""
        modules = args.recompute_modules
        return _section(cls, args, num_query_groups=args.num_query_groups if args.group_query_attention else None,
                        fp8_param=args.fp8_param_gather,
                        recompute=_section(RecomputeConfig, args, recompute_modules=(
                            tuple(modules) if modules is not None else None)),
                        moe=MoEConfig.from_args(args))


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
        return _section(cls, args)


@dataclass(frozen=True)
class PrecisionConfig:
    """Mixed precision (``--fp16`` / ``--bf16`` and loss scaling)."""

    fp16: bool = False
    """``--fp16``."""
    bf16: bool = False
    """``--bf16``."""
    loss_scale: float | None = None
    """``--loss-scale``: a static loss scale (fp16); ``None``: dynamic."""
    initial_loss_scale: float = 2.0 ** 32
    """``--initial-loss-scale`` of the dynamic loss scaler."""
    min_loss_scale: float = 1.0
    """``--min-loss-scale`` of the dynamic loss scaler."""
    loss_scale_window: float = 1000
    """``--loss-scale-window``: clean steps before the dynamic loss scale grows [iterations]."""
    hysteresis: int = 2
    """``--hysteresis``: overflowing steps tolerated before the dynamic loss scale shrinks."""
    accumulate_allreduce_grads_in_fp32: bool = False
    """``--accumulate-allreduce-grads-in-fp32`` (implied by ``--bf16``, see :attr:`grad_reduce_in_fp32`)."""
    grad_reduce_in_bf16: bool = False
    """``--grad-reduce-in-bf16``: with bf16, gradients accumulated and reduced in bf16."""

    @property
    def params_dtype(self) -> torch.dtype:
        """The parameters' dtype: ``torch.float16`` / ``torch.bfloat16`` / ``torch.float32``."""
        return torch.float16 if self.fp16 else torch.bfloat16 if self.bf16 else torch.float32

    @property
    def grad_reduce_in_fp32(self) -> bool:
        """Gradients accumulated and reduced in fp32: ``--accumulate-allreduce-grads-in-fp32``, which
        Megatron-LM turns on for bf16 -- and off for bf16 with ``--grad-reduce-in-bf16``."""
        if self.bf16 and self.grad_reduce_in_bf16:
            return False
        return self.accumulate_allreduce_grads_in_fp32 or self.bf16

    @classmethod
    def from_args(cls, args: Any) -> "PrecisionConfig":
        """The precision section of validated ``args``."""
        return _section(cls, args)


@dataclass(frozen=True)
class PostValidationConfig:
    """Optimizer post-validation (``--enable-optimizer-post-validation``); counts in iterations."""

    exact: bool = False
    """``--enable-exactly-numeric-match``: roll back by restoring a copy (else in place)."""
    warmup_iters: int = 10
    """``--post-validation-warmup-iters``: synchronous steps first."""
    fallback_clean_iters: int = 10
    """``--post-validation-fallback-clean-iters``: synchronous after a rollback until this many clean steps."""
    timeout_seconds: float = 300.0
    """How long a rank waits for the others' statistics (``--pipeline-timeout-seconds``, the deadline of
    every collective the zero-bubble path adds: it fires before the process groups' own
    ``--distributed-timeout-minutes``) [s]."""

    @classmethod
    def from_args(cls, args: Any) -> "PostValidationConfig":
        """From ``args`` of ``pretrain_gpt_zb.py`` or Megatron-LM (the same flag names)."""
        return cls(exact=args.enable_exactly_numeric_match, warmup_iters=args.post_validation_warmup_iters,
                   fallback_clean_iters=args.post_validation_fallback_clean_iters,
                   timeout_seconds=args.pipeline_timeout_seconds)


@dataclass(frozen=True)
class SchedulerSteps:
    """Lengths of megatron-core's ``OptimizerParamScheduler``, which counts samples [samples]."""

    lr_warmup_steps: float
    """Linear warm-up (a float with ``--lr-warmup-fraction``, as Megatron-LM passes it)."""
    lr_decay_steps: int
    """Decay to ``--min-lr``."""
    wd_incr_steps: int
    """Weight decay's increment length: the whole run."""
    wsd_decay_steps: int | None = None
    """WSD's annealing phase, at the end of the decay (``None``: not given)."""


@dataclass(frozen=True)
class OptimConfig:
    """The optimizer and its learning-rate schedule (Megatron-LM's "training" / "learning rate" flags)."""

    lr: float
    """``--lr``: peak learning rate."""
    optimizer: str = "adam"
    """``--optimizer``: ``"adam"`` or ``"sgd"``."""
    min_lr: float = 0.0
    """``--min-lr``."""
    weight_decay: float = 0.01
    """``--weight-decay``."""
    adam_beta1: float = 0.9
    """``--adam-beta1``."""
    adam_beta2: float = 0.999
    """``--adam-beta2``."""
    adam_eps: float = 1e-8
    """``--adam-eps``."""
    clip_grad: float = 1.0
    """``--clip-grad``: gradient-norm clipping (0: off)."""
    lr_warmup_iters: int = 0
    """``--lr-warmup-iters`` [iterations] (with ``--train-iters``)."""
    lr_decay_iters: int | None = None
    """``--lr-decay-iters`` [iterations] (validation: ``--train-iters``; ``None`` with ``--train-samples``)."""
    lr_warmup_samples: int = 0
    """``--lr-warmup-samples`` [samples] (with ``--train-samples``)."""
    lr_decay_samples: int | None = None
    """``--lr-decay-samples`` [samples] (validation: ``--train-samples``; ``None`` with ``--train-iters``)."""
    lr_warmup_fraction: float | None = None
    """``--lr-warmup-fraction``: the warm-up as a fraction of the decay length, instead of
    ``lr_warmup_iters`` / ``lr_warmup_samples`` (``None``: not given)."""
    lr_wsd_decay_style: str = "exponential"
    """``--lr-wsd-decay-style``: the annealing phase of ``--lr-decay-style WSD``."""
    lr_wsd_decay_iters: int | None = None
    """``--lr-wsd-decay-iters`` [iterations]: WSD's annealing phase (with ``--train-iters``)."""
    lr_wsd_decay_samples: int | None = None
    """``--lr-wsd-decay-samples`` [samples]: WSD's annealing phase (with ``--train-samples``)."""
    lr_decay_style: str = "linear"
    """``--lr-decay-style``."""
    decoupled_lr: float | None = None
    """``--decoupled-lr``: peak learning rate of the input embedding and the output layer (``None``: ``lr``)."""
    decoupled_min_lr: float | None = None
    """``--decoupled-min-lr``: their minimum learning rate (``None``: ``min_lr``)."""
    use_checkpoint_opt_param_scheduler: bool = False
    """``--use-checkpoint-opt_param-scheduler``."""
    override_opt_param_scheduler: bool = False
    """``--override-opt_param-scheduler``."""
    post_validation: PostValidationConfig | None = None
    """With ``--enable-optimizer-post-validation``: its settings; ``None``: off."""
    log_num_zeros_in_grad: bool = False
    """``--log-num-zeros-in-grad``: megatron-core's ``OptimizerConfig.log_num_zeros_in_grad`` (the
    optimizer counts the zero gradient elements of each step) [elements]."""

    def scheduler_steps(self, *, train_iters: int, train_samples: int | None,
                        global_batch_size: int) -> "SchedulerSteps":
        """The LR scheduler's lengths in samples, Megatron-LM's rule (``get_optimizer_param_scheduler``):
        iteration-based (``train_samples`` ``None``): iterations x ``global_batch_size`` (the final one);
        sample-based: the sample counts as given; ``--lr-warmup-fraction`` x the decay length either way;
        WSD's annealing phase likewise (``--lr-wsd-decay-iters`` / ``--lr-wsd-decay-samples``)."""
        if train_samples is None:
            decay = (self.lr_decay_iters if self.lr_decay_iters is not None else train_iters) * global_batch_size
            warmup: float = self.lr_warmup_iters * global_batch_size
            wd_incr = train_iters * global_batch_size
            wsd = self.lr_wsd_decay_iters * global_batch_size if self.lr_wsd_decay_iters is not None else None
        else:
            decay = self.lr_decay_samples if self.lr_decay_samples is not None else train_samples
            warmup, wd_incr, wsd = self.lr_warmup_samples, train_samples, self.lr_wsd_decay_samples
        if self.lr_warmup_fraction is not None:
            warmup = self.lr_warmup_fraction * decay
        return SchedulerSteps(lr_warmup_steps=warmup, lr_decay_steps=decay, wd_incr_steps=wd_incr,
                              wsd_decay_steps=wsd)

    @classmethod
    def from_args(cls, args: Any) -> "OptimConfig":
        """The optimizer section of validated ``args``."""
        pv = PostValidationConfig.from_args(args) if args.enable_optimizer_post_validation else None
        return _section(cls, args, post_validation=pv)


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
    enable_vocab_parallel: bool = False
    """``--enable-vocab-parallel``: the word embedding and the output layer sliced over the pipeline
    ranks, their passes placed by the (vocabulary-parallel) schedule (docs/vocab_parallel.md)."""

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
                   memory_limit=args.schedule_memory_limit, use_megatron_core_schedule=args.use_megatron_core_schedule,
                   enable_vocab_parallel=bool(getattr(args, "enable_vocab_parallel", False)))


@dataclass(frozen=True)
class CheckpointConfig:
    """What ``--load`` restores and when a run saves and exits early (Megatron-LM's meanings)."""

    no_load_optim: bool = False
    """``--no-load-optim``: keep this run's fresh optimizer state and LR scheduler; the fp32 main
    parameters are refreshed from the loaded model (megatron-core's ``reload_model_params``)."""
    no_load_rng: bool = False
    """``--no-load-rng``: keep this run's random states (seeded by ``--seed``)."""
    finetune: bool = False
    """``--finetune``: load the model only: iteration 0, no consumed samples, no optimizer / LR
    scheduler / random states / profiled costs from the checkpoint."""
    exit_duration_in_mins: float | None = None
    """``--exit-duration-in-mins``: after the first iteration that ends this long after the run
    started, save (``--save``) and exit 0; checked on every rank after every iteration [minutes]."""

    @classmethod
    def from_args(cls, args: Any) -> "CheckpointConfig":
        """The section of validated ``args`` (Megatron-LM's ``--no-load-*`` default to ``None``: off)."""
        return cls(no_load_optim=bool(args.no_load_optim), no_load_rng=bool(args.no_load_rng),
                   finetune=args.finetune, exit_duration_in_mins=args.exit_duration_in_mins or None)


@dataclass(frozen=True)
class LoggingConfig:
    """What the iteration line and TensorBoard report besides the loss (Megatron-LM's "logging" flags)."""

    log_params_norm: bool = False
    """``--log-params-norm``: ``params norm`` in the iteration line and ``params-norm`` in TensorBoard:
    the L2 norm of the model's parameters after the step, over all ranks (Megatron-LM's
    ``calc_params_l2_norm``) [parameter units]."""
    log_memory_to_tensorboard: bool = False
    """``--log-memory-to-tensorboard``: CUDA caching-allocator statistics in TensorBoard
    (``mem-reserved-bytes``, ``mem-allocated-bytes``, ``mem-max-allocated-bytes`` [bytes],
    ``mem-allocated-count``); nothing on CPU."""

    @classmethod
    def from_args(cls, args: Any) -> "LoggingConfig":
        """The section of validated ``args``."""
        return _section(cls, args)


@dataclass(frozen=True)
class ProfilingConfig:
    """Megatron-LM's ``--profile`` window (its ``ProfilingConfig``); iterations are global, 1-based."""

    profile: bool = False
    """``--profile``: profile the window below on the ranks of :attr:`profile_ranks`."""
    profile_step_start: int = 10
    """``--profile-step-start`` [iterations completed when the window opens]."""
    profile_step_end: int = 12
    """``--profile-step-end`` [iteration after which the window closes]."""
    profile_ranks: tuple[int, ...] = (0,)
    """``--profile-ranks``: global ranks that profile."""
    use_pytorch_profiler: bool = False
    """``--use-pytorch-profiler``: PyTorch's profiler (always on CPU); else CUDA's capture range
    (``cudaProfilerStart/Stop`` with NVTX ranges, for ``nsys --capture-range=cudaProfilerApi``)."""
    trace_dir: str | None = None
    """Where the PyTorch profiler writes one Chrome trace per profiled rank: ``--tensorboard-dir``."""

    @classmethod
    def from_args(cls, args: Any) -> "ProfilingConfig":
        """The section of validated ``args``."""
        return _section(cls, args, profile_ranks=tuple(args.profile_ranks), trace_dir=args.tensorboard_dir)


@dataclass(frozen=True)
class MemoryConfig:
    """Host garbage collection and the CUDA caching allocator (Megatron-LM's training flags)."""

    manual_gc: bool = False
    """``--manual-gc``: Python's automatic garbage collector off for the run; collections at
    :attr:`manual_gc_interval` and around evaluation instead, at the same point on every rank."""
    manual_gc_interval: int = 0
    """``--manual-gc-interval``: a full collection after every this many iterations (0: none) [iterations]."""
    manual_gc_eval: bool = True
    """Cleared by ``--no-manual-gc-eval``: with ``--manual-gc``, collect before and after each
    evaluation during training."""
    empty_unused_memory_level: int = 0
    """``--empty-unused-memory-level``: ``torch.cuda.empty_cache()`` after forward-backward and each
    evaluation step (1), and also after the optimizer step (2); 0: never. No-op on CPU."""

    @classmethod
    def from_args(cls, args: Any) -> "MemoryConfig":
        """The section of validated ``args``."""
        return _section(cls, args)


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
                     memory=MemoryConfig.from_args(args))

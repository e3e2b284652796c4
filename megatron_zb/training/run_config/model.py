"""The model section of the run configuration: what megatron-core's ``TransformerConfig`` and the
layer spec are built from (Megatron-LM's "network size", "regularization", "mixed precision" model
fields, recomputation and MoE flags)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from megatron.core.transformer.enums import AttnBackend

from .fields import TC, read_section

__all__ = ["MLAConfig", "ModelConfig", "MoEConfig", "RecomputeConfig"]


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
    moe_router_dtype: str | None = None
    """``--moe-router-dtype``: ``"fp32"`` / ``"fp64"`` routing and weighted sum; ``None``: the model's dtype."""
    moe_shared_expert_intermediate_size: int | None = field(default=None, metadata=TC)
    """``--moe-shared-expert-intermediate-size`` [elements]: the shared experts' total FFN hidden size
    (shared experts x each one's size); ``None``: no shared expert."""
    moe_shared_expert_gate: bool = field(default=False, metadata=TC)
    """``--moe-shared-expert-gate``: a sigmoid gate (one weight row) on the shared experts' output."""
    moe_router_score_function: str = field(default="softmax", metadata=TC)
    """``--moe-router-score-function``: ``"softmax"`` or ``"sigmoid"`` (0.19 also ``"sqrtsoftplus"``)."""
    moe_router_num_groups: int | None = field(default=None, metadata=TC)
    """``--moe-router-num-groups``: expert groups of group-limited routing (with ``--moe-router-group-topk``)."""
    moe_router_group_topk: int | None = field(default=None, metadata=TC)
    """``--moe-router-group-topk``: groups each token may route to; ``None``: plain top-k."""
    moe_router_enable_expert_bias: bool = field(default=False, metadata=TC)
    """``--moe-router-enable-expert-bias``: aux-loss-free balancing, a per-expert bias on the routing
    scores updated once per iteration from the tokens each expert got (``finalize_model_grads``)."""
    moe_router_bias_update_rate: float = field(default=1e-3, metadata=TC)
    """``--moe-router-bias-update-rate``: the expert bias's step per iteration (in score units)."""
    moe_router_pre_softmax: bool = field(default=False, metadata=TC)
    """``--moe-router-pre-softmax``: the score function before the top-k selection."""
    moe_router_topk_scaling_factor: float | None = field(default=None, metadata=TC)
    """``--moe-router-topk-scaling-factor``: factor on the selected experts' routing weights; ``None``: 1."""

    def transformer_config_kwargs(self, *, expert_model_parallel_size: int) -> dict[str, Any]:
        """The MoE fields of ``TransformerConfig``."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("transformer_config")}
        return dict(out, num_moe_experts=self.num_experts, moe_router_topk=self.moe_router_topk,
                    moe_ffn_hidden_size=self.moe_ffn_hidden_size, moe_aux_loss_coeff=self.moe_aux_loss_coeff,
                    moe_router_load_balancing_type=self.moe_router_load_balancing_type,
                    moe_token_dispatcher_type=self.moe_token_dispatcher_type,
                    expert_model_parallel_size=expert_model_parallel_size,
                    moe_layer_freq=list(self.moe_layer_pattern), moe_grouped_gemm=self.moe_grouped_gemm,
                    moe_router_dtype=self.moe_router_dtype)

    @classmethod
    def from_args(cls, args: Any) -> "MoEConfig | None":
        """The MoE section of validated ``args`` (``None`` for a dense model)."""
        if args.num_experts is None:
            return None
        return read_section(cls, args, moe_layer_pattern=tuple(args.moe_layer_pattern))


@dataclass(frozen=True)
class MLAConfig:
    """Multi-latent attention (``--multi-latent-attention`` and the "mla" flags; sizes in elements)."""

    q_lora_rank: int | None = None
    """``--q-lora-rank``: the query's low rank (``None``: one query projection, no down/up pair)."""
    kv_lora_rank: int = 32
    """``--kv-lora-rank``: the keys' and values' low rank."""
    qk_head_dim: int = 128
    """``--qk-head-dim``: a head's channels in the QK projection (without the position part)."""
    qk_pos_emb_head_dim: int = 64
    """``--qk-pos-emb-head-dim``: a head's rotary channels in the QK projection."""
    v_head_dim: int = 128
    """``--v-head-dim``: a head's channels in the V projection."""
    rotary_scaling_factor: float = 1.0
    """``--rotary-scaling-factor`` (YaRN)."""
    mscale: float = 1.0
    """``--mscale`` (YaRN)."""
    mscale_all_dim: float = 0.0
    """``--mscale-all-dim`` (YaRN)."""
    rope_type: str | None = None
    """``--rope-type``: ``"rope"`` or ``"yarn"``; ``None``: ``MLATransformerConfig``'s default (yarn)."""

    def transformer_config_kwargs(self, *, rotary_base: int, rotary_percent: float) -> dict[str, Any]:
        """The MLA fields of ``MLATransformerConfig`` (Megatron-LM's ``core_transformer_config_from_args``: every
        field its args hold, ``rope_type`` only when given; ``multi_latent_attention`` selects the class,
        :func:`megatron_zb.model.cpu_gpt_config`)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "rope_type"}
        if self.rope_type is not None:
            out["rope_type"] = self.rope_type
        return dict(out, multi_latent_attention=True, rotary_base=rotary_base, rotary_percent=rotary_percent)

    @classmethod
    def from_args(cls, args: Any) -> "MLAConfig | None":
        """The MLA section of validated ``args`` (``None`` without ``--multi-latent-attention``)."""
        return read_section(cls, args) if args.multi_latent_attention else None


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
    vocab_size: int | None = None
    """``--vocab-size`` as validation resolved it: the tokenizer's vocabulary unless the flag is larger
    (``NullTokenizer``: the flag's value, the EOD id not counted) [tokens]; ``None``: not known (only
    :attr:`padded_vocab_size` counts for the model). What the planner is given (``--profile-out``)."""
    make_vocab_size_divisible_by: int = 128
    """``--make-vocab-size-divisible-by``: :attr:`padded_vocab_size` is a multiple of it x TP."""
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
    enable_experimental: bool = False
    """``--enable-experimental``: megatron-core's experimental features on (``megatron.core.config``),
    set before the model is built."""
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
    mtp_num_layers: int | None = field(default=None, metadata=TC)
    """``--mtp-num-layers``: multi-token prediction layers, on the last pipeline stage (``None``: no MTP)."""
    mtp_loss_scaling_factor: float = field(default=0.1, metadata=TC)
    """``--mtp-loss-scaling-factor``: the MTP layers' mean loss is added to the loss times this."""
    recompute: RecomputeConfig = RecomputeConfig()
    """Activation recomputation."""
    moe: MoEConfig | None = None
    """Mixture of experts, ``None`` for a dense model."""
    mla: MLAConfig | None = None
    """Multi-latent attention, ``None`` for standard attention."""

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
        if self.mla is not None:
            out.update(self.mla.transformer_config_kwargs(rotary_base=self.rotary_base,
                                                          rotary_percent=self.rotary_percent))
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
        return read_section(cls, args, num_query_groups=args.num_query_groups if args.group_query_attention else None,
                        fp8_param=args.fp8_param_gather,
                        recompute=read_section(RecomputeConfig, args, recompute_modules=(
                            tuple(modules) if modules is not None else None)),
                        moe=MoEConfig.from_args(args), mla=MLAConfig.from_args(args))

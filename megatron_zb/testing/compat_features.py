"""The rows and columns of the compatibility matrix: training features and schedule families.

A :class:`Feature` is data: the parallel layout, precision, optimizer kind and model options
(:class:`~megatron_zb.testing.tiny_gpt.TinyGPT`'s) of one training configuration, plus what the
matrix accepts as "equal" for it. Adding a feature (e.g. a new architecture flag) is adding a row
to :data:`FEATURES`; the runner (:mod:`megatron_zb.testing.compat_matrix`) and the rank code
(:mod:`megatron_zb.testing.compat_rank`) read only these fields.

Every cell compares one schedule family of megatron-zb with megatron-core's own schedule on the
same configuration (see :data:`REFERENCES`). Every arm wraps its chunks in megatron-core
``DistributedDataParallel`` (``get_megatron_optimizer`` needs it; at DP=1 it is the contiguous
``main_grad`` buffer) -- the bare ``param.grad`` path is covered by ``tests/runtime/test_runtime.py``.
It compares the loss of every microbatch of every iteration,
every rank's copy of every parameter's gradient (``main_grad`` under DDP), the parameters after
the optimizer steps, and each step's ``(update_successful, loss scale)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.nn.functional as F

from ..schedules.ir import Placement

__all__ = ["FAMILIES", "FEATURES", "Feature", "LLAMA", "MLA", "ModelShape", "REFERENCES", "Tolerance", "feature",
           "placement_of"]


@dataclass(frozen=True)
class Tolerance:
    """An accepted difference: ``max|got - ref| <= rtol * max|ref|`` per tensor, and why.

    Attributes:
        rtol: relative to the largest magnitude of the reference tensor (dimensionless).
        reason: one line for docs/compatibility.md (why the results are not bitwise equal).
        after_step: if set, the accepted difference for what follows an optimizer step -- the gradients
            of every iteration after the first and the parameters after the steps -- where ``rtol`` then
            bounds the losses of every iteration (the loss curve) and the first iteration's gradients
            (for a difference that Adam amplifies: ``reason`` says how).
    """

    rtol: float
    reason: str
    after_step: float | None = None


@dataclass(frozen=True)
class ModelShape:
    """The tiny GPT of the matrix (sizes in elements, counts in microbatches per iteration).

    ``num_layers`` must split evenly over 4 stages (V and interleaved placements at PP=2) unless a
    feature gives its own layer count and split (:attr:`Feature.num_layers`, :attr:`Feature.split`).
    """

    num_layers: int = 4
    hidden: int = 32
    heads: int = 4
    seq: int = 16
    vocab: int = 64
    micro_batch: int = 2
    num_microbatches: int = 4
    pp: int = 2
    seed: int = 1234


@dataclass(frozen=True)
class Feature:
    """One training configuration (a column of the matrix).

    Attributes:
        name: column name (``--features`` filter).
        description: one line for the docs.
        tp, dp: tensor- and data-parallel sizes (the pipeline size is :attr:`ModelShape.pp`).
        sequence_parallel: megatron's sequence parallelism (needs ``tp > 1``).
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (fp16: dynamic loss scaling, hysteresis 1).
        distributed_optimizer: megatron-core's distributed optimizer (ZeRO-1 over DP).
        grad_fusion: megatron-zb arms run ``gradient_accumulation_fusion`` (the matmul fallback
            kernel on CPU); the reference runs megatron-core's *unfused* path.
        post_validation: ``None``, ``"exact"`` or ``"in-place"``: megatron-zb arms wrap the
            optimizer in ``PostValidationOptimizer`` (warm-up 0, no fallback, no local-clip
            shortcut, so every clipped step is a real rollback); the reference does not.
        per_token_loss: ``calculate_per_token_loss`` (loss sum and token count per microbatch).
        iterations: optimizer steps per arm.
        loss_multipliers: per iteration, a factor on the loss (forces clipping or an fp16
            overflow on chosen iterations; ``()`` = all 1).
        clip_grad: megatron-core's gradient clipping threshold (global L2 norm; 0 = off). Off
            unless the feature is about clipping: the V placement's reference (PP=1) sums the
            squared norm in another grouping than any PP=2 layout, so a clip factor would differ
            in its last bit from the reference's for reasons that are not the schedule's.
        num_layers: the model's layer count when not :attr:`ModelShape.num_layers` (features whose
            options depend on it, e.g. an uneven split or a MoE layer pattern, fix it themselves).
        tiny_gpt: :class:`~megatron_zb.testing.tiny_gpt.TinyGPT` options of the model
            (``config_options``: extra ``TransformerConfig`` fields; ``model_options``: ``GPTModel``
            arguments; ``spec_options``: ``get_gpt_layer_local_spec`` arguments; ``moe_pattern``).
            Every arm, the reference included, builds the same model.
        split: per placement, :func:`megatron_zb.model.pipeline_split` arguments (an uneven layer
            split; megatron-zb arms and the reference of that placement share it; the V
            placement's reference is one stage and has no split). Missing: the even split.
        same_w_as: a feature whose cells must show exactly as many deferred weight-gradient
            computations for the same family (recomputation: W is queued once per linear per
            microbatch, as without it -- not skipped, not duplicated). Checked when both columns run.
        tolerance: per :class:`~megatron_zb.schedules.ir.Placement`, the accepted
            difference; a placement not listed must be bitwise equal.
        vocab_parallel: megatron-zb arms run the family's vocabulary-parallel form with the word
            embedding and the output layer sliced over the pipeline ranks
            (:mod:`~megatron_zb.testing.compat_vocab`); the reference runs the unsliced model.
        w_offset: deferred weight-gradient computations per microbatch (per iteration and TP x DP
            replica) this column has beyond its ``same_w_as`` column for a split-backward family
            (vocab-parallel: -1, the output layer's weight gradient runs in T on the slices).
    """

    name: str
    description: str
    tp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    precision: str = "fp32"
    distributed_optimizer: bool = False
    grad_fusion: bool = False
    post_validation: str | None = None
    per_token_loss: bool = False
    iterations: int = 2
    loss_multipliers: tuple[float, ...] = ()
    clip_grad: float = 0.0
    num_layers: int | None = None
    tiny_gpt: dict[str, Any] = field(default_factory=dict)
    split: dict[Placement, dict[str, Any]] = field(default_factory=dict)
    same_w_as: str | None = None
    tolerance: dict[Placement, Tolerance] = field(default_factory=dict)
    vocab_parallel: bool = False
    w_offset: int = 0

    def world_size(self, pp: int) -> int:
        """Processes of one launch at pipeline size ``pp``."""
        return self.tp * pp * self.dp

    def loss_multiplier(self, iteration: int) -> float:
        """The factor on the loss in ``iteration`` (0-based)."""
        return self.loss_multipliers[iteration] if iteration < len(self.loss_multipliers) else 1.0


_INPLACE = ("in-place rollback inverts Adam algebraically: the redone step starts from parameters and moments "
            "recovered to fp32 round-off (docs/post_validation.md); later Adam steps amplify that on elements whose "
            "gradient is near zero, e.g. a bias initialised to 0 (measured max |diff| / max |param| about 2e-4)")

LLAMA = dict(
    config_options=dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, num_query_groups=2,
                        add_bias_linear=False, qk_layernorm=True, layernorm_epsilon=1e-5),
    model_options=dict(position_embedding_type="rope", rotary_percent=1.0, rotary_base=10000),
    spec_options=dict(normalization="RMSNorm", qk_layernorm=True))
"""A LLaMA-style block on the matrix's model: RMSNorm, SwiGLU, RoPE, grouped-query attention (2 groups
for 4 heads), no linear biases, QK-layernorm (TinyGPT's option dicts; tests/training/test_model_flags.py uses it too)."""

_MOE = dict(
    config_options=dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_aux_loss_coeff=1e-2,
                        moe_router_load_balancing_type="aux_loss", moe_token_dispatcher_type="allgather",
                        add_bias_linear=False),
    moe_pattern=(1, 0, 1, 1))
"""megatron-core MoE: 4 SequentialMLP experts, top-2, aux loss 1e-2, allgather dispatcher; layer 1 dense."""

MLA = dict(
    config_options=dict(multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8,
                        qk_pos_emb_head_dim=4, v_head_dim=8, normalization="RMSNorm", qk_layernorm=True),
    model_options=dict(position_embedding_type="rope"),
    spec_options=dict(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm"))
"""megatron-core multi-latent attention (``MLATransformerConfig``, ``MLASelfAttention`` of the local spec): query
down/up projections (rank 16), key/value down/up projections (rank 8), 8 + 4 rotary QK channels and 8 V channels per
head, YaRN RoPE (megatron-core's default), RMSNorm with q/kv layernorms (TinyGPT's option dicts;
tests/training/test_model_flags.py uses it too)."""
_DEEPSEEK_MOE = dict(
    config_options=dict(_MOE["config_options"], moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-3,
                        moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True,
                        moe_router_score_function="sigmoid", moe_router_num_groups=2, moe_router_group_topk=1,
                        moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-2,
                        moe_router_topk_scaling_factor=2.5),
    moe_pattern=(0, 1, 1, 1))
"""DeepSeek's MoE on the matrix's model: the ``moe`` column's 4 experts, top-2, plus a gated shared expert
(hidden 32), a sigmoid router, group-limited top-k (2 groups of 2 experts, 1 group per token), the aux-loss-free
expert bias (update rate 1e-2: large enough to move iteration 2's routing on this model), a top-k scaling factor
2.5 and DeepSeek-V3's sequence-level aux loss; layer 0 dense (DeepSeek-V3's first dense layers)."""

_TIED_V = ("on the V the first and last stage share one rank, so one parameter serves as embedding and output "
           "layer and its gradient is one sum over both uses in another order than the unpipelined reference's "
           "(measured: only that gradient differs, 1.2e-7 relative; the parameters after the step 5e-8)")

_MTP_V = ("on the V the MTP layer is on rank 0 with the first stage and looks its tokens up in the same word-"
          "embedding parameter, whose gradient is then one sum over both lookups in another order than the "
          "unpipelined reference's (measured: only that gradient differs, 6.5e-8 relative); the losses and the "
          "first iteration's gradients within 1e-6; Adam's first step moves elements whose gradient is near zero "
          "by a visible part of lr, e.g. a bias initialised to 0 (measured in the parameters after the steps: "
          "4.0e-5 relative), so the later gradients and the parameters within 1e-4 -- Adam's doing, not the "
          "schedule's")

_VOCAB = ("the cross entropy's sum over the vocabulary is a sum of per-slice partial sums all-reduced over the "
          "ranks (another association order) and the output layer's GEMMs have other shapes, so the loss's last bits "
          "move and every gradient behind it: the loss of every iteration and the first iteration's gradients within "
          "5e-6 (tests/runtime/test_vocab_runtime.py's bound; measured on 0.16.1: 3.5e-7 at PP=2, 7.2e-7 at PP=4). "
          "Adam's first update is lr g / (|g| + eps): on an element whose gradient is about eps (measured at PP=2: "
          "-4.45e-9 against -3.87e-9, a difference of 3e-8 of the tensor's largest gradient; eps 1e-8) the update "
          "moves by 3% of lr, so the later gradients and the parameters after the steps are compared within 2e-2 "
          "(measured on 0.16.1: 7.0e-3 at PP=2, 1.5e-3 at PP=4, the same for every family) -- Adam's doing, not the "
          "schedule's")

FEATURES: list[Feature] = [
    Feature("fp32", "fp32, TP=1, DP=1"),
    Feature("bf16", "bf16 params (Float16Module), mixed-precision optimizer, grads reduced in fp32", precision="bf16"),
    Feature("fp16", "fp16, dynamic loss scale (hysteresis 1); iteration 2's loss x1e8 forces an overflow: "
                    "skipped step, scale halved", precision="fp16", iterations=3, loss_multipliers=(1.0, 1e8, 1.0)),
    Feature("tp2", "tensor parallel 2", tp=2),
    Feature("tp2-sp", "tensor parallel 2 with sequence parallelism", tp=2, sequence_parallel=True),
    Feature("dp2-ddp", "data parallel 2, megatron-core DDP", dp=2),
    Feature("dp2-distopt", "data parallel 2, distributed optimizer", dp=2, distributed_optimizer=True),
    Feature("wgrad-fusion", "gradient_accumulation_fusion (CPU fallback kernel) vs megatron-core's unfused path",
            grad_fusion=True),
    Feature("pv-exact", "optimizer post-validation, exact rollback; iteration 2's loss x50 forces a clip "
                        "(rollback and redo)", post_validation="exact", iterations=3, clip_grad=1.0,
            loss_multipliers=(1.0, 50.0, 1.0)),
    Feature("pv-inplace", "optimizer post-validation, in-place (algebraic) rollback; iteration 2's loss x50 "
                          "forces a clip", post_validation="in-place", iterations=3, loss_multipliers=(1.0, 50.0, 1.0),
            clip_grad=1.0, tolerance={p: Tolerance(1e-3, _INPLACE) for p in Placement}),
    Feature("per-token-loss", "calculate_per_token_loss (loss sums, gradients scaled by 1/total tokens)",
            per_token_loss=True),
    Feature("llama", "LLaMA-style layers: RMSNorm, SwiGLU, RoPE, grouped-query attention (2 groups for 4 heads), "
                     "no linear biases, QK-layernorm", tiny_gpt=LLAMA),
    Feature("recompute-full", "full activation recomputation (uniform, 1 layer per checkpoint): W deferred inside "
                              "recomputed layers, as many W computations as fp32's", same_w_as="fp32",
            tiny_gpt=dict(config_options=dict(recompute_granularity="full", recompute_method="uniform",
                                              recompute_num_layers=1))),
    Feature("recompute-selective", "selective recomputation of core_attn, mlp and layernorm, no linear biases "
                                   "(megatron-core 0.16.1's mlp recomputation recurses without end when the MLP "
                                   "returns its bias: its own 1F1B hangs too); as many W computations as "
                                   "fp32's", same_w_as="fp32",
            tiny_gpt=dict(config_options=dict(recompute_granularity="selective", add_bias_linear=False,
                                              recompute_modules=["core_attn", "mlp", "layernorm"]))),
    Feature("tied", "share_embeddings_and_output_weights (plain/interleaved: megatron-core's embedding group; "
                    "V: one parameter on one rank); one iteration: a second Adam step would amplify V's 1e-7 "
                    "difference in that gradient on elements whose gradient is near zero (measured 8e-5 relative "
                    "in the parameters after two steps) -- Adam's doing, not the schedule's",
            tiny_gpt=dict(model_options=dict(share_embeddings_and_output_weights=True)),
            tolerance={Placement.V: Tolerance(1e-6, _TIED_V)}, iterations=1),
    Feature("uneven-split", "6 layers split unevenly: plain 2+4 (first_stage_layers=2), interleaved 1+2+1+2 "
                            "(first rank 2), V 3+1+1+1 (first_stage_layers=3)", num_layers=6,
            split={Placement.PLAIN: dict(first_stage_layers=2), Placement.INTERLEAVED: dict(first_stage_layers=2),
                   Placement.V: dict(first_stage_layers=3)}),
    Feature("moe", "megatron-core MoE: 4 SequentialMLP experts, top-2, aux loss 1e-2, allgather dispatcher, "
                   "layer 1 dense; expert weights deferred to W by the linear route", num_layers=4, tiny_gpt=_MOE),
    Feature("mtp", "multi-token prediction (DeepSeek-V3's MTP): one MTP layer on the last stage (the last virtual "
                   "chunk; V: rank 0's second chunk, whose lookup uses the first stage's word-embedding parameter), "
                   "untied embeddings, RoPE; its linears deferred to W, the output layer's two uses in one W entry",
            tiny_gpt=dict(config_options=dict(mtp_num_layers=1), model_options=dict(position_embedding_type="rope")),
            tolerance={Placement.V: Tolerance(1e-6, _MTP_V, after_step=1e-4)}),
    Feature("mla", "multi-latent attention (DeepSeek-V2/V3): query and key/value down/up projections, YaRN RoPE, "
                   "q/kv RMSNorm layernorms; every projection's W deferred by the linear route (7 W's per layer "
                   "instead of 4)", tiny_gpt=MLA),
    Feature("deepseek-moe", "DeepSeek's MoE: a gated shared expert, sigmoid router with group-limited top-k (2 "
                            "groups, 1 per token), expert bias (updated once per iteration by finalize_model_grads, "
                            "after the last W; the biases compared with the parameters), top-k scaling factor 2.5, "
                            "sequence aux loss; layer 0 dense; the shared expert's linears deferred to W by the "
                            "linear route", num_layers=4, tiny_gpt=_DEEPSEEK_MOE),
    Feature("vocab-parallel", "vocabulary parallelism: each family's vocabulary form (<family>-vocab-1, two "
                              "barriers) with the word embedding and the output layer sliced over the pipeline "
                              "ranks, against megatron-core's schedule on the unsliced model; a family without a "
                              "vocabulary form is refused by name; as many W computations as fp32's less the "
                              "output layer's (its weight gradient runs in T, on the slices)",
            vocab_parallel=True, same_w_as="fp32", w_offset=-1,
            tolerance={p: Tolerance(5e-6, _VOCAB, after_step=2e-2) for p in Placement}),
]
"""The columns, in table order."""

FAMILIES: dict[Placement, list[str]] = {
    Placement.PLAIN: ["1f1b", "zb-h1", "zb-h2", "zb", "zb-1p", "zb-2p"],
    Placement.INTERLEAVED: ["interleaved-1f1b", "interleaved-zb"],
    Placement.V: ["zbv", "v-half", "v-min"],
}
"""The rows, grouped by placement (one launch per feature and placement)."""

REFERENCES: dict[Placement, str] = {
    Placement.PLAIN: "megatron-core forward_backward_pipelining_without_interleaving (same PP, TP, DP)",
    Placement.INTERLEAVED: "megatron-core forward_backward_pipelining_with_interleaving (same PP, 2 virtual "
                           "stages per rank, batch_p2p_comm=False)",
    Placement.V: "the unpipelined model: megatron-core forward_backward_no_pipelining (PP=1, same TP, DP)",
}
"""What each placement's cells are compared with."""


def feature(name: str) -> Feature:
    """The :class:`Feature` called ``name``; a clear error lists the known names."""
    for f in FEATURES:
        if f.name == name:
            return f
    raise ValueError(f"unknown feature {name!r}; choose from: {', '.join(f.name for f in FEATURES)}")


def placement_of(family: str) -> Placement:
    """The placement group of a family of :data:`FAMILIES`."""
    for placement, names in FAMILIES.items():
        if family in names:
            return placement
    raise ValueError(f"unknown schedule family {family!r}; choose from: "
                     f"{', '.join(n for names in FAMILIES.values() for n in names)}")

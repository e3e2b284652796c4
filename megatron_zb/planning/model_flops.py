"""Model FLOPs, written once: Megatron-LM's ``num_floating_point_operations`` (no torch).

The reference is ``num_floating_point_operations`` in Megatron-LM's ``megatron/training/training.py``
(tag core_v0.16.1), for the models megatron-zb builds: standard attention with optional
grouped-query attention or multi-latent attention (:class:`MLAShape`), GeLU or SwiGLU MLP, dense and
MoE layers (with shared experts), no multi-token prediction. Its users:

* ``--log-throughput`` (:mod:`megatron_zb.training.flops` maps the flags to a :class:`FlopsShape`);
* ``megatron-zb plan``: each family's ``model_tflops_per_gpu``, the number ``--log-throughput``
  would print for the predicted iteration time;
* not the planner's time model (:mod:`.flops`), which counts the FLOPs its kernels *execute*,
  kernel by kernel with their bytes: the same GEMMs as :func:`forward_flops_per_token`, and
  attention's two ``s x s`` products over every position -- an unfused kernel computes the masked
  half too -- where the model FLOPs count them at half (:data:`CAUSAL_FRACTION`).
  ``tests/planning/test_model_flops.py`` checks that the planner's per-layer ``F + B + W`` is exactly this
  module's count plus that half.

Per token, one GEMM's forward costs ``2`` FLOPs per multiply-add; training runs each GEMM three
times (forward, input gradient, weight gradient), hence the factor ``3`` of the total.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .model import PlanModel

__all__ = ["CAUSAL_FRACTION", "FlopsShape", "LayerFlops", "MLAShape", "forward_flops_per_token",
           "num_floating_point_operations",
           "planned_flops_shape", "tflops_per_gpu"]

CAUSAL_FRACTION = 0.5
"""Share of attention's ``Q K^T`` and ``P V`` products the model FLOPs count: Megatron-LM's
"causal mask (only half of the mask is non-zero)"."""


@dataclass(frozen=True)
class MLAShape:
    """Multi-latent attention's sizes (Megatron-LM's flag names; elements): ``q_lora_rank`` (``None``: one
    query projection), ``kv_lora_rank``, ``qk_head_dim``, ``qk_pos_emb_head_dim``, ``v_head_dim``."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class FlopsShape:
    """What the FLOPs of a GPT depend on (Megatron-LM's flag names; sizes in elements).

    Attributes:
        num_layers: transformer layers ``L``.
        hidden_size: ``h``.
        seq_length: ``s``, tokens per sample.
        num_attention_heads: ``a``.
        kv_channels: channels per head ``d`` (query width ``q = a d``).
        num_query_groups: key/value heads ``g`` (``a`` without grouped-query attention).
        ffn_hidden_size: dense MLP width.
        padded_vocab_size: output-layer rows ``V``.
        swiglu: gated MLP (two input projections).
        moe_layers: how many of the layers have an MoE MLP (0: dense model).
        moe_ffn_hidden_size: one expert's MLP width.
        moe_router_topk: experts each token is routed to.
        mla: multi-latent attention's sizes (``None``: standard attention; ``kv_channels`` and
            ``num_query_groups`` then count for nothing).
        moe_shared_expert_intermediate_size: the shared experts' total MLP width in each MoE layer (0: none).
    """

    num_layers: int
    hidden_size: int
    seq_length: int
    num_attention_heads: int
    kv_channels: int
    num_query_groups: int
    ffn_hidden_size: int
    padded_vocab_size: int
    swiglu: bool = False
    moe_layers: int = 0
    moe_ffn_hidden_size: int = 0
    moe_router_topk: int = 0
    mla: MLAShape | None = None
    moe_shared_expert_intermediate_size: int = 0


@dataclass(frozen=True)
class LayerFlops:
    """Forward FLOPs per token of each GEMM group (``2`` per multiply-add), attention unmasked.

    Attributes:
        qkv: query, key and value projections, ``2 h (q + 2 g d)`` (MLA: :func:`_mla_flops`).
        attention: ``Q K^T`` and ``P V`` over all ``s`` positions, ``2 * 2 s q`` (no causal mask).
        proj: attention output projection, ``2 q h``.
        mlp: one dense MLP, ``2 h ffn f`` (``f = 3`` with SwiGLU: two input GEMMs and one output;
            ``2`` otherwise).
        moe_mlp: one MoE MLP, ``2 h (moe_ffn topk + shared) f`` (the router's GEMM not counted, as
            Megatron-LM's).
        logits: output layer, ``2 h V``.
    """

    qkv: float
    attention: float
    proj: float
    mlp: float
    moe_mlp: float
    logits: float


def forward_flops_per_token(shape: FlopsShape) -> LayerFlops:
    """The forward FLOPs per token of each GEMM group of one layer (and of the output layer)."""
    h, s = shape.hidden_size, shape.seq_length
    q = shape.kv_channels * shape.num_attention_heads
    kv = shape.kv_channels * shape.num_query_groups
    f = 3 if shape.swiglu else 2
    qkv, attention, proj = (2 * h * (q + 2 * kv), 2 * 2 * s * q, 2 * q * h) if shape.mla is None else _mla_flops(shape)
    return LayerFlops(qkv=qkv, attention=attention, proj=proj,
                      mlp=2 * h * shape.ffn_hidden_size * f,
                      moe_mlp=2 * h * (shape.moe_ffn_hidden_size * shape.moe_router_topk
                                       + shape.moe_shared_expert_intermediate_size) * f,
                      logits=2 * h * shape.padded_vocab_size)


def _mla_flops(shape: FlopsShape) -> tuple[float, float, float]:
    """Multi-latent attention's forward FLOPs per token: (projections, attention unmasked, output projection),
    Megatron-LM's terms: the query's down/up pair ``q_lora (h + a d_qk + 1)`` (or ``h a d_qk``), the keys' and
    values' ``kv_lora (h + a (qk_head_dim + v_head_dim) + 1) + h qk_pos_emb_head_dim`` (the ``+ 1``: the
    norms), attention ``2 s a d_qk + 2 s a v_head_dim``, output ``2 a v_head_dim h``; ``d_qk = qk_head_dim +
    qk_pos_emb_head_dim``."""
    m, h, a, s = shape.mla, shape.hidden_size, shape.num_attention_heads, shape.seq_length
    assert m is not None
    d_qk = m.qk_head_dim + m.qk_pos_emb_head_dim
    q = h * a * d_qk if m.q_lora_rank is None else m.q_lora_rank * (h + a * d_qk + 1)
    kv = m.kv_lora_rank * (h + a * (m.qk_head_dim + m.v_head_dim) + 1) + h * m.qk_pos_emb_head_dim
    return 2 * (q + kv), 2 * s * a * d_qk + 2 * s * a * m.v_head_dim, 2 * a * m.v_head_dim * h


def num_floating_point_operations(shape: FlopsShape, batch_size: int) -> float:
    """Model FLOPs of one training iteration of ``batch_size`` sequences [FLOP] (Megatron-LM's).

    ``3 * batch_size * s * (L (qkv + attention / 2 + proj) + dense mlp + moe mlp + logits)``
    with the per-token forward terms of :func:`forward_flops_per_token`.
    """
    fl = forward_flops_per_token(shape)
    dense = shape.num_layers - shape.moe_layers
    per_token = (shape.num_layers * (fl.qkv + CAUSAL_FRACTION * fl.attention + fl.proj)
                 + dense * fl.mlp + shape.moe_layers * fl.moe_mlp + fl.logits)
    return 3 * batch_size * shape.seq_length * per_token


def planned_flops_shape(model: "PlanModel", tp: int) -> FlopsShape:
    """The :class:`FlopsShape` of a planned model (dense: the planner models no MoE) at TP ``tp``
    (the output layer's rows are padded per TP size)."""
    return FlopsShape(num_layers=model.num_layers, hidden_size=model.hidden_size, seq_length=model.seq_length,
                      num_attention_heads=model.num_attention_heads, kv_channels=model.kv_channels,
                      num_query_groups=model.num_query_groups, ffn_hidden_size=model.ffn_hidden_size,
                      padded_vocab_size=model.padded_vocab_size(tp), swiglu=model.swiglu)


def tflops_per_gpu(shape: FlopsShape, *, batch_size: int, seconds_per_iteration: float, num_gpus: int) -> float:
    """Megatron-LM's "throughput per GPU (TFLOP/s/GPU)": one global batch's model FLOPs over the
    iteration time and every GPU of the job [TFLOP/s per GPU]."""
    return num_floating_point_operations(shape, batch_size) / (seconds_per_iteration * 1e12 * num_gpus)

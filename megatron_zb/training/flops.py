"""Model FLOPs per iteration and the TFLOP/s per GPU of ``--log-throughput`` (Megatron-LM's formula).

:func:`num_floating_point_operations` is Megatron-LM's ``num_floating_point_operations`` of
``megatron/training/training.py`` (tag core_v0.16.1) for the models megatron-zb builds (standard
attention with optional grouped-query attention, GeLU or SwiGLU MLP, dense and MoE layers without
shared experts, no multi-token prediction), written out once here.
"""

from __future__ import annotations

import argparse

__all__ = ["num_floating_point_operations", "tflops_per_gpu"]


def num_floating_point_operations(args: argparse.Namespace, batch_size: int) -> float:
    """Floating-point operations of one training iteration of ``batch_size`` sequences [FLOP].

    Per token: every GEMM counts ``3`` (forward, input gradient, weight gradient) x ``2`` (a
    multiply-add is two operations) x its multiply-adds:

    * attention, per layer: ``h * (q + 2 * kv)`` (QKV projection, ``q = kv_channels * heads``,
      ``kv = kv_channels * query_groups``, groups = heads without ``--group-query-attention``)
      ``+ q * s`` (``QK^T`` and ``(QK^T)V`` over a causal half of the ``s`` positions)
      ``+ q * h`` (output projection);
    * MLP: ``h * ffn * f`` per dense layer and ``h * moe_ffn * topk * f`` per MoE layer, with
      ``f = 3`` for SwiGLU (two input GEMMs) and ``2`` otherwise;
    * logits: ``h * padded_vocab``.

    Uses ``args`` after validation (``kv_channels``, ``ffn_hidden_size``, ``padded_vocab_size``,
    ``moe_layer_pattern`` filled in).
    """
    h, s = args.hidden_size, args.seq_length
    # Architecture flags of the "network size" group (absent from older namespaces: Megatron's defaults).
    swiglu = getattr(args, "swiglu", False)
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else args.num_attention_heads
    pattern = args.moe_layer_pattern if getattr(args, "num_experts", None) is not None else None
    moe_layers = sum(pattern) if pattern is not None else 0
    dense_layers = args.num_layers - moe_layers
    topk = args.moe_router_topk if pattern is not None else 0
    moe_ffn = args.moe_ffn_hidden_size if pattern is not None else 0
    gemm = 3 * 2  # forward + two backward GEMMs, two FLOPs per multiply-add
    ffn_factor = 3 if swiglu else 2
    q = args.kv_channels * args.num_attention_heads
    kv = args.kv_channels * groups
    attention = gemm * (h * (q + 2 * kv) + q * s / 2 * 2 + q * h)
    mlp = gemm * h * (args.ffn_hidden_size * ffn_factor * dense_layers + moe_ffn * topk * ffn_factor * moe_layers)
    logits = gemm * h * args.padded_vocab_size
    return batch_size * s * (mlp + attention * args.num_layers + logits)


def tflops_per_gpu(args: argparse.Namespace, *, seconds_per_iteration: float) -> float:
    """Megatron's "throughput per GPU (TFLOP/s/GPU)": one global batch's FLOPs over the iteration
    time and every process of the job [TFLOP/s per process]."""
    flops = num_floating_point_operations(args, args.global_batch_size)
    return flops / (seconds_per_iteration * 1e12 * args.world_size)

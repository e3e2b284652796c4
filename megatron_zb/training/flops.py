"""Model FLOPs per iteration and the TFLOP/s per GPU of ``--log-throughput``.

The formula is written once, in :mod:`megatron_zb.planning.model_flops` (Megatron-LM's
``num_floating_point_operations``, causal attention counted at half); this module only maps the
validated flags to its :class:`~megatron_zb.planning.model_flops.FlopsShape`.
"""

from __future__ import annotations

import argparse

from megatron_zb.planning import model_flops
from megatron_zb.planning.model_flops import FlopsShape

__all__ = ["flops_shape", "num_floating_point_operations", "tflops_per_gpu"]


def flops_shape(args: argparse.Namespace) -> FlopsShape:
    """The :class:`FlopsShape` of the validated flags (``kv_channels``, ``ffn_hidden_size``,
    ``padded_vocab_size`` and ``moe_layer_pattern`` filled in; architecture flags absent from older
    namespaces take Megatron-LM's defaults)."""
    moe = getattr(args, "num_experts", None) is not None
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else args.num_attention_heads
    return FlopsShape(
        num_layers=args.num_layers, hidden_size=args.hidden_size, seq_length=args.seq_length,
        num_attention_heads=args.num_attention_heads, kv_channels=args.kv_channels, num_query_groups=groups,
        ffn_hidden_size=args.ffn_hidden_size, padded_vocab_size=args.padded_vocab_size,
        swiglu=getattr(args, "swiglu", False), moe_layers=sum(args.moe_layer_pattern) if moe else 0,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size if moe else 0, moe_router_topk=args.moe_router_topk if moe else 0)


def num_floating_point_operations(args: argparse.Namespace, batch_size: int) -> float:
    """Model FLOPs of one training iteration of ``batch_size`` sequences [FLOP]
    (:func:`megatron_zb.planning.model_flops.num_floating_point_operations`)."""
    return model_flops.num_floating_point_operations(flops_shape(args), batch_size)


def tflops_per_gpu(args: argparse.Namespace, *, seconds_per_iteration: float) -> float:
    """Megatron's "throughput per GPU (TFLOP/s/GPU)": one global batch's FLOPs over the iteration
    time and every process of the job [TFLOP/s per process]."""
    return model_flops.tflops_per_gpu(flops_shape(args), batch_size=args.global_batch_size,
                                      seconds_per_iteration=seconds_per_iteration, num_gpus=args.world_size)

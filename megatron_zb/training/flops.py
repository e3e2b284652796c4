"""Model FLOPs per iteration and the TFLOP/s per GPU of ``--log-throughput``.

The formula is written once, in :mod:`megatron_zb.planning.model_flops` (Megatron-LM's
``num_floating_point_operations``, causal attention counted at half); this module only maps the
run's :class:`~megatron_zb.training.run_config.ModelConfig` to its
:class:`~megatron_zb.planning.model_flops.FlopsShape`.
"""

from __future__ import annotations

from megatron_zb.planning import model_flops
from megatron_zb.planning.model_flops import FlopsShape, MLAShape
from megatron_zb.training.run_config import ModelConfig

__all__ = ["flops_shape", "num_floating_point_operations", "tflops_per_gpu"]


def flops_shape(model: ModelConfig) -> FlopsShape:
    """The :class:`FlopsShape` of the run's model (query groups: one per head without GQA)."""
    moe, mla = model.moe, model.mla
    return FlopsShape(
        num_layers=model.num_layers, hidden_size=model.hidden_size, seq_length=model.seq_length,
        num_attention_heads=model.num_attention_heads, kv_channels=model.kv_channels,
        num_query_groups=model.num_query_groups or model.num_attention_heads,
        ffn_hidden_size=model.ffn_hidden_size, padded_vocab_size=model.padded_vocab_size, swiglu=model.swiglu,
        moe_layers=sum(moe.moe_layer_pattern) if moe else 0, moe_ffn_hidden_size=moe.moe_ffn_hidden_size if moe else 0,
        moe_router_topk=moe.moe_router_topk if moe else 0,
        moe_shared_expert_intermediate_size=(moe.moe_shared_expert_intermediate_size or 0) if moe else 0,
        mla=MLAShape(mla.q_lora_rank, mla.kv_lora_rank, mla.qk_head_dim, mla.qk_pos_emb_head_dim, mla.v_head_dim)
        if mla else None)


def num_floating_point_operations(model: ModelConfig, batch_size: int) -> float:
    """Model FLOPs of one training iteration of ``batch_size`` sequences [FLOP]
    (:func:`megatron_zb.planning.model_flops.num_floating_point_operations`)."""
    return model_flops.num_floating_point_operations(flops_shape(model), batch_size)


def tflops_per_gpu(model: ModelConfig, *, global_batch_size: int, world_size: int,
                   seconds_per_iteration: float) -> float:
    """Megatron's "throughput per GPU (TFLOP/s/GPU)": one global batch's FLOPs [sequences] over the
    iteration time [s] and every process of the job [TFLOP/s per process]."""
    return model_flops.tflops_per_gpu(flops_shape(model), batch_size=global_batch_size,
                                      seconds_per_iteration=seconds_per_iteration, num_gpus=world_size)

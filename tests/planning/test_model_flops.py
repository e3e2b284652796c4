"""The one FLOPs formula (megatron_zb/planning/model_flops.py, Megatron-LM's
``num_floating_point_operations``) against numbers worked by hand, and its three users agreeing:
``--log-throughput`` (training/flops.py), ``megatron-zb plan`` and the planner's kernel model."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_zb.planning.flops import layer_cost
from megatron_zb.planning.hardware import resolve_hardware
from megatron_zb.planning.model import make_model, make_parallel
from megatron_zb.planning.model_flops import (CAUSAL_FRACTION, FlopsShape, MLAShape, forward_flops_per_token,
                                              num_floating_point_operations, planned_flops_shape)
from megatron_zb.planning.planner import plan
from megatron_zb.training import flops as training_flops
from megatron_zb.training.run_config import MLAConfig, ModelConfig, MoEConfig

# LLaMA-3-8B's shape: 32 layers, h 4096, 32 heads of 128 channels, 8 query groups, SwiGLU MLP of
# 14336, vocabulary 128256 (a multiple of 128: no padding), sequence 8192.
LLAMA = FlopsShape(num_layers=32, hidden_size=4096, seq_length=8192, num_attention_heads=32, kv_channels=128,
                   num_query_groups=8, ffn_hidden_size=14336, padded_vocab_size=128256, swiglu=True)
# By hand, per token, forward (2 FLOPs per multiply-add); q = 32 * 128 = 4096, kv = 8 * 128 = 1024:
#   QKV        2 * 4096 * (4096 + 2 * 1024)      =    50,331,648
#   attention  2 * 2 * 8192 * 4096 / 2 (causal)  =    67,108,864
#   proj       2 * 4096 * 4096                   =    33,554,432
#   MLP        2 * 4096 * 14336 * 3 (SwiGLU)     =   352,321,536
#   layer      50,331,648 + 67,108,864 + 33,554,432 + 352,321,536 = 503,316,480
#   logits     2 * 4096 * 128256                 = 1,050,673,152
#   token      32 * 503,316,480 + 1,050,673,152  = 17,156,800,512
#   iteration, one sequence: 3 (F, dgrad, wgrad) * 8192 * 17,156,800,512 = 421,645,529,382,912
LLAMA_FLOPS_PER_SEQUENCE = 421_645_529_382_912

# Mixtral-8x7B's shape: 32 layers, all MoE (8 experts, top-2) with SwiGLU experts of 14336,
# h 4096, 32 heads of 128, 8 query groups, vocabulary 32000, sequence 4096.
MIXTRAL = FlopsShape(num_layers=32, hidden_size=4096, seq_length=4096, num_attention_heads=32, kv_channels=128,
                     num_query_groups=8, ffn_hidden_size=14336, padded_vocab_size=32000, swiglu=True,
                     moe_layers=32, moe_ffn_hidden_size=14336, moe_router_topk=2)
# By hand, per token, forward:
#   QKV        2 * 4096 * (4096 + 2 * 1024)        =  50,331,648
#   attention  2 * 2 * 4096 * 4096 / 2 (causal)    =  33,554,432
#   proj       2 * 4096 * 4096                     =  33,554,432
#   MoE MLP    2 * 4096 * 14336 * 2 (top-2) * 3    = 704,643,072
#   layer      822,083,584;  logits 2 * 4096 * 32000 = 262,144,000
#   token      32 * 822,083,584 + 262,144,000      = 26,568,818,688
#   iteration, one sequence: 3 * 4096 * 26,568,818,688 = 326,477,644,038,144
MIXTRAL_FLOPS_PER_SEQUENCE = 326_477_644_038_144


# Multi-latent attention (issue 41): 2 layers, h 1024, 8 heads, query rank 256, key/value rank 128, QK channels
# 64 + 32 rotary, V channels 64, GeLU MLP of 4096, vocabulary 1024, sequence 512. Per token, forward:
#   q down/up  2 * 256 * (1024 + 8 * 96 + 1)                     =    918,016
#   kv         2 * (128 * (1024 + 8 * (64 + 64) + 1) + 1024 * 32) =    590,080
#   attention  (2 * 512 * 8 * 96 + 2 * 512 * 8 * 64) / 2 (causal) =    655,360
#   proj       2 * 8 * 64 * 1024                                  =  1,048,576
#   MLP        2 * 1024 * 4096 * 2                                = 16,777,216
#   layer      19,989,248;  logits 2 * 1024 * 1024 = 2,097,152
#   token      2 * 19,989,248 + 2,097,152                         = 42,075,648
#   iteration, one sequence: 3 * 512 * 42,075,648 = 64,628,195,328
# (Megatron-LM's own per-layer attention term, 6 * (q_term + kv_term + h * 32 + 8 * 64 * h + s * 8 * 96 / 2
# + s * 8 * 64 / 2), is the same 3 * (q down/up + kv + attention + proj).)
MLA = FlopsShape(num_layers=2, hidden_size=1024, seq_length=512, num_attention_heads=8, kv_channels=128,
                 num_query_groups=8, ffn_hidden_size=4096, padded_vocab_size=1024,
                 mla=MLAShape(q_lora_rank=256, kv_lora_rank=128, qk_head_dim=64, qk_pos_emb_head_dim=32, v_head_dim=64))
MLA_FLOPS_PER_SEQUENCE = 64_628_195_328


def test_mla_shape_worked_by_hand():
    assert num_floating_point_operations(MLA, 1) == MLA_FLOPS_PER_SEQUENCE
    config = ModelConfig(num_layers=2, hidden_size=1024, seq_length=512, num_attention_heads=8, kv_channels=128,
                         ffn_hidden_size=4096, padded_vocab_size=1024, max_position_embeddings=512,
                         mla=MLAConfig(q_lora_rank=256, kv_lora_rank=128, qk_head_dim=64, qk_pos_emb_head_dim=32,
                                       v_head_dim=64))
    assert training_flops.num_floating_point_operations(config, 1) == MLA_FLOPS_PER_SEQUENCE


def test_llama_and_moe_shapes_worked_by_hand():
    assert num_floating_point_operations(LLAMA, 1) == LLAMA_FLOPS_PER_SEQUENCE
    assert num_floating_point_operations(LLAMA, 16) == 16 * LLAMA_FLOPS_PER_SEQUENCE
    assert num_floating_point_operations(MIXTRAL, 1) == MIXTRAL_FLOPS_PER_SEQUENCE


def _args(shape: FlopsShape, moe: bool) -> ModelConfig:
    """The run's model section of ``shape``, as pretrain_gpt_zb.py's RunConfig holds it."""
    return ModelConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, seq_length=shape.seq_length,
        num_attention_heads=shape.num_attention_heads, kv_channels=shape.kv_channels,
        num_query_groups=shape.num_query_groups, ffn_hidden_size=shape.ffn_hidden_size, swiglu=shape.swiglu,
        padded_vocab_size=shape.padded_vocab_size, max_position_embeddings=shape.seq_length,
        moe=MoEConfig(num_experts=8, moe_layer_pattern=(1,) * shape.num_layers, moe_router_topk=2,
                      moe_ffn_hidden_size=14336) if moe else None)


def test_shared_experts_count_as_megatron_lm_counts_them():
    """Mixtral's shape with one shared expert of 14336 per MoE layer (Megatron-LM's
    ``shared_expert_ffn_hidden_size * ffn_expansion_factor * num_moe_layers``): per token and layer
    2 * 4096 * 14336 * 3 = 352,321,536 more, so 3 * 4096 * 32 * 352,321,536 = 138,538,465,099,776 more per
    sequence; --log-throughput reads the size from the run's MoE section."""
    shared = replace(MIXTRAL, moe_shared_expert_intermediate_size=14336)
    assert num_floating_point_operations(shared, 1) == MIXTRAL_FLOPS_PER_SEQUENCE + 138_538_465_099_776
    model = _args(MIXTRAL, True)
    model = replace(model, moe=replace(model.moe, moe_shared_expert_intermediate_size=14336))
    assert training_flops.num_floating_point_operations(model, 1) == num_floating_point_operations(shared, 1)


def test_log_throughput_uses_the_same_formula():
    assert training_flops.num_floating_point_operations(_args(LLAMA, False), 1) == LLAMA_FLOPS_PER_SEQUENCE
    assert training_flops.num_floating_point_operations(_args(MIXTRAL, True), 1) == MIXTRAL_FLOPS_PER_SEQUENCE
    # 64 sequences in 2 s on 32 GPUs
    got = training_flops.tflops_per_gpu(_args(LLAMA, False), global_batch_size=64, world_size=32,
                                        seconds_per_iteration=2.0)
    assert got == pytest.approx(64 * LLAMA_FLOPS_PER_SEQUENCE / (2.0 * 1e12 * 32), rel=1e-12)


def _llama_model(**kw):
    return make_model(num_layers=32, hidden_size=4096, num_attention_heads=32, seq_length=8192, micro_batch_size=1,
                      vocab_size=128256, ffn_hidden_size=14336, num_query_groups=8, group_query_attention=True,
                      swiglu=True, **kw)


def test_plan_reports_the_same_formula():
    model = _llama_model(precision="bf16")
    assert num_floating_point_operations(planned_flops_shape(model, tp=1), 1) == LLAMA_FLOPS_PER_SEQUENCE
    par = make_parallel(model, pp=4, tp=1, dp=2, num_microbatches=8)
    fam = plan(model=model, parallel=par, hardware=resolve_hardware(gpu="H100"), schedules=["1f1b"]).families[0]
    # a global batch of 8 microbatches x 1 sequence x DP 2, over the planned iteration and 8 GPUs
    want = 16 * LLAMA_FLOPS_PER_SEQUENCE / (fam.iteration_time_ms / 1000 * 1e12 * 8)
    assert fam.model_tflops_per_gpu == pytest.approx(want, rel=1e-12)


def test_the_planner_executes_the_model_flops_plus_the_masked_half_of_attention():
    """A layer's F + B + W in the planner's kernel model is 3 x the model's forward FLOPs with the
    two attention products over every position (the kernels compute the masked half too)."""
    model = _llama_model(precision="bf16")
    par = make_parallel(model, pp=4, num_microbatches=8)
    cost = layer_cost(model, par, resolve_hardware(gpu="H100"))
    executed = cost["F"].flops + cost["B"].flops + cost["W"].flops
    one_layer = replace(LLAMA, num_layers=1, padded_vocab_size=0)   # no output layer
    tokens = model.seq_length * model.micro_batch_size
    masked = 3 * tokens * (1 - CAUSAL_FRACTION) * forward_flops_per_token(LLAMA).attention
    assert executed == num_floating_point_operations(one_layer, model.micro_batch_size) + masked
    # by hand: 3 * 8192 * (503,316,480 + 67,108,864) tokens x FLOPs per layer
    assert executed == 3 * 8192 * (503_316_480 + 67_108_864)

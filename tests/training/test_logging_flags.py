"""--log-throughput (Megatron-LM's FLOPs formula), --log-timers-to-tensorboard, --wandb-*."""

from __future__ import annotations

import importlib.util
import shlex

import pytest

from megatron_zb.training.arguments import ArgumentError, parse_args, validate_args
from megatron_zb.training.flops import num_floating_point_operations, tflops_per_gpu
from megatron_zb.training.run_config import ModelConfig, MoEConfig, run_config
from megatron_zb.training.logging_utils import format_iteration_line, parse_iteration_line
from megatron_zb.training.pretrain import parse_command_line
from megatron_zb.training.training_log import IterationRecord, TrainingLog

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--train-iters 2 --lr 1e-4 --mock-data")


def moe_gqa_swiglu_args() -> ModelConfig:
    """2 layers (MoE, dense), h=64, s=32, 4 heads of 16 channels in 2 query groups, SwiGLU."""
    return ModelConfig(
        hidden_size=64, seq_length=32, num_layers=2, num_attention_heads=4, kv_channels=16, num_query_groups=2,
        swiglu=True, ffn_hidden_size=128, padded_vocab_size=256, max_position_embeddings=32,
        moe=MoEConfig(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=96, moe_layer_pattern=(1, 0)))


def test_flops_formula_against_a_hand_computed_value():
    # Per token, 6 = 3 GEMMs (F, B-input, W) x 2 FLOPs per multiply-add; q = 16*4 = 64, kv = 16*2 = 32:
    #   attention/layer = 6 * (64*(64 + 2*32) + 64*32 + 64*64) = 6 * 14336 = 86016
    #   MLP = 6 * 64 * (128*3 [dense SwiGLU] + 96*2*3 [MoE: top-2 experts, SwiGLU]) = 384 * 960 = 368640
    #   logits = 6 * 64 * 256 = 98304
    #   token = 368640 + 2 * 86016 + 98304 = 638976; batch 8 x 32 tokens -> 163577856 FLOP
    args = moe_gqa_swiglu_args()
    assert num_floating_point_operations(args, 8) == 163577856
    assert tflops_per_gpu(args, global_batch_size=8, world_size=4, seconds_per_iteration=0.5) == \
        pytest.approx(163577856 / (0.5e12 * 4), rel=1e-12)


def test_flops_dense_mha_gelu_matches_the_classic_72_bsl_h2_form():
    # Megatron's paper formula (Narayanan et al. 2021) for GPT with ffn = 4h, no GQA, GeLU, causal
    # attention counted at half: 72 B s L h^2 (1 + s/(12 h) ... ) reduces to
    # B s [L (72 h^2 + 6 h s) + 6 h V]  when the attention term is halved (core attention 6*q*s).
    h, s, L, V, B = 96, 48, 3, 512, 4
    args = ModelConfig(hidden_size=h, seq_length=s, num_layers=L, num_attention_heads=6, kv_channels=16,
                       ffn_hidden_size=4 * h, padded_vocab_size=V, max_position_embeddings=s)
    assert num_floating_point_operations(args, B) == B * s * (L * (72 * h * h + 6 * h * s) + 6 * h * V)


def test_iteration_line_shows_tflops_per_gpu():
    line = format_iteration_line(iteration=3, train_iters=10, consumed_samples=24, elapsed_ms=500.0,
                                 learning_rate=1e-3, global_batch_size=8, losses={"lm loss": 5.0}, loss_scale=1.0,
                                 tflops_per_gpu=12.34)
    assert " throughput per GPU (TFLOP/s/GPU): 12.3 |" in line
    assert parse_iteration_line(line)["lm loss"] == 5.0


class RecordingWriter:
    """Stands in for TensorBoard's writer (the tensorboard package is not installed on the test machine)."""

    enabled = True

    def __init__(self) -> None:
        self.scalars: list[tuple[dict, int]] = []

    def add_scalars(self, values, step):
        self.scalars.append((dict(values), step))

    def flush(self):
        pass


def test_timers_go_to_tensorboard_only_with_the_flag():
    for flag in (False, True):
        argv = shlex.split(BASE + (" --log-timers-to-tensorboard" if flag else ""))
        tb = RecordingWriter()
        log = TrainingLog(run_config(parse_command_line(argv, world_size=1).args), stage_to_rank=[0], dist_ctx=None,
                          tensorboard=tb)
        log.records = [IterationRecord(iteration=i, loss=None, skipped=False, grad_norm=1.0, lr=1e-3, loss_scale=1.0,
                                       timers={"forward-backward": 0.1 * i, "optimizer": 0.01})
                       for i in (1, 2)]
        log.tensorboard_interval(log.records[-1], [5.0], 0.2, None)
        [(scalars, step)] = tb.scalars
        assert step == 2 and scalars["lm loss"] == 5.0
        if flag:
            assert scalars["forward-backward-time"] == pytest.approx(0.15) and scalars["optimizer-time"] == 0.01
        else:
            assert "forward-backward-time" not in scalars


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_wandb_without_the_package_is_a_flag_error():
    with pytest.raises(ArgumentError) as e:
        validate_args(parse_args(shlex.split(BASE + " --wandb-project p")), world_size=1)
    assert e.value.flag == "--wandb-project" and "pip install wandb" in str(e.value)


def test_wandb_exp_name_needs_a_project():
    with pytest.raises(ArgumentError) as e:
        validate_args(parse_args(shlex.split(BASE + " --wandb-exp-name run1")), world_size=1)
    assert e.value.flag == "--wandb-exp-name"

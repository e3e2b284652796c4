"""Harmless Megatron-LM flags accepted with Megatron-LM's meaning (argument level: nothing trains).

``--use-cpu-initialization``, ``--expert-tensor-parallel-size`` (TP's value), ``--logging-level``,
``--enable-experimental``, ``--dist-ckpt-strictness``, ``--auto-detect-ckpt-format``,
``--log-validation-ppl-to-tensorboard``, ``--moe-router-dtype`` and
``--no-check-for-nan-in-loss-and-grad``: each reaches its field of the run configuration (or says
why it changes nothing), and what cannot be honoured is refused by name.
"""

from __future__ import annotations

import logging
import shlex

import pytest

from megatron_zb.training import pretrain
from megatron_zb.training.arguments import ArgumentError
from megatron_zb.training.logging_utils import set_logging_level
from megatron_zb.training.run_config import run_config

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--train-iters 2 --lr 1e-4 --mock-data")
MOE = "--num-experts 2 --disable-bias-linear"


def validate(extra: str, world_size: int = 1):
    return pretrain.parse_command_line(shlex.split(BASE + " " + extra), world_size=world_size)


def test_every_flag_of_the_list_is_accepted_together():
    validated = validate("--use-cpu-initialization --expert-tensor-parallel-size 1 --logging-level 10 "
                         "--enable-experimental --dist-ckpt-strictness log_all --auto-detect-ckpt-format "
                         f"--log-validation-ppl-to-tensorboard --moe-router-dtype fp32 {MOE} "
                         "--no-check-for-nan-in-loss-and-grad")
    config = run_config(validated.args)
    assert config.logging.logging_level == 10
    assert config.model.enable_experimental is True
    assert config.checkpoint.dist_ckpt_strictness == "log_all"
    assert validated.args.expert_tensor_parallel_size == 1
    assert validated.args.check_for_nan_in_loss_and_grad is False
    assert config.model.moe.transformer_config_kwargs(expert_model_parallel_size=1)["moe_router_dtype"] == "fp32"
    assert ("WARNING: --auto-detect-ckpt-format has no effect: megatron-zb always detects the format of --load; it "
            "reads torch_dist checkpoints and refuses Megatron-LM's torch format by name, with the conversion to "
            "run") in validated.notices


def test_defaults_are_megatron_lm_s():
    validated = validate(MOE)
    config = run_config(validated.args)
    assert config.logging.logging_level is None and config.model.enable_experimental is False
    assert config.checkpoint.dist_ckpt_strictness == "assume_ok_unexpected"
    assert config.model.moe.moe_router_dtype is None
    assert validated.args.expert_tensor_parallel_size == 1  # TP's, as Megatron-LM derives it
    assert not any("auto-detect" in n for n in validated.notices)


def test_expert_tensor_parallel_size_other_than_tp_is_refused_by_name():
    with pytest.raises(ArgumentError) as e:
        validate("--tensor-model-parallel-size 2 --expert-tensor-parallel-size 1", world_size=2)
    assert str(e.value) == ("--expert-tensor-parallel-size: 1 is not supported: megatron-zb splits the experts over "
                            "the tensor-parallel ranks like the dense layers; give --tensor-model-parallel-size's 2 "
                            "or drop the flag")
    assert validate("--tensor-model-parallel-size 2 --expert-tensor-parallel-size 2",
                    world_size=2).args.expert_tensor_parallel_size == 2


def test_dist_ckpt_strictness_return_modes_are_refused_in_the_report():
    with pytest.raises(ArgumentError) as e:
        validate("--dist-ckpt-strictness return_all")
    assert str(e.value) == ("--dist-ckpt-strictness: invalid choice 'return_all'; choose from assume_ok_unexpected, "
                            "log_unexpected, log_all, raise_unexpected, raise_all, ignore_all")


def test_logging_level_sets_the_root_logger_as_megatron_lm(monkeypatch):
    root = logging.getLogger()
    monkeypatch.setattr(root, "level", root.level)  # restored after the test
    monkeypatch.delenv("MEGATRON_LOGGING_LEVEL", raising=False)
    root.setLevel(25)
    set_logging_level(None)  # neither the flag nor the environment: unchanged
    assert root.level == 25
    set_logging_level(40)
    assert root.level == 40
    monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", "30")
    set_logging_level(None)
    assert root.level == 30
    set_logging_level(10)  # the flag wins over the environment
    assert root.level == 10

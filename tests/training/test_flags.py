"""Unknown flags: a Megatron-LM flag megatron-zb does not support yet, and typos (closest flag)."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_zb.training.arguments import ArgumentError, build_parser, parse_args
from megatron_zb.training.arguments.megatron_flags import MEGATRON_LM_FLAGS

REPO = Path(__file__).resolve().parents[2]
BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--train-iters 2 --lr 1e-4 --mock-data")


def error_for(extra: str) -> ArgumentError:
    with pytest.raises(ArgumentError) as e:
        parse_args(shlex.split(BASE + " " + extra))
    return e.value


@pytest.mark.parametrize("extra,flag", [("--use-torch-fsdp2", "--use-torch-fsdp2"),
                                        ("--log-straggler", "--log-straggler"),
                                        ("--mtp-standalone", "--mtp-standalone")])
def test_megatron_lm_flag_not_supported_yet(extra, flag):
    err = error_for(extra)
    assert err.flag == flag
    assert str(err).startswith(f"{flag} is a Megatron-LM flag megatron-zb does not support yet")


def test_delay_wgrad_compute_is_refused_with_its_reason():
    """Megatron-LM's --delay-wgrad-compute also sets megatron-core DDP's delay_wgrad_compute,
    which the Transformer Engine route cannot follow (docs/transformer_engine.md)."""
    err = error_for("--delay-wgrad-compute")
    assert err.flag == "--delay-wgrad-compute"
    assert str(err).startswith("--delay-wgrad-compute is refused: megatron-zb defers Transformer Engine's weight "
                               "gradients itself")
    assert str(err).endswith("; remove it") and "\n" not in str(err)


def test_megatron_fsdp_is_refused_with_its_reason():
    """The reason Megatron-LM's loop gives too (megatron_zb.megatron_lm.refused_with_a_schedule)."""
    err = error_for("--use-megatron-fsdp")
    assert err.flag == "--use-megatron-fsdp"
    assert str(err).startswith("--use-megatron-fsdp is refused: megatron-core's Megatron FSDP reduce-scatters the "
                               "gradients from a hook that fires when the fused backward ends, before a deferred W "
                               "has added its weight gradients")
    assert str(err).endswith("; remove it") and "\n" not in str(err)


@pytest.mark.parametrize("typo,closest", [("--hiden-size", "--hidden-size"), ("--num-layer", "--num-layers"),
                                          ("--enable-zerobubble", "--enable-zero-bubble"),
                                          ("--num-expert", "--num-experts")])
def test_typo_names_the_closest_supported_flag(typo, closest):
    err = error_for(typo + " 3")
    assert err.flag == typo
    assert str(err) == f"{typo} is not a flag of pretrain_gpt_zb.py; did you mean {closest}?"


def test_unknown_flag_far_from_every_flag_points_to_help():
    assert str(error_for("--qqqqzzzz")).endswith("see pretrain_gpt_zb.py --help for the supported flags")


def test_megatron_lm_flag_list_is_megatron_lm_s():
    """Spot checks against Megatron-LM core_v0.16.1's arguments.py (read by hand)."""
    assert len(MEGATRON_LM_FLAGS) > 600
    for name in ("--context-parallel-size", "--num-experts", "--moe-router-topk", "--log-throughput",
                 "--wandb-project", "--vocab-file", "--recompute-granularity", "--use-distributed-optimizer"):
        assert name in MEGATRON_LM_FLAGS
    assert "--enable-zero-bubble" not in MEGATRON_LM_FLAGS  # megatron-zb's own flag
    ours = {o for a in build_parser()._actions for o in a.option_strings if o.startswith("--")}
    assert {"--num-experts", "--log-throughput", "--wandb-project", "--train-data-path"} <= ours


@pytest.mark.parametrize("extra,message", [
    ("--use-torch-fsdp2", "--use-torch-fsdp2 is a Megatron-LM flag megatron-zb does not support yet"),
    ("--hiden-size 3", "--hiden-size is not a flag of pretrain_gpt_zb.py; did you mean --hidden-size?")])
def test_pretrain_script_exits_2_with_one_line_before_any_process_group(tmp_path, extra, message):
    proc = subprocess.run([sys.executable, str(REPO / "pretrain_gpt_zb.py"), *shlex.split(BASE + " " + extra)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("pretrain_gpt_zb.py: error:")]
    assert len(errors) == 1 and message in errors[0]
    assert "initializing torch distributed" not in proc.stdout + proc.stderr


def test_invalid_choices_join_the_report_with_the_other_problems():
    """A value outside a flag's choices does not stop argparse first: it is one line of the one report
    (pretrain_gpt_zb.py prints it and exits 2, test_pretrain_script_exits_2_...), with the unknown flags
    and the failing checks (the flag left at its default for the checks)."""
    from megatron_zb.training import pretrain

    extra = ("--moe-token-dispatcher-type flex --cpu-offload --timing-log-level 3 --num-layers 3 "
             "--pipeline-model-parallel-size 2")
    with pytest.raises(ArgumentError) as e:
        pretrain.parse_command_line(shlex.split(BASE + " " + extra), world_size=2)
    assert [p.flag for p in e.value.problems] == ["--cpu-offload", "--moe-token-dispatcher-type",
                                                  "--timing-log-level", "--num-layers"]
    text = str(e.value)
    assert text.startswith("4 problems with the command line (each names the flag and the fix):\n")
    assert "\n  --moe-token-dispatcher-type: invalid choice 'flex'; choose from allgather, alltoall\n" in text
    assert "\n  --timing-log-level: invalid choice 3; choose from 0, 1, 2\n" in text
    assert "\n  --num-layers: 3 layers cannot be split evenly over 2 pipeline stages" in text

"""Public launch scripts run with pretrain_gpt_zb.py: NVIDIA's LLaMA-3 8B, Mixtral 8x7B and GPT-3 175B
examples and the zero-bubble fork's pretrain_zero_bubble.sh, scaled to CPU
(:mod:`harness.megatron_lm_examples`: sizes, iteration counts and paths changed, CPU-only
flags dropped with their reason, every other flag verbatim).

Each script trains with ``--use-megatron-core-schedule`` (the reference), ``--enable-zero-bubble``
(bitwise the same loss, grad norm and loss scale every iteration) and ``--zero-bubble-v-schedule``
(Mixtral's V: see :data:`SCRIPTS`).
The V placement puts the last stage's layers on rank 0, where the dropout streams are another
rank's, so V is compared within 1e-5 relative on the scripts without dropout (LLaMA-3, Mixtral:
hidden and attention dropout 0; the difference is the tied-gradient summation order and the
placement's other reduction order); on the scripts with Megatron-LM's default dropout 0.1 (GPT-3,
the fork; both fp16) V's losses are finite and its loss scaler decides as the reference's (the same
skipped iterations and loss scales).
The LLaMA-3 FP8 variant is refused on CPU with one message naming its four FP8 flags. With
megatron-core 0.19 (no batch-size ramp-up calculator) the GPT-3 script, which ramps its batch, is
refused up front naming ``--rampup-batch-size`` and the version instead of trained.
"""

from __future__ import annotations

import math

import pytest

from harness.megatron_lm_examples import (GPT3_175B, LLAMA3_8B, LLAMA3_8B_FP8, MIXTRAL_8X7B, ZB_FORK,
                                                      ZB_FORK_ZERO_BUBBLE)
from megatron_zb.megatron_compat import rampup_calculator
from harness.trainer_run import in_process

SCRIPTS = {"llama3_8b": (LLAMA3_8B, True), "mixtral_8x7b": (MIXTRAL_8X7B, None), "gpt3_175b": (GPT3_175B, False),
           "zb_fork": (ZB_FORK, False)}
"""name -> (script, whether it trains without dropout; ``None``: no V run here -- Mixtral's 4-process V
run would add ~80 s to CI, and V with MoE and expert parallelism 2 at PP=2 is compared with
megatron-core in tests/training/test_moe.py's ``pp2_ep2-zbv`` case)."""


def _curve(run: dict) -> list[tuple[int, float, float | None, float, bool]]:
    return [(r["iteration"], r["lm loss"], r["grad norm"], r["loss scale"], r["skipped"])
            for r in run["values"]["train"]]


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_launch_script_trains_with_every_schedule_family(tmp_path, name):
    script, no_dropout = SCRIPTS[name]
    if "--rampup-batch-size" in script.argv(tmp_path / "mcore", pretrain=True) and rampup_calculator() is None:
        _assert_ramp_refused(script, tmp_path)  # megatron-core 0.19: GPT-3's published ramp
        return

    def run(label: str, flags: list[str]) -> list:
        """The script with ``flags`` added; its own folder (the scripts --save and --load one path)."""
        return _curve(in_process(tmp_path, label, script.world_size, script.argv(tmp_path / label, pretrain=True) + flags))

    ref = run("mcore", ["--use-megatron-core-schedule"])
    assert len(ref) >= 4 and all(math.isfinite(loss) for _, loss, *_ in ref), ref
    got = run("zb", list(ZB_FORK_ZERO_BUBBLE) if script is ZB_FORK else ["--enable-zero-bubble"])
    assert got == ref, f"{name}: zero bubble {got} != megatron-core {ref}"
    if no_dropout is None:
        return
    v = run("zbv", ["--zero-bubble-v-schedule"])
    assert [i for i, *_ in v] == [i for i, *_ in ref]
    if no_dropout:
        for (i, loss, *_), (_, want, *_) in zip(v, ref):
            assert loss == pytest.approx(want, rel=1e-5), f"{name} V iteration {i}: {loss} vs {want}"
    else:  # fp16 scripts: the loss scaler's decisions (skipped iterations, scale) are the reference's
        assert all(math.isfinite(loss) for _, loss, *_ in v), v
        assert [(i, scale, skipped) for i, _, _, scale, skipped in v] == \
            [(i, scale, skipped) for i, _, _, scale, skipped in ref], (v, ref)


def _assert_ramp_refused(script, tmp_path) -> None:
    """A script with ``--rampup-batch-size`` on a megatron-core without the ramp-up calculator (0.19):
    refused up front in one problem naming the flag and the installed version."""
    from megatron_zb.megatron_compat import megatron_core_version
    from megatron_zb.training.arguments import ArgumentError
    from megatron_zb.training.pretrain import parse_command_line

    argv = script.argv(tmp_path / "mcore", pretrain=True) + ["--use-megatron-core-schedule"]
    with pytest.raises(ArgumentError) as e:
        parse_command_line(argv, world_size=script.world_size)
    [problem] = e.value.problems
    assert problem.flag == "--rampup-batch-size", str(e.value)
    assert f"megatron-core {megatron_core_version()} has no batch-size ramp-up calculator" in problem.text


def test_llama3_fp8_variant_is_refused_naming_every_fp8_flag(tmp_path):
    from megatron_zb.training.arguments import ArgumentError
    from megatron_zb.training.pretrain import parse_command_line

    argv = LLAMA3_8B.argv(tmp_path / "run", pretrain=True) + list(LLAMA3_8B_FP8) + ["--enable-zero-bubble"]
    with pytest.raises(ArgumentError) as e:
        parse_command_line(argv, world_size=LLAMA3_8B.world_size)
    [problem] = e.value.problems  # one problem naming every FP8 flag of the script
    assert problem.flag == "--fp8-format"
    assert problem.text.startswith("--fp8-format: --fp8-format, --fp8-amax-history-len, --fp8-amax-compute-algo, "
                                   "--fp8-param-gather: FP8 needs Transformer Engine's layers"), problem.text

"""NVIDIA's own Megatron-LM example scripts through Megatron-LM's loop with ``--enable-zero-bubble`` (issue 22).

The LLaMA-3 8B and Mixtral 8x7B launch scripts of Megatron-LM core_v0.16.1 (``examples/llama``,
``examples/mixtral``), flag for flag, scaled to CPU with the stated changes only
(:mod:`harness.megatron_lm_examples`: sizes, mock data, the CPU-only drops and the
harness's ``CPU_FLAGS``) plus ``--pipeline-model-parallel-size 2``. Each runs once with megatron-core's
own 1F1B and once through the flags route with ``--enable-zero-bubble`` (profiled in iterations 2-3,
re-planned for 4); both must train and be bitwise equal: each iteration's lm loss and grad norm,
every rank's parameters. The scripts' dropout is 0 (they set it), their precision bf16, their
optimizer distributed with overlapped grad reduce and param gather; both save a torch_dist
checkpoint at the end (``--save``; ``--load`` finds none, as on a first launch).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from test_megatron_lm_loop import FLAGS_PLUGIN, MCORE_1F1B, REPLAN_FUNC
from test_megatron_lm_loop import pytestmark  # noqa: F401  (the loop tests' skips: no Megatron-LM, missing imports)

from harness.megatron_lm import bitwise_differences, run_megatron_lm
from harness.megatron_lm_examples import LLAMA3_8B, MIXTRAL_8X7B, PATH_FLAGS, ExampleScript

ITERS = 4


@pytest.mark.parametrize("script", [LLAMA3_8B, MIXTRAL_8X7B], ids=["llama3_8b", "mixtral_8x7b"])
def test_example_script_with_enable_zero_bubble_is_bitwise_megatron_core(script: ExampleScript, tmp_path: Path) -> None:
    runs = {}
    for name, plugin, extra in (("mcore", None, ()), ("zb", FLAGS_PLUGIN, ("--enable-zero-bubble",))):
        folder = tmp_path / name
        runs[name] = run_megatron_lm([*script.argv(folder), *extra], world_size=script.world_size, timeout=360,
                                     plugin=plugin, params=True)
        tracker = folder / "ckpt" / "latest_checkpointed_iteration.txt"
        assert tracker.read_text().strip() == str(ITERS), f"{name}: no checkpoint of iteration {ITERS} saved"
    ref, zb = runs["mcore"], runs["zb"]
    assert [it.iteration for it in ref.iterations] == list(range(1, ITERS + 1)), ref.logs[-1][-2000:]
    assert {it.forward_backward for it in ref.iterations} == {MCORE_1F1B}
    assert {it.forward_backward for it in zb.iterations} == {REPLAN_FUNC}
    losses = ref.lm_losses
    assert all(x is not None and math.isfinite(x) for x in losses + ref.grad_norms), (losses, ref.grad_norms)
    assert losses[-1] < losses[0], f"the loss did not go down: {losses}"
    assert "re-planned" in zb.logs[0], "rank 0 printed no re-planning report"
    assert bitwise_differences(zb, ref) == []


def test_example_scripts_change_only_what_they_state() -> None:
    """The CPU argv holds every flag of the script except the stated drops, with the script's value
    unless a size replaces it; every dropped flag says why."""
    for script in (LLAMA3_8B, MIXTRAL_8X7B):
        argv = script.argv("/run")
        for flag, value in script.flags:
            if flag in script.dropped:
                assert flag not in argv and script.dropped[flag], flag
                continue
            assert flag in argv, flag
            if value is not None and flag not in script.sizes:
                expected = f"/run/{value}" if flag in PATH_FLAGS else value
                assert argv[argv.index(flag) + 1] == expected, flag
    assert LLAMA3_8B.argv("/run")[LLAMA3_8B.argv("/run").index("--save") + 1] == "/run/ckpt"
    assert "--bf16" in LLAMA3_8B.argv("/run") and "--use-distributed-optimizer" in MIXTRAL_8X7B.argv("/run")

"""megatron-zb inside NVIDIA Megatron-LM's own training loop (core_v0.16.1's ``pretrain_gpt.py``), on CPU.

Every run goes through :func:`megatron_zb.testing.megatron_lm.run_megatron_lm`: Megatron-LM's files,
unmodified, from ``$MEGATRON_LM_DIR`` or ``../shared/megatron-lm-core_v0.16.1``; gloo on 127.0.0.1;
4 iterations; mock data; default dropout. Per configuration, megatron-core's own 1F1B runs once
(a module-scoped fixture) and every megatron-zb variant is compared with it bitwise: each
iteration's lm loss and grad norm, and every rank's parameters after training.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from megatron_zb.testing.megatron_lm import (CPU_FLAGS, LLAMA_FLAGS, MOCK_DATA_FLAGS, SKIP_REASON, TINY_GPT_FLAGS,
                                             MegatronLMError, MegatronLMRun, bitwise_differences, find_megatron_lm,
                                             run_megatron_lm)

_MISSING = [m for m in ("yaml", "regex", "pydantic") if importlib.util.find_spec(m) is None]
pytestmark = [
    pytest.mark.skipif(find_megatron_lm() is None, reason=SKIP_REASON),
    pytest.mark.skipif(bool(_MISSING), reason=f"Megatron-LM's training package imports {_MISSING}: "
                                              "pip install -e '.[test]'"),
]

ITERS = 4
TIMEOUT_S = 240.0
MCORE_1F1B = "megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_without_interleaving"
ZB_FUNC = "megatron_zb.runtime.forward_backward.ZeroBubbleForwardBackward"

ZB_PLUGIN = "import megatron_zb\nmegatron_zb.patch_megatron('zb')\n"
"""The one-call route exactly as patches/README.md documents it."""
ZB_NO_DEALLOC_PLUGIN = ZB_PLUGIN + (
    "from megatron_zb.testing.megatron_lm_workarounds import override_transformer_config\n"
    "override_transformer_config(deallocate_pipeline_outputs=False)\n")
"""The same with Megatron-LM's ``deallocate_pipeline_outputs=True`` forced off (the stage outputs kept)."""
FLAGS_PLUGIN = "import megatron_zb.megatron_lm\nmegatron_zb.megatron_lm.install()\n"
"""The flags route (docs/megatron_lm.md): the zero-bubble flags on Megatron-LM's own parser."""

PP2 = (*CPU_FLAGS, *MOCK_DATA_FLAGS, *TINY_GPT_FLAGS, "--pipeline-model-parallel-size", "2",
       "--global-batch-size", "8", "--train-iters", str(ITERS))
"""Tiny GPT, PP=2 (world 2): 4 micro batches of 2 per iteration."""
PP2_DP2 = (*CPU_FLAGS, *MOCK_DATA_FLAGS, *LLAMA_FLAGS, "--pipeline-model-parallel-size", "2",
           "--global-batch-size", "16", "--train-iters", str(ITERS),
           "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather")
"""Tiny LLaMA, PP=2 x DP=2 (world 4), distributed optimizer, overlapped grad reduce and param gather:
4 micro batches of 2 per data-parallel rank per iteration."""


def _run(argv: tuple[str, ...], world_size: int, plugin: str | None = None, extra: tuple[str, ...] = ()
         ) -> MegatronLMRun:
    return run_megatron_lm([*argv, *extra], world_size=world_size, timeout=TIMEOUT_S, plugin=plugin, params=True)


def assert_bitwise_equal(run: MegatronLMRun, ref: MegatronLMRun) -> None:
    """Every iteration's exact lm loss and grad norm, every rank's grad norms and parameters: equal bits."""
    assert len(run.iterations) == ITERS and run.params is not None and ref.params is not None
    assert bitwise_differences(run, ref) == []


def assert_trains(run: MegatronLMRun, world_size: int, forward_backward: str) -> None:
    """All iterations logged by the last rank with finite values, the loss going down, the grad norm
    the same on every rank, the printed line matching the exact values, the expected schedule."""
    assert [it.iteration for it in run.iterations] == list(range(1, ITERS + 1)), run.logs[-1][-2000:]
    losses, norms = run.lm_losses, run.grad_norms
    assert all(x is not None and math.isfinite(x) and x > 0 for x in losses + norms), (losses, norms)
    assert losses[-1] < losses[0], f"the loss did not go down: {losses}"
    assert all(r == norms for r in run.grad_norms_by_rank) and len(run.grad_norms_by_rank) == world_size
    first = run.iterations[0]
    assert first.lm_loss == float(f"{first.exact['lm loss']:.6E}")  # printed with 7 significant digits
    assert all(it.grad_norm == round(it.exact["grad norm"], 3) for it in run.iterations)
    assert {it.forward_backward for it in run.iterations} == {forward_backward}


# ---------------------------------------------------------------------- PP=2, tiny GPT
@pytest.fixture(scope="module")
def mcore_pp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[MegatronLMRun, Path]:
    """megatron-core's own 1F1B in Megatron-LM's loop, the baseline of this configuration; it saves a
    torch_dist checkpoint at the end (dist-checkpointing's results process uses the spawn start
    method and re-imports ``__main__``: the harness's entry script must survive that)."""
    save = tmp_path_factory.mktemp("mlm-ckpt")
    return _run(PP2, world_size=2, extra=("--save", str(save), "--save-interval", str(ITERS))), save


def test_pp2_megatron_core_1f1b_trains_and_saves(mcore_pp2: tuple[MegatronLMRun, Path]) -> None:
    run, save = mcore_pp2
    assert_trains(run, 2, MCORE_1F1B)
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    assert (save / f"iter_{ITERS:07d}" / ".metadata").is_file()


def test_pp2_patch_megatron_zb_is_bitwise_1f1b(mcore_pp2: tuple[MegatronLMRun, Path]) -> None:
    run = _run(PP2, world_size=2, plugin=ZB_PLUGIN)
    assert_trains(run, 2, ZB_FUNC)
    assert_bitwise_equal(run, mcore_pp2[0])


def test_pp2_patch_megatron_zb_without_dealloc_is_bitwise_1f1b(mcore_pp2: tuple[MegatronLMRun, Path]) -> None:
    run = _run(PP2, world_size=2, plugin=ZB_NO_DEALLOC_PLUGIN)
    assert_trains(run, 2, ZB_FUNC)
    assert_bitwise_equal(run, mcore_pp2[0])


# ---------------------------------------------------------------------- PP=2 x DP=2, tiny LLaMA, distributed optimizer
@pytest.fixture(scope="module")
def mcore_pp2_dp2() -> MegatronLMRun:
    """megatron-core's 1F1B with the distributed optimizer and overlapped reduce / gather: the baseline."""
    return _run(PP2_DP2, world_size=4)


def test_pp2_dp2_megatron_core_1f1b_trains(mcore_pp2_dp2: MegatronLMRun) -> None:
    assert_trains(mcore_pp2_dp2, 4, MCORE_1F1B)
    params = mcore_pp2_dp2.params
    assert params is not None and params[0].keys() == params[1].keys()  # ranks 0, 1: stage 0 (DP pair)
    names = {name for rank in params for name in rank}
    assert not any(name.endswith(".bias") for name in names)  # --disable-bias-linear, RMSNorm
    assert "chunk0.output_layer.weight" in params[-1]  # --untie-embeddings-and-output-weights
    layer = "chunk0.decoder.layers.0."
    assert params[0][layer + "self_attention.linear_qkv.weight"].shape == (64 + 2 * 2 * 16, 64)  # GQA: 2 groups
    assert params[0][layer + "mlp.linear_fc1.weight"].shape == (2 * 176, 64)  # SwiGLU: gate and up
    assert all(torch.equal(params[0][n], params[1][n]) for n in params[0])  # data-parallel replicas agree


def test_pp2_dp2_patch_megatron_zb_is_bitwise_1f1b(mcore_pp2_dp2: MegatronLMRun) -> None:
    run = _run(PP2_DP2, world_size=4, plugin=ZB_PLUGIN)
    assert_trains(run, 4, ZB_FUNC)
    assert_bitwise_equal(run, mcore_pp2_dp2)


def test_pp2_dp2_zero_bubble_flags_on_megatron_lm_parser_are_bitwise_1f1b(mcore_pp2_dp2: MegatronLMRun) -> None:
    """``--schedule zb-2p --zero-bubble-max-pending-backward 4`` on Megatron-LM's own command line."""
    run = _run(PP2_DP2, world_size=4, plugin=FLAGS_PLUGIN,
               extra=("--schedule", "zb-2p", "--zero-bubble-max-pending-backward", "4"))
    assert_trains(run, 4, ZB_FUNC)
    assert_bitwise_equal(run, mcore_pp2_dp2)


# ---------------------------------------------------------------------- the flags route
def test_pp2_enable_zero_bubble_on_megatron_lm_parser_is_bitwise_1f1b(mcore_pp2: tuple[MegatronLMRun, Path]) -> None:
    run = _run(PP2, world_size=2, plugin=FLAGS_PLUGIN, extra=("--enable-zero-bubble",))
    assert_trains(run, 2, ZB_FUNC)
    assert_bitwise_equal(run, mcore_pp2[0])


@pytest.mark.parametrize("bad,message", [
    (("--zero-bubble-v-schedule",), "--zero-bubble-v-schedule: not supported inside Megatron-LM's loop"),
    (("--enable-zero-bubble", "--enable-optimizer-post-validation"),
     "--enable-optimizer-post-validation: not supported inside Megatron-LM's loop"),
    (("--zero-bubble-max-pending-backward", "2"), "--zero-bubble-max-pending-backward: only applies with"),
])
def test_a_bad_zero_bubble_flag_exits_2_before_any_process_group(bad: tuple[str, ...], message: str) -> None:
    with pytest.raises(MegatronLMError) as e:
        _run(PP2, world_size=2, plugin=FLAGS_PLUGIN, extra=bad)
    text = str(e.value) + "\n".join(e.value.logs)
    assert "exited with status 2" in str(e.value) and f"megatron-zb: error: {message}" in text
    assert "initializing torch distributed" not in text  # Megatron-LM's first line of its process-group set-up

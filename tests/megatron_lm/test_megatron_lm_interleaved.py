"""Interleaved schedules inside NVIDIA Megatron-LM's own training loop (``pretrain_gpt.py`` of core_v0.16.1 or core_v0.19.0), on CPU.

megatron-core's interleaved 1F1B (Megatron-LM's ``--num-layers-per-virtual-pipeline-stage``; with
virtual stages Megatron-LM turns ``overlap_p2p_comm`` on) against megatron-zb's ``interleaved-1f1b``
and ``interleaved-zb`` through the flags route, bit for bit: every iteration's lm loss and grad
norm, every rank's parameters. Tiny GPT, PP=2 with 2 virtual stages per rank (4 model chunks of one
layer), 4 micro batches, 4 iterations; runs through :func:`harness.megatron_lm.run_megatron_lm`.

With multi-token prediction (``--mtp-num-layers 1``; Megatron-LM allows it only with RoPE or no position
embedding, hence ``--position-embedding-type rope``) and tied embeddings: the MTP layer is built on the
last rank's last chunk, which keeps a word-embedding copy serving both the MTP layer's lookup and the
output layer. The runs also compare the MTP loss bit for bit (the harness records each depth's loss).
Before the runtime marked that copy's weight gradient to be computed in B
(``runtime/linear_route.mark_tied_mtp_weights``), zero bubble in this loop was measured not bitwise
(grad norm apart from iteration 1: the deferred output-layer gradient dropped the lookup's).

With DeepSeek-V3's MoE (``test_megatron_lm_loop.DEEPSEEK_MOE``, expert parallelism 1) on layers 1-3 and
the MTP layer: the grad norm is bitwise too, not only the losses (pretrain_gpt_zb.py's interleaved-zb, in
tests/training/test_deepseek_v3.py, differs from megatron-core's 1F1B in its last bits because it groups
the layers per rank otherwise; here the reference is megatron-core's interleaved 1F1B, the same grouping).

Dropout is off (``--hidden-dropout 0 --attention-dropout 0``) in this file, for this reason:
``interleaved-zb`` is profiled and re-planned (iterations 3-4 run the re-planned schedule), and the
re-planned schedule runs the two chunks' forwards of a rank in another order than megatron-core's
interleaved 1F1B; dropout draws its random numbers in execution order, so with dropout on the masks
land on other micro batches from the first re-planned iteration on (measured: bitwise before the
re-plan, not after). With Megatron-LM's default dropout, megatron-core's interleaved 1F1B and
``interleaved-1f1b`` were measured bitwise equal at PP=2 and at PP=4 (8 layers, 8 micro batches),
once by hand, not in this file.

Before the CPU shim gave megatron-core's point-to-point sends a view of their own
(``docs/cpu_support.md``), megatron-core's interleaved 1F1B here was not deterministic: it
pseudo-frees each stage output before its send completes, and gloo sent freed memory.
"""

from __future__ import annotations

import re

import pytest

from harness.megatron_lm import (CPU_FLAGS, MOCK_DATA_FLAGS, TINY_GPT_FLAGS, MegatronLMRun,
                                             bitwise_differences, run_megatron_lm)
import test_megatron_lm_loop
from test_megatron_lm_loop import DEEPSEEK_MOE, FLAGS_PLUGIN, ITERS, NO_TORCH_COMPILE, REPLAN_FUNC, TIMEOUT_S, ZB_FUNC, loop_flags, assert_trains

pytestmark = test_megatron_lm_loop.pytestmark  # skips without Megatron-LM or its imports

MCORE_INTERLEAVED = "megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_with_interleaving"

PP2_VP2 = (*CPU_FLAGS, *MOCK_DATA_FLAGS, *TINY_GPT_FLAGS, "--pipeline-model-parallel-size", "2",
           "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "8", "--train-iters", str(ITERS),
           "--hidden-dropout", "0", "--attention-dropout", "0", "--mtp-num-layers", "1",
           "--position-embedding-type", "rope", "--disable-bias-linear",
           *DEEPSEEK_MOE[:DEEPSEEK_MOE.index("--expert-model-parallel-size")])
"""Tiny GPT (4 layers, RoPE, one MTP layer, no linear biases) with DeepSeek-V3's MoE
(``test_megatron_lm_loop.DEEPSEEK_MOE``: layer 0 dense, layers 1-3 and the MTP layer MoE with a shared
expert and DeepSeek's router) at expert parallelism 1 (world 2: no room for EP=2 beside PP=2), PP=2,
2 virtual stages per rank of 1 layer; 4 micro batches of 2."""


def _run(plugin: str | None = None, extra: tuple[str, ...] = ()) -> MegatronLMRun:
    return run_megatron_lm([*PP2_VP2, *extra], world_size=2, timeout=TIMEOUT_S, plugin=plugin, params=True,
                           env=NO_TORCH_COMPILE)


@pytest.fixture(scope="module")
def mcore_interleaved() -> MegatronLMRun:
    """megatron-core's own interleaved 1F1B in Megatron-LM's loop: the baseline."""
    return _run()


def _assert_bitwise(run: MegatronLMRun, ref: MegatronLMRun) -> None:
    assert run.params is not None and ref.params is not None
    assert all(name.startswith(("chunk0.", "chunk1.")) for rank in ref.params for name in rank)
    assert any(name.startswith("chunk1.") for name in ref.params[0])  # two model chunks per rank
    assert any(name.startswith("chunk1.mtp.layers.0.") for name in ref.params[1])  # MTP on the last chunk
    assert all("mtp_1 loss" in it.exact for it in ref.iterations)  # compared below with lm loss, grad norm
    assert any(name.endswith(".mlp.router.weight") for name in ref.params[0])  # DeepSeek MoE layers
    assert all("| seq_load_balancing_loss: " in it.line for it in ref.iterations)
    assert bitwise_differences(run, ref) == []


def test_megatron_core_interleaved_trains(mcore_interleaved: MegatronLMRun) -> None:
    assert_trains(mcore_interleaved, 2, MCORE_INTERLEAVED)


def test_interleaved_1f1b_is_bitwise_megatron_core_interleaved(mcore_interleaved: MegatronLMRun) -> None:
    run = _run(FLAGS_PLUGIN, ("--schedule", "interleaved-1f1b"))
    assert_trains(run, 2, ZB_FUNC)
    _assert_bitwise(run, mcore_interleaved)


def test_interleaved_zb_replanned_is_bitwise_megatron_core_interleaved(mcore_interleaved: MegatronLMRun) -> None:
    """Profiled at iteration 2, re-planned from the measured costs for iterations 3-4: still bitwise,
    each chunk's W order equals its B order (docs/runtime.md "Numerics")."""
    run = _run(FLAGS_PLUGIN, ("--schedule", "interleaved-zb", "--zero-bubble-pipeline-timers-start-iter", "2",
                              "--zero-bubble-pipeline-timers-end-iter", "3"))
    assert_trains(run, 2, REPLAN_FUNC)
    report = run.logs[0][run.logs[0].index("> schedule report after profiling iterations 2-2 "):]
    assert "    re-planned 'interleaved-zb' from the measured costs in " in report
    _assert_bitwise(run, mcore_interleaved)


# ---------------------------------------------------------------------- the checks, no Megatron-LM run
@pytest.mark.parametrize("argv,per_stage,message", [
    (("--schedule", "interleaved-zb"), None, "--schedule: 'interleaved-zb' has the interleaved placement but "
                                             "Megatron-LM builds 1 model chunk(s) per rank"),
    (("--schedule", "zb"), 1, "--schedule: 'zb' has the plain placement but Megatron-LM builds 2 model chunk(s) "
                              "per rank"),
])
def test_the_schedule_placement_must_match_megatron_lm_chunks(argv: tuple[str, ...], per_stage: int | None,
                                                              message: str) -> None:
    """PP=2, 4 layers: ``--num-layers-per-virtual-pipeline-stage 1`` makes Megatron-LM build 2 chunks per rank."""
    from megatron_zb.megatron_lm import configure
    from megatron_zb.training.arguments.common import ArgumentError

    args = loop_flags(*argv)
    args.num_layers_per_virtual_pipeline_stage = per_stage
    with pytest.raises(ArgumentError, match=re.escape(message)):
        configure(args)
    args = loop_flags("--schedule", "interleaved-1f1b")
    args.num_layers_per_virtual_pipeline_stage = 1
    assert configure(args) == {"schedule": "interleaved-1f1b", "timeout": 300.0, "num_chunks": 2}

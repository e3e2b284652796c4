"""megatron-zb inside NVIDIA Megatron-LM's own training loop (``pretrain_gpt.py`` of core_v0.16.1 with
megatron-core 0.16.1, or of core_v0.19.0 with megatron-core 0.19.x), on CPU.

Every run goes through :func:`harness.megatron_lm.run_megatron_lm`: Megatron-LM's files,
unmodified, from ``$MEGATRON_LM_DIR`` or ``../shared/megatron-lm-<tag>``; gloo on 127.0.0.1;
4 iterations; mock data; default dropout. Per configuration, megatron-core's own 1F1B runs once
(a module-scoped fixture) and every megatron-zb variant is compared with it bitwise: each
iteration's lm loss and grad norm, and every rank's parameters after training.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_zb.megatron_compat import megatron_lm_loop, megatron_lm_tag
from harness.megatron_lm import (CPU_FLAGS, LLAMA_FLAGS, MOCK_DATA_FLAGS, SKIP_REASON, TINY_GPT_FLAGS,
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
REPLAN_FUNC = "megatron_zb.megatron_lm.route.ReplanningForwardBackward"
"""The flags route's wrapper of :data:`ZB_FUNC` for cost-aware schedules (profiles, then re-plans)."""

ZB_PLUGIN = "import megatron_zb\nmegatron_zb.patch_megatron('zb')\n"
"""The one-call route exactly as patches/README.md documents it."""
ZB_NO_DEALLOC_PLUGIN = ZB_PLUGIN + (
    "from harness.megatron_lm_workarounds import override_transformer_config\n"
    "override_transformer_config(deallocate_pipeline_outputs=False)\n")
"""The same with Megatron-LM's ``deallocate_pipeline_outputs=True`` forced off (the stage outputs kept)."""
FLAGS_PLUGIN = "import megatron_zb.megatron_lm\nmegatron_zb.megatron_lm.install()\n"
"""The flags route (docs/megatron_lm.md): the zero-bubble flags on Megatron-LM's own parser."""

PP2 = (*CPU_FLAGS, *MOCK_DATA_FLAGS, *TINY_GPT_FLAGS, "--pipeline-model-parallel-size", "2",
       "--global-batch-size", "8", "--train-iters", str(ITERS))
"""Tiny GPT, PP=2 (world 2): 4 micro batches of 2 per iteration."""
DEEPSEEK_MOE = ("--num-experts", "4", "--moe-layer-freq", "[0,1,1,1]", "--moe-ffn-hidden-size", "32",
                "--moe-router-topk", "2", "--moe-shared-expert-intermediate-size", "32",
                "--moe-router-score-function", "sigmoid", "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
                "--moe-router-enable-expert-bias", "--moe-router-topk-scaling-factor", "2.5",
                "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-3",
                "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall")
"""DeepSeek-V3's MoE as tests/training/test_deepseek_v3.py builds it (``DEEPSEEK_V3``) for pretrain_gpt_zb.py:
layer 0 dense, layers 1-3 and the MTP layer MoE of 4 experts with a shared expert, DeepSeek's router
(sigmoid scores, group-limited top-2 in 2 groups of which 1 per token, the aux-loss-free expert bias,
top-k scaling factor 2.5, the sequence-level aux loss), expert parallelism 2 with the all-to-all
dispatcher. No linear biases (``LLAMA_FLAGS``' ``--disable-bias-linear``: megatron-core's biased experts
fail in its own 1F1B on CPU). Not multi-latent attention: megatron-core's local spec, the one Megatron-LM
builds without Transformer Engine, gives MLA its ``DotProductAttention``, which does not take MLA's head
sizes -- ``TypeError: DotProductAttention.__init__() got an unexpected keyword argument 'k_channels' when
instantiating DotProductAttention when instantiating MLASelfAttention when instantiating TransformerLayer``
(megatron-core's own 1F1B, core_v0.16.1 and core_v0.19.0; pretrain_gpt_zb.py substitutes
megatron_zb/model/mla.py's attention and runs MLA: tests/training/test_deepseek_v3.py)."""
PP2_DP2 = (*CPU_FLAGS, *MOCK_DATA_FLAGS, *LLAMA_FLAGS, "--pipeline-model-parallel-size", "2",
           "--global-batch-size", "16", "--train-iters", str(ITERS),
           "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--mtp-num-layers", "1",
           *DEEPSEEK_MOE)
"""A DeepSeek-V3-shaped tiny LLaMA (issue 41): PP=2 x DP=2 (world 4) with expert parallelism 2, the
distributed optimizer, overlapped grad reduce and param gather, :data:`DEEPSEEK_MOE`, one multi-token
prediction layer (untied: the output layer's weight serves the main loss and the MTP layer's, one
summed W entry; the MTP loss compared bit for bit with the rest); GQA attention, not MLA (see
:data:`DEEPSEEK_MOE`): 4 micro batches of 2 per data-parallel rank per iteration."""


NO_TORCH_COMPILE = {"TORCHDYNAMO_DISABLE": "1"}
"""Every rank's environment here, speed only: megatron-core's MoE functions decorated ``@jit_fuser``
(``torch.compile``: the experts' GLU and activation, the router's expert-bias update) run eagerly, as the fused
kernels ``CPU_FLAGS`` turn off do (a PP2_DP2 run measured 16.7 s with compilation, 9.3 s without, every
loss and grad norm bitwise the same). The baseline and every compared run get the same environment."""


def run_loop(argv: tuple[str, ...], world_size: int, plugin: str | None = None, extra: tuple[str, ...] = ()
         ) -> MegatronLMRun:
    return run_megatron_lm([*argv, *extra], world_size=world_size, timeout=TIMEOUT_S, plugin=plugin, params=True,
                           env=NO_TORCH_COMPILE)


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
    return run_loop(PP2, world_size=2, extra=("--save", str(save), "--save-interval", str(ITERS))), save


def test_pp2_megatron_core_1f1b_trains_and_saves(mcore_pp2: tuple[MegatronLMRun, Path]) -> None:
    run, save = mcore_pp2
    assert_trains(run, 2, MCORE_1F1B)
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    assert (save / f"iter_{ITERS:07d}" / ".metadata").is_file()


def test_pp2_patch_megatron_zb_is_bitwise_1f1b(mcore_pp2: tuple[MegatronLMRun, Path]) -> None:
    run = run_loop(PP2, world_size=2, plugin=ZB_PLUGIN)
    assert_trains(run, 2, ZB_FUNC)
    assert_bitwise_equal(run, mcore_pp2[0])


def test_pp2_patch_megatron_zb_without_dealloc_is_bitwise_1f1b(mcore_pp2: tuple[MegatronLMRun, Path]) -> None:
    run = run_loop(PP2, world_size=2, plugin=ZB_NO_DEALLOC_PLUGIN)
    assert_trains(run, 2, ZB_FUNC)
    assert_bitwise_equal(run, mcore_pp2[0])


# ---------------------------------------------------------------------- PP=2 x DP=2, tiny LLaMA, distributed optimizer
@pytest.fixture(scope="module")
def mcore_pp2_dp2() -> MegatronLMRun:
    """megatron-core's 1F1B with the distributed optimizer and overlapped reduce / gather: the baseline."""
    return run_loop(PP2_DP2, world_size=4)


def test_pp2_dp2_megatron_core_1f1b_trains(mcore_pp2_dp2: MegatronLMRun) -> None:
    """The baseline is the model described: dense layer 0, DeepSeek MoE layers (experts split over the
    expert-parallel pair, a shared expert), the MTP layer an MoE layer, the sequence aux loss logged."""
    assert_trains(mcore_pp2_dp2, 4, MCORE_1F1B)
    params = mcore_pp2_dp2.params
    assert params is not None and params[0].keys() == params[1].keys()  # ranks 0, 1: stage 0 (DP pair)
    names = {name for rank in params for name in rank}
    assert not any(name.endswith(".bias") for name in names)  # --disable-bias-linear, RMSNorm
    assert "chunk0.output_layer.weight" in params[-1]  # --untie-embeddings-and-output-weights
    layer = "chunk0.decoder.layers.0."
    assert params[0][layer + "self_attention.linear_qkv.weight"].shape == (64 + 2 * 2 * 16, 64)  # GQA: 2 groups
    assert params[0][layer + "mlp.linear_fc1.weight"].shape == (2 * 176, 64)  # SwiGLU: gate and up
    moe = "chunk0.decoder.layers.1.mlp."  # --moe-layer-freq [0,1,1,1]: layer 0 dense, then MoE
    assert params[0][moe + "router.weight"].shape == (4, 64)  # 4 experts
    assert params[0][moe + "shared_experts.linear_fc1.weight"].shape == (2 * 32, 64)
    experts = {n for n in params[0] if ".experts." in n}
    assert {n.split("local_experts.")[1].split(".")[0] for n in experts} == {"0", "1"}  # EP=2: 2 of 4 per rank
    assert all(not torch.equal(params[0][n], params[1][n]) for n in experts)  # ranks 0, 1: the other 2 experts
    assert all(torch.equal(params[0][n], params[1][n]) for n in params[0] if n not in experts)  # DP replicas agree
    assert "chunk0.mtp.layers.0.eh_proj.weight" in params[-1]  # --mtp-num-layers 1: on the last stage
    # an MoE MTP layer (megatron-core 0.19 names its layer mtp_model_layer)
    assert {"chunk0.mtp.layers.0.transformer_layer.mlp.router.weight",
            "chunk0.mtp.layers.0.mtp_model_layer.mlp.router.weight"} & params[-1].keys()
    assert all(it.exact["mtp_1 loss"] > 0 for it in mcore_pp2_dp2.iterations)
    assert all("| seq_load_balancing_loss: " in it.line for it in mcore_pp2_dp2.iterations)


def test_pp2_dp2_patch_megatron_zb_is_bitwise_1f1b(mcore_pp2_dp2: MegatronLMRun) -> None:
    run = run_loop(PP2_DP2, world_size=4, plugin=ZB_PLUGIN)
    assert_trains(run, 4, ZB_FUNC)
    assert_bitwise_equal(run, mcore_pp2_dp2)


def test_pp2_dp2_zero_bubble_flags_on_megatron_lm_parser_are_bitwise_1f1b(mcore_pp2_dp2: MegatronLMRun) -> None:
    """``--schedule zb-2p --zero-bubble-max-pending-backward 4`` on Megatron-LM's own command line."""
    run = run_loop(PP2_DP2, world_size=4, plugin=FLAGS_PLUGIN,
               extra=("--schedule", "zb-2p", "--zero-bubble-max-pending-backward", "4"))
    assert_trains(run, 4, REPLAN_FUNC)
    assert "    re-planned 'zb-2p' from the measured costs in " in run.logs[0]  # default window: iterations 2-3
    assert_bitwise_equal(run, mcore_pp2_dp2)


# ---------------------------------------------------------------------- the flags route
def test_pp2_enable_zero_bubble_on_megatron_lm_parser_is_bitwise_1f1b(mcore_pp2: tuple[MegatronLMRun, Path]) -> None:
    """The default profiling window (iterations 2-3) ends before iteration 4: re-planned, still bitwise."""
    run = run_loop(PP2, world_size=2, plugin=FLAGS_PLUGIN, extra=("--enable-zero-bubble",))
    assert_trains(run, 2, REPLAN_FUNC)
    assert "> schedule report after profiling iterations 2-3 " in run.logs[0]
    assert_bitwise_equal(run, mcore_pp2[0])


def test_pp2_profile_then_replan_on_the_flags_route(mcore_pp2: tuple[MegatronLMRun, Path], tmp_path: Path) -> None:
    """Iteration 2 profiled, the zb schedule re-planned from the measured costs for iterations 3-4,
    the costs written with ``--profile-out``. Bitwise with megatron-core's 1F1B: every generator keeps
    each stage's W order equal to its B order (docs/runtime.md "Numerics"), re-planned or not."""
    from megatron_zb.planning.profile import read_profile

    out = tmp_path / "profile.json"
    run = run_loop(PP2, world_size=2, plugin=FLAGS_PLUGIN,
               extra=("--enable-zero-bubble", "--zero-bubble-pipeline-timers-start-iter", "2",
                      "--zero-bubble-pipeline-timers-end-iter", "3", "--profile-out", str(out)))
    assert_trains(run, 2, REPLAN_FUNC)
    log = run.logs[0]  # global rank 0 prints the reports, as pretrain_gpt_zb.py does
    assert "> schedule report (unit costs T_F = T_B = T_W = 1, before profiling):" in log
    report = log[log.index("> schedule report after profiling iterations 2-2 "):]
    assert "    re-planned 'zb' from the measured costs in " in report
    assert re.search(r"    measured costs \(ms\): T_F=[0-9.]+, T_B=[0-9.]+, T_W=[0-9.]+, T_comm=[0-9.]+", report)
    per_stage = re.search(r"measured per stage \(ms\): T_F=\[(.*?)\]; T_B=\[(.*?)\]; T_W=\[(.*?)\]\n", report)
    assert per_stage is not None and "T_BW" not in report  # W ran as actions of their own, B and W split
    assert all(float(v) > 0 for v in per_stage.group(3).split(", "))
    assert all("schedule report after profiling" not in rank_log for rank_log in run.logs[1:])
    profile = read_profile(out)
    assert profile.schedule == "zb" and len(profile.stages) == 2 and profile.model.hidden_size == 64
    assert all(s.t_w_ms > 0 and s.mem_b_bytes > 0 for s in profile.stages)
    # every op's host and device time, one clock on CPU: printed and written, nothing host-bound
    assert "    measured host / device time per action (ms, median per stage; host = device on CPU" in report
    assert profile.action_times is not None and profile.action_times.clock == "host"
    assert [(o.op, o.stage) for o in profile.action_times.ops] == [(op, s) for op in ("F", "B", "W") for s in (0, 1)]
    assert all(o.host_ms == o.device_ms and not o.host_bound for o in profile.action_times.ops)
    assert_bitwise_equal(run, mcore_pp2[0])


V_WITHOUT_WRAPPER = ("--zero-bubble-v-schedule: 'zbv' is a V schedule: its two model chunks per rank must be built "
                     "for the V, so in pretrain_gpt.py pass megatron_zb.megatron_lm.v_model_provider(partial("
                     "model_provider, gpt_builder)) to pretrain()")
"""What a V schedule without the provider wrapper gets where Megatron-LM builds the model through the
script's provider (core_v0.16.1; core_v0.19.0 builds it with the builder the V route wraps:
tests/megatron_lm/test_megatron_lm_v.py runs the V there with the two lines of the flags route only)."""
V_NEEDS_THE_WRAPPER = megatron_lm_loop().v_model_builder is None
FSDP_REFUSED = ("--use-megatron-fsdp: refused with the zero-bubble schedule '{schedule}': megatron-core's Megatron "
                "FSDP reduce-scatters the gradients from a hook that fires when the fused backward ends, before a "
                "deferred W has added its weight gradients")
"""The reason pretrain_gpt_zb.py gives too (``flags.WHY_NOT``)."""
MTP_WITH_A_V = ("--mtp-num-layers: not supported with the V schedule 'zbv' inside Megatron-LM's loop: the V's loss "
                "stage is on pipeline rank 0")
"""Multi-token prediction is refused with a V only (with the other families it is bitwise megatron-core's:
test_pp2_dp2_* here, tests/megatron_lm/test_megatron_lm_interleaved.py)."""


@pytest.mark.parametrize("bad,message", [
    *([(("--zero-bubble-v-schedule",), V_WITHOUT_WRAPPER)] if V_NEEDS_THE_WRAPPER else []),  # no wrapper
    (("--zero-bubble-v-schedule", "--tensor-model-parallel-size", "2"),  # refused with a V on every release
     "--tensor-model-parallel-size: must be 1 with the V schedule 'zbv' inside Megatron-LM's loop"),
    (("--enable-optimizer-post-validation",),
     "--enable-optimizer-post-validation: needs a zero-bubble schedule"),
    (("--zero-bubble-max-pending-backward", "2"), "--zero-bubble-max-pending-backward: only applies with"),
    # what is not verified in Megatron-LM's loop, every refusal in one report (a V: the fork's invocation)
    (("--enable-zero-bubble", "--zero-bubble-v-schedule", "--use-megatron-fsdp", "--account-for-loss-in-pipeline-split",
      "--mtp-num-layers", "1"), (FSDP_REFUSED.format(schedule="zbv"), MTP_WITH_A_V,
                                 "--account-for-loss-in-pipeline-split: not supported with the V schedule 'zbv' inside "
                                 "Megatron-LM's loop: the V splits the layers evenly")),
    (("--enable-zero-bubble", "--use-megatron-fsdp", "--allow-padding-num-layers", "--zero-bubble-wgrad-group", "2"),
     (FSDP_REFUSED.format(schedule="zb"), "--allow-padding-num-layers: not supported inside Megatron-LM's loop",
      "--zero-bubble-wgrad-group: not supported inside Megatron-LM's loop: weight-gradient groups run in "
      "pretrain_gpt_zb.py's trainer only")),
])
def test_a_bad_zero_bubble_flag_exits_2_before_any_process_group(bad: tuple[str, ...],
                                                                  message: str | tuple[str, ...]) -> None:
    """``message``: the one problem's line, or the lines of a report of several (each on a line of its own).
    The report is printed once, by global rank 0; every rank exits 2 (the others after
    ``refusals.QUIET_RANKS_WAIT_S``), before any process group. The harness waits up to 30 s for the
    other ranks after rank 0's exit (its default 3 s: a rank slowed down on a loaded machine was killed
    before it had reached the check, 2026-12-07); they exit about 2 s after rank 0."""
    with pytest.raises(MegatronLMError) as e:
        run_megatron_lm([*PP2, *bad], world_size=2, timeout=TIMEOUT_S, plugin=FLAGS_PLUGIN, grace=30.0)
    logs = e.value.logs
    text = "\n".join(logs)
    assert e.value.returncodes == [2, 2], str(e.value)
    assert text.count("megatron-zb: error: ") == 1 and "megatron-zb: error: " in logs[0], text[-3000:]
    if isinstance(message, str):
        assert f"megatron-zb: error: {message}" in text
    else:
        assert f"megatron-zb: error: {len(message)} problems with the command line" in text
        assert all(f"\n  {line}" in text for line in message), text[-3000:]
    assert "initializing torch distributed" not in text  # Megatron-LM's first line of its process-group set-up


# ---------------------------------------------------------------------- the wrapper, no Megatron-LM run
@dataclasses.dataclass(frozen=True)
class _PlannerConfig:
    """Stands in for the planner's RunConfig: the field the wrapper replaces."""

    num_microbatches: int = 0

    def replace(self, **changes: Any) -> "_PlannerConfig":
        return dataclasses.replace(self, **changes)


class _RecordingPlanner:
    """Stands in for :class:`~megatron_zb.training.replanning.SchedulePlanner` and its runtime and
    :class:`~megatron_zb.training.cost_window.CostWindow` (a planner needs process groups and a model):
    records the calls the wrapper makes."""

    def __init__(self, window: tuple[int, int]) -> None:
        self.window, self.calls, self.replans = window, [], 0
        self.config = _PlannerConfig()

    def run(self, measure: Any, **kwargs: Any) -> Any:
        from megatron_zb.runtime.measure import Measured

        self.calls.append(("run", kwargs["forward_only"], measure.time_actions))
        return Measured(data=[kwargs["forward_only"]])

    def request(self, iteration: int) -> Any:
        from megatron_zb.runtime.measure import Measure

        self.calls.append(("request", iteration))
        return Measure(time_actions=self.window[0] <= iteration < self.window[1], iteration=iteration)

    def record(self, iteration: int, measured: Any, *, seconds: float) -> bool:
        assert seconds >= 0 and measured.data == [False]
        self.calls.append(("record", iteration))
        return iteration == self.window[1] - 1

    def replan(self, window: Any) -> None:
        assert window is self
        self.replans += 1


def test_replanning_wrapper_counts_training_calls_only() -> None:
    """Evaluation calls (``forward_only=True``) neither advance the iteration nor touch the window (and
    measure nothing); the window's training calls measure their actions' times; its last one re-plans
    once; the keywords are megatron-core's."""
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    from megatron_zb.megatron_lm import ReplanningForwardBackward
    from megatron_zb.runtime import get_forward_backward_func

    runtime = get_forward_backward_func("zb")
    wrapper = ReplanningForwardBackward(runtime, schedule="zb")
    def keywords(fn: Any) -> list[tuple[str, Any, Any]]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert keywords(wrapper.__call__) == keywords(runtime.__call__)  # names, keyword-only, defaults
    assert {k[0] for k in keywords(wrapper.__call__)} == {k[0] for k in keywords(forward_backward_no_pipelining)}
    planner = _RecordingPlanner(window=(2, 4))
    wrapper.planner = wrapper.window = wrapper.runtime = planner
    call = dict(forward_step_func=None, data_iterator=None, model=None, num_microbatches=4, seq_length=32,
                micro_batch_size=2)
    for forward_only in (True, False, True, False, False, True, True, False):
        assert wrapper(**call, forward_only=forward_only) == [forward_only]
    assert wrapper.iteration == 4 and planner.replans == 1 and planner.config.num_microbatches == 4
    trained = [c for c in planner.calls if c[0] != "run"]
    assert trained == [(e, i) for i in range(1, 5) for e in ("request", "record")]
    assert [c for c in planner.calls if c[0] == "run"] == [
        ("run", True, False), ("run", False, False), ("run", True, False), ("run", False, True),
        ("run", False, True), ("run", True, False), ("run", True, False), ("run", False, False)]


def loop_flags(*argv: str) -> argparse.Namespace:
    """The zero-bubble flags parsed as on Megatron-LM's parser, beside the Megatron-LM values
    :func:`~megatron_zb.megatron_lm.configure` reads (PP=2, 4 layers, no interleaving, dense)."""
    from megatron_zb.megatron_lm import add_flags

    parser = argparse.ArgumentParser()
    add_flags(parser)
    return parser.parse_args(argv, namespace=argparse.Namespace(
        pipeline_model_parallel_size=2, num_layers=4, num_layers_per_virtual_pipeline_stage=None,
        num_virtual_stages_per_pipeline_rank=None, num_experts=None))


@pytest.mark.parametrize("argv,experts,message", [
    (("--schedule", "zb-h1", "--profile-out", "p.json"), None, "--profile-out: 'zb-h1' is not cost-aware"),
    (("--profile-out", "p.json"), None, "--profile-out: no zero-bubble schedule was chosen"),
    (("--enable-zero-bubble", "--zero-bubble-pipeline-timers-end-iter", "2"), None,
     "--zero-bubble-pipeline-timers-end-iter: 2 must be greater than"),
    (("--enable-zero-bubble", "--profile-out", "p.json"), 4, "--profile-out: the planner does not model MoE"),
])
def test_configure_refuses_what_the_profiling_window_cannot_do(argv: tuple[str, ...], experts: int | None,
                                                               message: str) -> None:
    """Refused with the flag named (install() turns it into one line and exit 2, tested above)."""
    from megatron_zb.megatron_lm import configure
    from megatron_zb.training.arguments.common import ArgumentError

    args = loop_flags(*argv)
    args.num_experts = experts  # Megatron-LM's --num-experts
    with pytest.raises(ArgumentError, match=re.escape(message)):
        configure(args)


def test_configure_refuses_sharded_gradients_without_megatron_fsdp() -> None:
    """``--data-parallel-sharding-strategy optim_grads`` configures Megatron FSDP in Megatron-LM (ignored without
    ``--use-megatron-fsdp``); with a zero-bubble schedule it would mean megatron-zb's sharded gradients, which
    run in ``pretrain_gpt_zb.py`` only so far: refused by name. Megatron-LM's default (``no_shard`` on core_v0.16.1,
    ``optim_grads_params`` on core_v0.19.0, FSDP's) is not."""
    from megatron_zb.megatron_lm import configure
    from megatron_zb.training.arguments.common import ArgumentError

    args = loop_flags("--enable-zero-bubble")
    args.data_parallel_sharding_strategy = "optim_grads"  # Megatron-LM's flag (its parser, not the plugin's)
    with pytest.raises(ArgumentError, match=re.escape("--data-parallel-sharding-strategy: optim_grads without "
                                                      "--use-megatron-fsdp is megatron-zb's sharded gradients")):
        configure(args)
    for default in ("no_shard", "optim_grads_params"):
        args = loop_flags("--enable-zero-bubble")
        args.data_parallel_sharding_strategy = default
        assert configure(args)["schedule"] == "zb"


def test_configure_profiles_cost_aware_schedules_with_profile_out() -> None:
    from megatron_zb.megatron_lm import configure

    args = loop_flags("--enable-zero-bubble", "--profile-out", "p.json")
    assert configure(args) == {"schedule": "zb", "timeout": 300.0, "memory_limit": 2.0}
    assert args.zero_bubble_max_pending_backward == 2  # resolved: PP (ZB-1p), as pretrain_gpt_zb.py does


def test_a_v_schedule_is_accepted_on_every_release() -> None:
    """Chosen by either flag, a V schedule is accepted on the installed release -- core_v0.16.1 and
    core_v0.19.0 alike (core_v0.19.0 refused it until its builder route existed) -- and given
    Megatron-LM's two chunks per rank. Where the V's chunks are built is per release
    (``megatron_compat.MEGATRON_LM_LOOP``'s ``v_model_builder``: core_v0.19.0's ``GPTModelBuilder``;
    core_v0.16.1: the script's provider through ``v_model_provider``); both train in their loops:
    tests/megatron_lm/test_megatron_lm_v.py. What the V still cannot have is refused by name
    (:func:`test_a_bad_zero_bubble_flag_exits_2_before_any_process_group`, and test_megatron_lm_v.py)."""
    from megatron_zb.megatron_lm import configure

    for argv in (("--zero-bubble-v-schedule",), ("--schedule", "zbv")):
        args = loop_flags(*argv)
        args.tensor_model_parallel_size, args.overlap_p2p_comm, args.rank = 1, True, 1  # what check_v reads
        assert configure(args) == {"schedule": "zbv", "timeout": 300.0, "num_chunks": 2, "v_flag": argv[0]}
        assert args.num_virtual_stages_per_pipeline_rank == 2
    assert (megatron_lm_loop().v_model_builder is None) == (megatron_lm_tag() == "core_v0.16.1")

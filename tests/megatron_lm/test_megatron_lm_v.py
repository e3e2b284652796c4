"""V schedules inside NVIDIA Megatron-LM's own training loop (``pretrain_gpt.py`` of core_v0.16.1 with
megatron-core 0.16.1, or of core_v0.19.0 with megatron-core 0.19.x), on CPU.

The user's change (docs/megatron_lm.md) is applied to Megatron-LM's ``pretrain_gpt.py`` text before
it runs (``run_megatron_lm(script_edit=...)``; the file is untouched): the two lines of the flags
route first in its ``__main__`` block, and, where Megatron-LM builds the model through the script's
model provider (core_v0.16.1; ``megatron_compat.MEGATRON_LM_LOOP``'s ``v_model_builder`` is
``None``), that provider passed to ``pretrain()`` through ``megatron_zb.megatron_lm.v_model_provider``
(core_v0.19.0 builds it with its ``GPTModelBuilder``, which the V route wraps: the two lines
only). Three runs of the same script, tiny GPT (tied
embeddings), PP=2, 4 iterations of 4 micro batches: megatron-core's own 1F1B (no zero-bubble flag:
the wrapper passes Megatron-LM's arguments through), ``--zero-bubble-v-schedule`` (ZB-V: layers 0
and 3 on rank 0, 1 and 2 on rank 1), and the same with ``--bf16``. A V schedule *without* the
wrapper on core_v0.16.1 is
``tests/megatron_lm/test_megatron_lm_loop.py::test_a_bad_zero_bubble_flag_exits_2_before_any_process_group``.

Same model in both runs: Megatron-LM draws each rank's weights in construction order, so the V
(other layers on each rank) would start elsewhere; both runs therefore use
``--use-cpu-initialization`` and the test plugin
:func:`~harness.layer_seeding.seed_layers_by_global_number` (each layer's weights from a
seed of its global number; the embedding is drawn first on rank 0 in both). Dropout is off
(``--hidden-dropout 0 --attention-dropout 0``): its masks come from each rank's RNG stream in
execution order, which the V changes (rank 0 runs layers 0 and 3), so with dropout the runs would
not compute the same function.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import re
from typing import Any

import pytest
import torch

from megatron_zb.megatron_compat import megatron_lm_loop
from harness.megatron_lm import (CPU_FLAGS, MOCK_DATA_FLAGS, SKIP_REASON, TINY_GPT_FLAGS, MegatronLMRun,
                                             find_megatron_lm, run_megatron_lm)

ITERS = 4
TIMEOUT_S = 240.0
MCORE_1F1B = "megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_without_interleaving"
V_FUNC = "megatron_zb.megatron_lm.v.VForwardBackward"
RTOL = 1e-6
"""Relative tolerance of each iteration's lm loss and grad norm (V vs 1F1B; measured at most 1.3e-7).
The forward arithmetic is the same (iteration 1's loss is asserted bitwise), but the V sums the tied
embedding's two gradients (input embedding, output layer) into one parameter in its own micro-batch
order where 1F1B all-reduces the two copies, and its per-rank grad-norm partial sums group other
parameters: rounding differences of one or two ulps, which later steps carry on."""
PARAM_TOL = 5e-4
"""Every parameter after training within this fraction of its tensor's largest magnitude. Measured:
1.0e-4 on the attention QKV biases -- the key bias's gradient is analytically zero (softmax is
invariant to a shift of the scores), so what is computed is rounding noise, another noise in the
V's summation order, and Adam's normalised update turns it into learning-rate-sized steps -- and at
most 3.1e-6 on every other tensor."""

INSTALL_EDIT = ('if __name__ == "__main__":\n', 'if __name__ == "__main__":\n'
                '    import megatron_zb.megatron_lm\n    megatron_zb.megatron_lm.install()\n')
PROVIDER_EDIT = ("partial(model_provider, gpt_builder),",
                 "megatron_zb.megatron_lm.v_model_provider(partial(model_provider, gpt_builder)),")
SCRIPT_EDIT = (INSTALL_EDIT, PROVIDER_EDIT) if megatron_lm_loop().v_model_builder is None else (INSTALL_EDIT,)
"""The documented change of the user's ``pretrain_gpt.py`` for V schedules, per release (the
provider wrapper where Megatron-LM builds the model through the script's provider)."""
SEED_PLUGIN = ("from harness.layer_seeding import seed_layers_by_global_number\n"
               "seed_layers_by_global_number()\n")
PP2_NO_DROPOUT = (*CPU_FLAGS, *MOCK_DATA_FLAGS, *TINY_GPT_FLAGS, "--pipeline-model-parallel-size", "2",
                  "--global-batch-size", "8", "--train-iters", str(ITERS), "--use-cpu-initialization",
                  "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-interval", "2", "--eval-iters", "1")
"""Tiny GPT, PP=2, dropout off, one evaluation iteration after iterations 2 and 4 (and on the
validation and test sets at the end): Megatron-LM's ``evaluate`` calls
``forward_backward_func(forward_only=True)``, whose losses the V also hands to the last rank."""

_MISSING = [m for m in ("yaml", "regex", "pydantic") if importlib.util.find_spec(m) is None]


def needs_megatron_lm(test: Any) -> Any:
    """Skip ``test`` without Megatron-LM's files or its training package's imports."""
    test = pytest.mark.skipif(find_megatron_lm() is None, reason=SKIP_REASON)(test)
    return pytest.mark.skipif(bool(_MISSING), reason=f"Megatron-LM's training package imports {_MISSING}: "
                                                     "pip install -e '.[test]'")(test)


def _run(*extra: str) -> MegatronLMRun:
    return run_megatron_lm([*PP2_NO_DROPOUT, *extra], world_size=2, timeout=TIMEOUT_S, plugin=SEED_PLUGIN,
                           params=True, script_edit=SCRIPT_EDIT)


@pytest.fixture(scope="module")
def mcore_1f1b() -> MegatronLMRun:
    """megatron-core's own 1F1B, the wrapper in the script but no zero-bubble flag."""
    return _run()


@pytest.fixture(scope="module")
def zbv() -> MegatronLMRun:
    return _run("--zero-bubble-v-schedule")


@pytest.fixture(scope="module")
def zbv_bf16() -> MegatronLMRun:
    return _run("--zero-bubble-v-schedule", "--bf16")


MOE_UNTIED = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2", "--disable-bias-linear",
              "--untie-embeddings-and-output-weights")
"""Every layer a top-2 MoE of 4 experts (expert parallelism 1; Megatron-LM builds it from megatron-core's
``get_gpt_decoder_block_spec``), with the aux loss (without it Megatron-LM's MoE logging makes a CUDA
tensor on this CPU build) and no biases (megatron-core's biased experts modify an autograd view in
place: an error in its own 1F1B), and untied embeddings (the output layer a weight of its own)."""


@pytest.fixture(scope="module")
def mcore_1f1b_moe() -> MegatronLMRun:
    """megatron-core's own 1F1B, MoE and untied embeddings (:data:`MOE_UNTIED`)."""
    return _run(*MOE_UNTIED)


@pytest.fixture(scope="module")
def zbv_moe() -> MegatronLMRun:
    return _run("--zero-bubble-v-schedule", *MOE_UNTIED)


def validation_losses(run: MegatronLMRun) -> list[tuple[str, float]]:
    """``(where, lm loss)`` of each `` validation loss at ... | lm loss value: X |`` line of the last rank."""
    return [(m.group(1) + m.group(2), float(m.group(3))) for m in
            re.finditer(r" validation(.*?) loss at (.*?) \| lm loss value: ([0-9.E+-]+) \|", run.logs[-1])]


def global_params(run: MegatronLMRun, stage_of: Any, layers_per_stage: int) -> dict[str, torch.Tensor]:
    """Every rank's parameters under the whole model's names (``decoder.layers.<global>``);
    ``stage_of(rank, chunk)`` is the placement's stage of a rank's chunk."""
    assert run.params is not None
    out: dict[str, torch.Tensor] = {}
    for rank, params in enumerate(run.params):
        for key, value in params.items():
            chunk, name = re.match(r"chunk(\d+)\.(.*)$", key).groups()  # type: ignore[union-attr]
            layer = re.match(r"decoder\.layers\.(\d+)\.(.*)$", name)
            if layer:
                index = stage_of(rank, int(chunk)) * layers_per_stage + int(layer.group(1))
                name = f"decoder.layers.{index}.{layer.group(2)}"
            assert name not in out or name == "output_layer.weight", f"{name} held twice"
            out[name] = value
    return out


@needs_megatron_lm
def test_zbv_in_megatron_lm_loop_matches_megatron_core_1f1b(mcore_1f1b: MegatronLMRun, zbv: MegatronLMRun) -> None:
    for run, func in ((mcore_1f1b, MCORE_1F1B), (zbv, V_FUNC)):
        assert [it.iteration for it in run.iterations] == list(range(1, ITERS + 1)), run.logs[-1][-2000:]
        assert {it.forward_backward for it in run.iterations} == {func}
        assert all(r == run.grad_norms for r in run.grad_norms_by_rank)
        assert all(x is not None and math.isfinite(x) for x in run.lm_losses + run.grad_norms)
    # the last pipeline rank logs the losses the V computed on rank 0 (handed over by VForwardBackward)
    assert zbv.lm_losses[0] == mcore_1f1b.lm_losses[0]  # bitwise: the same model, weights and data
    for n, (got, ref) in enumerate(zip(zbv.lm_losses + zbv.grad_norms, mcore_1f1b.lm_losses + mcore_1f1b.grad_norms)):
        what = f"{'lm loss' if n < ITERS else 'grad norm'} of iteration {n % ITERS + 1}"
        assert abs(got - ref) <= RTOL * abs(ref), f"{what}: zbv {got!r} vs 1F1B {ref!r}"
    assert zbv.lm_losses[-1] < zbv.lm_losses[0]

    evaluated = [validation_losses(run) for run in (zbv, mcore_1f1b)]
    assert len(evaluated[1]) == 4, evaluated[1]  # iterations 2 and 4; at the end the validation and test sets
    assert [where for where, _ in evaluated[0]] == [where for where, _ in evaluated[1]]
    for (where, got), (_, ref_loss) in zip(*evaluated):  # printed with 7 significant digits
        assert abs(got - ref_loss) <= 1e-5 * ref_loss, f"validation loss at {where}: zbv {got} vs 1F1B {ref_loss}"

    ref = global_params(mcore_1f1b, lambda rank, chunk: rank, layers_per_stage=2)
    got = global_params(zbv, lambda rank, chunk: rank if chunk == 0 else 3 - rank, layers_per_stage=1)
    assert torch.equal(ref.pop("output_layer.weight"), ref["embedding.word_embeddings.weight"])  # 1F1B's tied copy
    assert got.keys() == ref.keys()  # the V's loss chunk has no output weight: it uses the embedding parameter
    assert {f"decoder.layers.{i}.self_attention.linear_qkv.weight" for i in range(4)} <= got.keys()
    for name in sorted(ref):
        scale = ref[name].abs().max().item()
        assert (got[name] - ref[name]).abs().max().item() <= PARAM_TOL * scale, name


@needs_megatron_lm
def test_zbv_reports_the_v_and_defers_w(zbv: MegatronLMRun) -> None:
    """The V's set-up said once on rank 0, Megatron-LM's own virtual-pipeline line, and zbv profiled
    and re-planned (default window 2-3) with a W time measured on each of the 4 stages: B and W ran
    as separate actions, W deferred."""
    log = zbv.logs[0]
    assert log.count("megatron-zb: setting --num-virtual-stages-per-pipeline-rank 2: --zero-bubble-v-schedule zbv "
                     "places 2 model chunks per pipeline rank (the V)") == 1
    assert "Number of virtual stages per pipeline stage: 2" in log
    report = log[log.index("> schedule report after profiling iterations 2-3 "):]
    assert "    re-planned 'zbv' from the measured costs in " in report
    per_stage = re.search(r"measured per stage \(ms\): T_F=\[(.*?)\]; T_B=\[(.*?)\]; T_W=\[(.*?)\]\n", report)
    assert per_stage is not None
    assert [float(v) > 0 for v in per_stage.group(3).split(", ")] == [True] * 4


@needs_megatron_lm
def test_zbv_with_bf16_in_megatron_lm_loop(mcore_1f1b: MegatronLMRun, zbv_bf16: MegatronLMRun) -> None:
    """``--bf16``: Megatron-LM's ``get_model`` wraps each chunk in megatron-core's ``Float16Module``,
    made V-aware (half-precision inputs on stage 0, fp32 outputs on the loss stage; megatron-core's
    own decides by pipeline rank and virtual stage, which does not match the V). Against the fp32
    1F1B run: bf16 arithmetic, so the losses differ (iteration 1: measured 2.9e-5 relative) but stay
    within 1e-3 (measured <= 2.0e-4) and the grad norms within 2e-2 (measured <= 7.4e-3). Measured
    once against megatron-core's bf16 1F1B too (not a test: a fourth run): iteration 1 bitwise,
    losses within 2.3e-5, grad norms within 7.5e-4."""
    run = zbv_bf16
    assert [it.iteration for it in run.iterations] == list(range(1, ITERS + 1)), run.logs[-1][-2000:]
    assert {it.forward_backward for it in run.iterations} == {V_FUNC}
    assert "  bf16 ............................................ True" in run.logs[0]  # Megatron-LM's argument dump
    assert run.lm_losses[0] != mcore_1f1b.lm_losses[0]  # bf16 is in effect
    for got, ref in zip(run.lm_losses, mcore_1f1b.lm_losses):
        assert abs(got - ref) <= 1e-3 * ref, (run.lm_losses, mcore_1f1b.lm_losses)
    for got, ref in zip(run.grad_norms, mcore_1f1b.grad_norms):
        assert abs(got - ref) <= 2e-2 * ref, (run.grad_norms, mcore_1f1b.grad_norms)
    assert run.lm_losses[-1] < run.lm_losses[0]


def printed(run: MegatronLMRun, field: str) -> list[str]:
    """``field``'s printed value in each of the last rank's iteration lines."""
    return [re.search(rf"\| {field}: ([^ |]+) \|", it.line).group(1) for it in run.iterations]  # type: ignore[union-attr]


@needs_megatron_lm
def test_zbv_with_moe_and_untied_embeddings_matches_megatron_core_1f1b(mcore_1f1b_moe: MegatronLMRun,
                                                                       zbv_moe: MegatronLMRun) -> None:
    """The V's chunks built through Megatron-LM's MoE block spec (each chunk's layout a megatron-core
    ``PipelineParallelLayerLayout`` answering by the V stage: layers 0 and 3 on rank 0), untied
    embeddings: the same initial weights as 1F1B (the test plugin seeds the untied output layer as
    well), so iteration 1's lm loss is bitwise equal (measured: its grad norm too, on both releases),
    and the rest within the tolerances of the dense test (measured <= 1.1e-7 relative). The aux loss
    (``load_balancing_loss``, summed over the layers by their global numbers) prints the same."""
    for run, func in ((mcore_1f1b_moe, MCORE_1F1B), (zbv_moe, V_FUNC)):
        assert [it.iteration for it in run.iterations] == list(range(1, ITERS + 1)), run.logs[-1][-2000:]
        assert {it.forward_backward for it in run.iterations} == {func}
    assert zbv_moe.lm_losses[0] == mcore_1f1b_moe.lm_losses[0]  # bitwise: same weights, data, arithmetic
    for got, ref in zip(zbv_moe.lm_losses + zbv_moe.grad_norms, mcore_1f1b_moe.lm_losses + mcore_1f1b_moe.grad_norms):
        assert abs(got - ref) <= RTOL * abs(ref), (zbv_moe.lm_losses, zbv_moe.grad_norms)
    assert printed(zbv_moe, "load_balancing_loss")[0] == printed(mcore_1f1b_moe, "load_balancing_loss")[0]
    ref = global_params(mcore_1f1b_moe, lambda rank, chunk: rank, layers_per_stage=2)
    got = global_params(zbv_moe, lambda rank, chunk: rank if chunk == 0 else 3 - rank, layers_per_stage=1)
    assert got.keys() == ref.keys()
    assert "output_layer.weight" in got  # untied: the V's loss chunk holds its own
    assert {f"decoder.layers.{i}.mlp.experts.local_experts.3.linear_fc1.weight" for i in range(4)} <= got.keys()
    for name in sorted(ref):
        scale = ref[name].abs().max().item()
        assert (got[name] - ref[name]).abs().max().item() <= PARAM_TOL * scale, name


# ---------------------------------------------------------------------- configure(), no Megatron-LM run
def _flags(*argv: str, **megatron_lm: Any) -> argparse.Namespace:
    """The zero-bubble flags parsed as on Megatron-LM's parser, beside the Megatron-LM values
    configure() reads (PP=2, 8 layers, TP=1, fp32; ``megatron_lm`` overrides)."""
    from megatron_zb.megatron_lm import add_flags

    parser = argparse.ArgumentParser()
    add_flags(parser)
    values = dict(pipeline_model_parallel_size=2, tensor_model_parallel_size=1, num_layers=8, rank=1,
                  num_layers_per_virtual_pipeline_stage=None, num_virtual_stages_per_pipeline_rank=None,
                  num_experts=None, fp16=False, bf16=False, overlap_p2p_comm=True)
    return parser.parse_args(argv, namespace=argparse.Namespace(**{**values, **megatron_lm}))


@pytest.mark.parametrize("argv,schedule,flag", [
    (("--zero-bubble-v-schedule",), "zbv", "--zero-bubble-v-schedule"),
    (("--zero-bubble-v-schedule", "--zero-bubble-v-schedule-mem-setup", "half"), "v-half", "--zero-bubble-v-schedule"),
    (("--zero-bubble-v-schedule", "--zero-bubble-v-schedule-mem-setup", "min"), "v-min", "--zero-bubble-v-schedule"),
    (("--schedule", "zbv"), "zbv", "--schedule"),
])
def test_configure_sets_two_chunks_per_rank_for_a_v(argv: tuple[str, ...], schedule: str, flag: str) -> None:
    from megatron_zb.megatron_lm import configure

    args = _flags(*argv)
    assert configure(args) == {"schedule": schedule, "timeout": 300.0, "num_chunks": 2, "v_flag": flag}
    assert args.num_virtual_stages_per_pipeline_rank == 2  # Megatron-LM derives its virtual pipeline size from it
    args = _flags(*argv, num_layers_per_virtual_pipeline_stage=2)  # 8 layers / 4 stages: the V's own value
    assert configure(args)["num_chunks"] == 2 and args.num_virtual_stages_per_pipeline_rank is None


@pytest.mark.parametrize("argv,megatron_lm,message", [
    ((), dict(mtp_num_layers=1), "--mtp-num-layers: not supported with the V schedule 'zbv' inside Megatron-LM's "
                                 "loop: the V's loss stage is on pipeline rank 0"),
    ((), dict(use_megatron_fsdp=True), "--use-megatron-fsdp: refused with the zero-bubble schedule 'zbv': "
                                       "megatron-core's Megatron FSDP reduce-scatters"),
    ((), dict(moe_shared_expert_overlap=True), "--moe-shared-expert-overlap: refused with the zero-bubble schedule "
                                               "'zbv': megatron-core runs the shared experts on a second CUDA stream"),
    ((), dict(moe_router_force_load_balancing=True), "--moe-router-force-load-balancing: refused with the zero-bubble "
                                                     "schedule 'zbv': Megatron-LM's benchmark-only routing"),
    ((), dict(tensor_model_parallel_size=2), "--tensor-model-parallel-size: must be 1 with the V schedule 'zbv'"),
    ((), dict(num_layers=6), "--num-layers: 6 layers do not split evenly into the V's 4 stages"),
    ((), dict(num_virtual_stages_per_pipeline_rank=3), "--num-virtual-stages-per-pipeline-rank: 'zbv' places 2 "
                                                      "model chunks per rank"),
    ((), dict(num_layers_per_virtual_pipeline_stage=1), "--num-layers-per-virtual-pipeline-stage: 'zbv' has 2 "
                                                        "layers per stage"),
    ((), dict(overlap_p2p_comm=False), "--no-overlap-p2p-communication: Megatron-LM refuses it at PP <= 2"),
    (("--schedule", "zb"), {}, "--zero-bubble-v-schedule: cannot be combined with --schedule"),
])
def test_configure_refuses_what_the_v_cannot_have(argv: tuple[str, ...], megatron_lm: dict[str, Any],
                                                  message: str) -> None:
    """Refused with the flag named (install() turns it into one line and exit 2)."""
    from megatron_zb.megatron_lm import configure
    from megatron_zb.training.arguments.common import ArgumentError

    with pytest.raises(ArgumentError, match=re.escape(message)):
        configure(_flags("--zero-bubble-v-schedule", *argv, **megatron_lm))


def test_v_mem_setup_needs_the_v_flag() -> None:
    from megatron_zb.megatron_lm import configure
    from megatron_zb.training.arguments.common import ArgumentError

    with pytest.raises(ArgumentError, match="--zero-bubble-v-schedule-mem-setup: only applies to V schedules"):
        configure(_flags("--zero-bubble-v-schedule-mem-setup", "half"))


def test_the_wrapper_passes_megatron_lm_arguments_through_without_a_v() -> None:
    """No V schedule installed: the user's provider gets exactly get_model's arguments."""
    from megatron_zb.megatron_lm import v_model_provider

    calls = []
    wrapped = v_model_provider(lambda **kw: calls.append(kw) or "model")
    assert wrapped(pre_process=True, post_process=False, config="cfg", pg_collection="pg") == "model"
    assert calls == [dict(pre_process=True, post_process=False, vp_stage=None, config="cfg", pg_collection="pg")]


def test_script_edit_replaces_exactly_once() -> None:
    """The harness's ``script_edit`` (what this file's runs apply to pretrain_gpt.py) refuses an edit
    whose text is missing or ambiguous rather than running an unedited script."""
    import json

    from harness.megatron_lm_main import edit_script

    text = "a\nif __name__ == \"__main__\":\n    pretrain(x)\n"
    assert edit_script(text, json.dumps([["pretrain(x)", "pretrain(f(x))"]])) == text.replace("(x)", "(f(x))")
    assert edit_script(text, "") == text
    for old in ("missing", "\n"):
        with pytest.raises(ValueError, match="script edit: .* occurs [03] times in pretrain_gpt.py, not once"):
            edit_script(text, json.dumps([[old, "y"]]))


def test_a_v_chunk_layout_is_megatron_core_s_and_answers_by_the_v_stage() -> None:
    """What lets megatron-core's ``get_gpt_decoder_block_spec`` (Megatron-LM's MoE model) build a V chunk:
    the chunk config's layout is a ``PipelineParallelLayerLayout`` (it asserts that type) whose answers
    are the V stage's global layers, whatever rank or virtual stage is named; it survives pickling and
    deep copies (rebuilt from the plan). In the loop: test_zbv_with_moe_and_untied_embeddings_*."""
    import copy
    import pickle

    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    from megatron_zb.megatron_lm.v import as_megatron_layout
    from megatron_zb.model import plan_chunks

    plan = plan_chunks(num_layers=8, stage_to_rank=[0, 1, 1, 0])[3]  # the loss stage, on rank 0: layers 6-7
    made = as_megatron_layout(plan)
    for layout in (made, pickle.loads(pickle.dumps(made)), copy.deepcopy(made)):
        assert isinstance(layout, PipelineParallelLayerLayout)
        assert layout.get_layer_id_list(LayerType.decoder, vp_stage=1, pp_rank=0) == [6, 7]
        assert layout.get_layer_offset(LayerType.decoder, vp_stage=None, pp_rank=1) == 6
        assert layout.get_num_layers_to_build(LayerType.decoder) == 2
        assert layout.layout[0][0] == [LayerType.decoder] * 2


def test_configure_accepts_moe_with_a_v() -> None:
    from megatron_zb.megatron_lm import configure

    assert configure(_flags("--zero-bubble-v-schedule", num_experts=4))["schedule"] == "zbv"

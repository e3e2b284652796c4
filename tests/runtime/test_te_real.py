"""The Transformer Engine route with real TE modules on a GPU (``scripts/gpu_selftest.sh --full``, job ``te-parity``).

Skipped without Transformer Engine, without CUDA (``MEGATRON_ZB_TEST_DEVICE=cuda``) and, for
FP8, on a GPU without FP8 -- each with its reason. Not run yet: no GPU was lent to the sessions
that wrote them. Their checks are the CPU tests' own: bitwise equality with megatron-core's 1F1B
without delaying (:func:`~megatron_zb.testing.tiny_gpt.assert_bitwise_equal`) and the count check
:func:`~megatron_zb.testing.tiny_gpt.check_te_run`, both run on CPU against the test double by
``tests/runtime/test_te_contract.py``. The MoE grouped-GEMM GPT has no double; its ``GroupedLinear``
handling is checked on CPU per module under megatron-core DDP
(``test_te_contract.py::test_grouped_linear_b_time_buffer_never_reaches_main_grad``).
"""

from __future__ import annotations

import os
from functools import partial

import pytest

import megatron_zb  # noqa: F401  (CPU shim)
from megatron_zb.testing import run_distributed
from megatron_zb.testing.tiny_gpt import TinyGPT, assert_bitwise_equal, check_te_run, run_step

TE_SPEC = "megatron_zb.runtime.te_route:te_layer_spec"
TE_MODULES_PER_LAYER = 4  # linear_qkv, linear_proj, linear_fc1, linear_fc2
REAL_TE = dict(pp=2, num_layers=4, hidden=64, heads=4, seq=16, vocab=64, num_microbatches=4)


def _require_real_te(*, fp8: bool = False) -> None:
    from megatron_zb.runtime.te_route import transformer_engine_version

    if transformer_engine_version() is None:
        pytest.skip("Transformer Engine is not installed")
    if os.environ.get("MEGATRON_ZB_TEST_DEVICE", "cpu") != "cuda":
        pytest.skip("Transformer Engine needs CUDA: set MEGATRON_ZB_TEST_DEVICE=cuda")
    if fp8:
        from transformer_engine.pytorch.fp8 import check_fp8_support

        ok, why = check_fp8_support()
        if not ok:
            pytest.skip(f"FP8 is not supported on this GPU: {why}")


def _real_te_parity(base: dict, schedule: str, *, te_modules: int, layer_spec: str = TE_SPEC) -> dict:
    """megatron-core's 1F1B without delaying against ``schedule`` with TE's delayed weight
    gradients, PP=2: bitwise equal gradients (``main_grad`` with DDP), and :func:`check_te_run`."""
    ref = TinyGPT.merge(run_distributed(partial(run_step, TinyGPT(**base, layer_spec=layer_spec), schedule=None),
                                        world_size=2, timeout=300))
    got = TinyGPT.merge(run_distributed(partial(run_step, TinyGPT(**base, layer_spec=layer_spec, delay_wgrad=True),
                                                schedule=schedule), world_size=2, timeout=300))
    assert_bitwise_equal(ref, got, what=f"real TE {schedule}")
    check_te_run(got, te_modules=te_modules, microbatches=base["num_microbatches"], split=True)
    return got


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-2p", "zbv"])
def test_real_transformer_engine_delayed_matches_non_delayed(schedule):
    _require_real_te()
    _real_te_parity(REAL_TE, schedule, te_modules=TE_MODULES_PER_LAYER * REAL_TE["num_layers"])


def test_real_transformer_engine_fp8_linear_biases_main_grad():
    """FP8 (current per-tensor scaling: no amax history, so the schedules' different orders of
    forwards cannot change the scales) with linear biases under megatron-core DDP: TE computes
    linear_qkv's GEMM-internal bias gradient in B; main_grad equals the non-delayed run's."""
    _require_real_te(fp8=True)
    base = dict(REAL_TE, ddp=True, config_options={"fp8": "hybrid", "fp8_recipe": "tensorwise",
                                                   "add_bias_linear": True})
    got = _real_te_parity(base, "zb-2p", te_modules=TE_MODULES_PER_LAYER * REAL_TE["num_layers"])
    assert any(n.endswith("linear_qkv.bias") for n in got["grads"])


@pytest.mark.parametrize("fusion", [False, True], ids=["unfused", "fused-accumulation"])
def test_real_transformer_engine_moe_grouped_gemm_main_grad(fusion):
    """MoE experts in TE's GroupedLinear (``--moe-grouped-gemm``), with and without fused
    accumulation, under megatron-core DDP: main_grad equals the non-delayed run's (TE >= 2.8
    without fused accumulation returns its uninitialised packed buffer in B, which must never
    reach main_grad). TE modules per layer: linear_qkv, linear_proj and the experts' two
    GroupedLinear (the router is not a TE module)."""
    _require_real_te()
    base = dict(REAL_TE, ddp=True, gradient_accumulation_fusion=fusion,
                config_options={"num_moe_experts": 4, "moe_grouped_gemm": True, "moe_router_topk": 2,
                                "moe_ffn_hidden_size": 96, "add_bias_linear": False})
    _real_te_parity(base, "zb-2p", te_modules=4 * REAL_TE["num_layers"],
                    layer_spec="megatron_zb.testing.tiny_gpt:te_moe_grouped_gemm_layer_spec")

"""The zero-bubble runtime on real megatron-core GPT chunks, real gloo processes.

Every schedule's loss and gradients are compared with megatron-core's own 1F1B
(``forward_backward_pipelining_without_interleaving``) on the same weights and data.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

import megatron_zb  # noqa: F401  (CPU shim)
from megatron_zb.testing import run_distributed
from megatron_zb.testing.tiny_gpt import TinyGPT, run_step

PP2_SCHEDULES = ["1f1b", "zb-h1", "zb-h2", "zb", "zb-2p"]


def _assert_same(ref: dict, got: dict, *, bitwise: bool, what: str) -> None:
    assert len(got["losses"]) == len(ref["losses"]) > 0
    for a, b in zip(got["losses"], ref["losses"]):
        if bitwise:
            assert torch.equal(a, b), f"{what}: loss {a} != {b}"
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=0)
    assert got["grads"].keys() == ref["grads"].keys()
    for n, g in ref["grads"].items():
        if bitwise:
            assert torch.equal(got["grads"][n], g), f"{what}: gradient of {n} differs"
        else:
            torch.testing.assert_close(got["grads"][n], g, rtol=1e-5, atol=1e-7, msg=lambda m: f"{what} {n}: {m}")


@pytest.fixture(scope="module")
def pp2_reference() -> dict:
    return TinyGPT.merge(run_distributed(partial(run_step, TinyGPT(pp=2), schedule=None), world_size=2, timeout=90))


@pytest.mark.parametrize("schedule", PP2_SCHEDULES)
def test_pp2_schedules_match_megatron_1f1b_bitwise(pp2_reference, schedule):
    got = TinyGPT.merge(run_distributed(partial(run_step, TinyGPT(pp=2), schedule=schedule), world_size=2,
                                        timeout=90))
    _assert_same(pp2_reference, got, bitwise=True, what=schedule)
    if schedule != "1f1b":
        assert got["w_deferred"] > 0, "the split-backward schedule must have deferred weight gradients to W"

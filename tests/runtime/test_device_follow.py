"""Tensors created by the code issue 29 changed follow the device they are given (meta device).

What this proves: with parameters on the ``meta`` device, the tensors ``dummy_wgrad`` (the
linear route's B-time dummy weight gradient) and the checkpoint repairs of torch Adam's state
(``materialize_adam_state``, ``give_each_param_its_step``) create are on ``meta`` where they
must follow the parameter, and on the CPU exactly where torch's own Adam keeps ``step`` there
(neither fused nor capturable). A forgotten ``device=`` would put them on the CPU and fail here.

What it does not prove: that CUDA arithmetic or NCCL collectives with these tensors work (the
meta device does not raise on mixed CPU/meta arithmetic, and no GPU runs here); nor anything
about ``gather_losses``'s staging tensor (now ``device=buf.device``; exercising it needs a
process group and a readable result, so only the lint covers it), nor the executor's token
counter (pending in tests/platform/test_device_lint.py). ``scripts/gpu_selftest.sh`` is the GPU check.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_zb.runtime.linear_route import dummy_wgrad
from megatron_zb.training.checkpointing import adam_step, give_each_param_its_step, materialize_adam_state

META = torch.device("meta")


def _meta_param(*shape: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(*shape, device=META))


@pytest.mark.parametrize("zero_out", [False, True])
def test_dummy_wgrad_takes_the_weight_device(zero_out):
    w = _meta_param(4, 3)
    w.grad_added_to_main_grad = False
    w.zero_out_wgrad = zero_out
    g = dummy_wgrad(w)
    assert g.device.type == "meta" and g.shape == w.shape and g.dtype == w.dtype and w.grad_added_to_main_grad


def _adam_on_meta() -> tuple[torch.optim.Adam, torch.nn.Parameter, torch.nn.Parameter]:
    """Adam with a capturable group (step on the parameter's device) and a plain one (step on CPU)."""
    on_device, plain = _meta_param(3), _meta_param(2)
    return torch.optim.Adam([{"params": [on_device], "capturable": True}, {"params": [plain]}]), on_device, plain


def test_materialized_adam_state_follows_the_parameter():
    opt, on_device, plain = _adam_on_meta()
    materialize_adam_state(SimpleNamespace(optimizer=opt))
    assert {k: v.device.type for k, v in opt.state[on_device].items()} == dict.fromkeys(
        ("step", "exp_avg", "exp_avg_sq"), "meta")
    assert opt.state[plain]["step"].device.type == "cpu"  # torch's Adam hosts it there on purpose
    assert opt.state[plain]["exp_avg"].device.type == "meta"


def test_restored_adam_steps_follow_the_parameter():
    opt, on_device, plain = _adam_on_meta()
    materialize_adam_state(SimpleNamespace(optimizer=opt))
    give_each_param_its_step(SimpleNamespace(optimizer=opt), [7.0])
    assert opt.state[on_device]["step"].device.type == "meta"
    assert opt.state[plain]["step"].device.type == "cpu" and opt.state[plain]["step"].item() == 7.0
    assert opt.state[on_device]["step"] is not opt.state[plain]["step"]


@pytest.mark.parametrize("flags", [{}, {"fused": True}])
def test_adam_step_matches_what_torch_adam_creates(flags):
    """On CPU (where torch's Adam can step): our ``step`` has the device and dtype of torch's own.
    (A capturable Adam refuses to step on CPU; the meta tests above cover that placement.)"""
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    group = {"params": [p], **flags}
    opt = torch.optim.Adam([group])
    opt.step()
    theirs = opt.state[p]["step"]
    ours = adam_step(1.0, param=p, group=opt.param_groups[0])
    assert (ours.device, ours.dtype, ours.item()) == (theirs.device, theirs.dtype, theirs.item())

"""Every private megatron-core API megatron-zb touches, in one place.

megatron-zb is a plugin: it imports megatron-core's public API freely, but some of what it needs
is private (underscore names, module internals, functions megatron-core does not export, objects it
patches). Each such use lives here, under the part of megatron-zb that needs it, so that one file
is reviewed at each megatron-core upgrade (pinned: megatron-core 0.16.1). Anything here may break
on upgrade; nothing outside this module reaches into megatron-core's private names.
"""

from __future__ import annotations

# ----------------------------------------------------------------------------------- runtime
# (the weight-gradient store's routes into megatron-core's layers, the executor's use of the
# schedules module's internals)


# ---------------------------------------------------------------------------- platform shim
# (what the CPU shim replaces inside megatron-core when CUDA is absent)


# --------------------------------------------------------------------------------- optimizer
# (what post-validation reads and calls inside megatron-core's optimizers)
# Callers: megatron_zb.optimizer.grad_stats and megatron_zb.optimizer.parts. Each function mirrors
# a named piece of megatron-core 0.16.1 (megatron/core/optimizer/{optimizer,clip_grads}.py);
# re-read that piece at an upgrade. Public megatron-core names (classes, config fields,
# get_grad_stats_parallel_group, clip_grad_by_total_norm_fp32, ...) are used directly there.
from typing import TYPE_CHECKING, Any  # noqa: E402  (this section's own imports)

if TYPE_CHECKING:
    import torch


def multi_tensor_l2_norm(grads: list["torch.Tensor"], overflow_buf: "torch.Tensor") -> "torch.Tensor":
    """The L2 norm of ``grads`` (not squared; a 1-element fp32 tensor) computed by the
    multi-tensor kernel that ``megatron.core.optimizer.clip_grads`` picked at import (Transformer
    Engine, apex or its local fallback), called exactly as ``get_grad_norm_fp32`` calls it.

    Private: ``clip_grads.multi_tensor_applier`` and ``clip_grads.l2_norm_impl`` are that module's
    internals. ``overflow_buf``: a 1-element int tensor, as megatron's ``dummy_overflow_buf``.
    """
    from megatron.core.optimizer import clip_grads

    grad_norm, _ = clip_grads.multi_tensor_applier(clip_grads.l2_norm_impl, overflow_buf, [list(grads)], False)
    return grad_norm


def copy_model_grads_to_main_grads(optimizer: Any) -> None:
    """``MixedPrecisionOptimizer._copy_model_grads_to_main_grads()`` (Float16 / distributed
    optimizer): the first step of its ``prepare_grads``, no collective."""
    optimizer._copy_model_grads_to_main_grads()


def unscale_main_grads_locally_(optimizer: Any, found_inf: "torch.Tensor") -> None:
    """``MixedPrecisionOptimizer._unscale_main_grads_and_check_for_nan()`` without its all-reduce
    of the flag and without resetting it: unscale the main grads in place by the grad scaler's
    ``inv_scale``; set ``found_inf`` (1-element fp32, caller-zeroed) to 1 if any is inf/nan."""
    import torch

    main_grads = optimizer._collect_main_grad_data_for_unscaling()
    if main_grads:
        torch._amp_foreach_non_finite_check_and_unscale_(main_grads, found_inf, optimizer.grad_scaler.inv_scale)


def copy_main_params_to_model_params(optimizer: Any) -> None:
    """The copy half of ``MixedPrecisionOptimizer.step_with_ready_grads()``: refresh the model
    params (or, with ``reuse_grad_buf_for_mxfp8_param_ag``, the param buffer unless the param
    gather is overlapped) from the fp32 main params. No collective."""
    if optimizer.config.reuse_grad_buf_for_mxfp8_param_ag:
        if not optimizer.config.overlap_param_gather:
            optimizer._copy_main_params_to_param_buffer()
    else:
        optimizer._copy_main_params_to_model_params()


# ---------------------------------------------------------------------------------- training
# (megatron-core internals the training loop, data and checkpointing code rely on)

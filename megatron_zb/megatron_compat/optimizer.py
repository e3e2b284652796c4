"""megatron-core's optimizer internals that post-validation reads and calls, per release.

Callers: :mod:`megatron_zb.optimizer.grad_stats` and :mod:`megatron_zb.optimizer.parts`. Each
function mirrors a named piece of megatron-core 0.16.1 and 0.19.x
(``megatron/core/optimizer/{optimizer,clip_grads}.py``); re-read that piece at an upgrade. Public
megatron-core names (classes, config fields, ``get_grad_stats_parallel_group``,
``clip_grad_by_total_norm_fp32``, ...) are used directly there. The release table and the rest of
megatron-core's private names: :mod:`megatron_zb.megatron_compat`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from . import megatron_core_version, release

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
    reuse = optimizer.config.reuse_grad_buf_for_mxfp8_param_ag
    if reuse and release() != "0.16":  # 0.19: only optimizers that own a DDP param buffer
        reuse = hasattr(optimizer, "_copy_main_params_to_param_buffer")
    if reuse:
        if not optimizer.config.overlap_param_gather:
            optimizer._copy_main_params_to_param_buffer()
    else:
        optimizer._copy_main_params_to_model_params()


def grads_for_norm(optimizer: Any) -> list["torch.Tensor"]:
    """The grads megatron-core's grad norm of one optimizer part is taken over:
    ``get_main_grads_for_grad_norm()`` on 0.16.1, ``get_grads_for_grad_norm()`` on 0.19 (renamed;
    the same filter plus GTP duplicates, which are none without GTP)."""
    if release() == "0.16":
        return optimizer.get_main_grads_for_grad_norm()
    return optimizer.get_grads_for_grad_norm()


def unsupported_step_features(part: Any) -> list[str]:
    """What megatron-core's ``step()`` of this release does for ``part`` that post-validation does
    not mirror (empty on 0.16.1). On 0.19: ``grad_norm_skip_threshold`` (skip the update above a
    grad norm) and separate grad-norm groups (parameters tagged with ``grad_norm_group``,
    e.g. MTP layers, clipped by their own norm)."""
    if release() == "0.16":
        return []
    from megatron.core.optimizer import optimizer as opt_module

    found = []
    if math.isfinite(part.config.grad_norm_skip_threshold):
        found.append(f"grad_norm_skip_threshold={part.config.grad_norm_skip_threshold} (megatron-core "
                     f"{megatron_core_version()}; --grad-norm-skip-threshold) is not supported with "
                     "post-validation; leave it at inf")
    attr = opt_module.GRAD_NORM_GROUP_ATTR
    if any(getattr(p, attr, None) is not None for p in part.get_parameters()):
        found.append(f"parameters in a separate grad-norm group ({attr}, e.g. MTP layers; megatron-core "
                     f"{megatron_core_version()}) are not supported with post-validation")
    return found


def zero_count_groups(part: Any, *, chained: bool) -> dict[str, Any]:
    """The groups megatron-core's ``count_zeros`` passes to ``param_is_not_tensor_parallel_duplicate``
    for ``part`` (``chained``: a ``ChainedOptimizer``'s count over every part, ``part`` its first).
    0.16.1: the part's ``tp_group``, none for a chain; 0.19: the (first) part's ``tp_group`` and
    ``expert_tp_group``."""
    if release() == "0.16":
        return {"tp_group": None if chained else getattr(part, "tp_group", None)}
    return {"tp_group": getattr(part, "tp_group", None), "expert_tp_group": getattr(part, "expert_tp_group", None)}


def param_counts_for_zeros(param: Any, groups: dict[str, Any]) -> bool:
    """``count_zeros_fp32``'s filter (besides grad not None): not shared, not a TP duplicate, and
    on 0.19 not a GTP duplicate (``param_is_not_gtp_duplicate``)."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    counted = param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param, **groups)
    if counted and release() != "0.16":
        from megatron.core.tensor_parallel import param_is_not_gtp_duplicate

        counted = param_is_not_gtp_duplicate(param)
    return counted


def zero_count_dtype() -> "torch.dtype":
    """The dtype ``count_zeros_fp32`` accumulates and all-reduces the count in: fp32 on 0.16.1,
    int64 on 0.19."""
    import torch

    return torch.float if release() == "0.16" else torch.int64


def grad_norm_from_sq_sum(norm_sq: "torch.Tensor") -> Any:
    """``get_grad_norm_fp32``'s result from the all-reduced squared norm: ``item() ** 0.5`` (a
    float); on 0.19 with Transformer Engine's ``multi_tensor_scale_tensor`` it stays a tensor
    (``pow(0.5)``), which ``clip_grad_by_total_norm_fp32`` then takes (not tested here: no TE on
    CPU)."""
    if release() != "0.16":
        from megatron.core.optimizer import clip_grads

        if getattr(clip_grads, "multi_tensor_scale_tensor_impl", None) is not None:
            return norm_sq.pow(1.0 / 2.0)
    return norm_sq.item() ** (1.0 / 2.0)

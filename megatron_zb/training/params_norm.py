"""``--log-params-norm``: the L2 norm of the model's parameters, as Megatron-LM's ``calc_params_l2_norm``.

Megatron-LM core_v0.16.1 (``megatron/training/utils.py``): every parameter counted once over the
whole job -- tensor-parallel duplicates and ``shared`` copies (the tied output layer of the last
pipeline stage) left out; with bf16 the fp32 main parameter (``param.main_param``; sharded over
data parallelism with the distributed optimizer, then summed over the data-parallel group),
else the parameter itself (fp32, or fp16 as it is); expert parameters (``allreduce`` False)
summed over the expert groups. The squared norms go through the multi-tensor kernel
megatron-core's ``clip_grads`` picked (Transformer Engine, apex or its local fallback), are summed
over the model-parallel group, and the square root is taken on the host. Collective (every rank
calls it; every rank gets the same value).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from megatron_zb.megatron_compat import optimizer as megatron_compat_optimizer

__all__ = ["params_l2_norm"]


def _local_data(param: torch.Tensor, *, bf16: bool) -> tuple[str, torch.Tensor | None]:
    """Which sum ``param`` joins (``"dense"``, ``"sharded"``, ``"moe"``) and the tensor counted."""
    expert = not getattr(param, "allreduce", True)
    if bf16 and hasattr(param, "main_param"):
        if getattr(param, "main_param_sharded", False):
            return "sharded", param.main_param  # None where this rank's shard holds none of it
        return ("moe" if expert else "dense"), param.main_param
    data = param.data.float() if bf16 else param.data
    return ("moe" if expert else "dense"), data


def _squared_norm(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The squared L2 norm of ``tensors`` (a 1-element fp32 tensor; zero for none), Megatron-LM's way."""
    if not tensors:
        return torch.zeros((1,), dtype=torch.float32, device=device)
    overflow = torch.tensor([0], dtype=torch.int, device=device)
    norm = megatron_compat_optimizer.multi_tensor_l2_norm(tensors, overflow)
    return norm * norm


def params_l2_norm(modules: Sequence[Any], *, bf16: bool, device: torch.device) -> float:
    """The L2 norm of the parameters of this rank's ``modules`` (the wrapped chunks) and every other
    rank's, counted as Megatron-LM counts them (module docstring). Collective."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    parts: dict[str, list[torch.Tensor]] = {"dense": [], "sharded": [], "moe": []}
    seen: set[int] = set()
    for module in modules:
        for param in module.parameters():
            if id(param) in seen or not param_is_not_tensor_parallel_duplicate(param):
                continue  # one parameter object serving two chunks (a V placement's tied embedding) counts once
            seen.add(id(param))
            expert = not getattr(param, "allreduce", True)
            if not expert and not param_is_not_shared(param):
                continue
            kind, data = _local_data(param, bf16=bf16)
            if data is not None:
                parts[kind].append(data)
    norm_2 = _squared_norm(parts["dense"], device)
    sharded_2 = _squared_norm(parts["sharded"], device)
    dist.all_reduce(sharded_2, op=dist.ReduceOp.SUM, group=ps.get_data_parallel_group(with_context_parallel=True))
    norm_2 += sharded_2
    moe_2 = _squared_norm(parts["moe"], device)
    dense_group = ps.get_model_parallel_group()
    expert_group = ps.get_expert_tensor_model_pipeline_parallel_group()
    if dist.get_process_group_ranks(dense_group) == dist.get_process_group_ranks(expert_group):
        norm_2 += moe_2
        dist.all_reduce(norm_2, op=dist.ReduceOp.SUM, group=dense_group)
    else:
        dist.all_reduce(norm_2, op=dist.ReduceOp.SUM, group=dense_group)
        dist.all_reduce(moe_2, op=dist.ReduceOp.SUM, group=expert_group)
        norm_2 += moe_2
    return norm_2.item() ** 0.5

"""A rank's model-state memory, measured from its tensors' storages (not from a formula).

:func:`model_state_bytes` sums the bytes of the distinct storages behind this rank's parameters, gradients and
optimizer state -- each storage once, however many views point into it (megatron-core's DDP keeps every
parameter as a view of one ``param_data`` buffer and every gradient as a view of ``grad_data``; its
distributed optimizer's fp32 shards of fp32 parameters are views of them too). Used by the sharded-gradient
benchmark and tests (docs/training.md "Sharded gradients").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch

__all__ = ["ModelStateBytes", "model_state_bytes"]


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of distinct storages, by kind (a storage counted under the first kind that reaches it).

    Attributes:
        params: the model's parameters (megatron-core's ``param_data`` buffers with the distributed optimizer).
        grads: gradients: megatron-core's ``grad_data`` buffers, or with sharded gradients the shards, the
            residual buffers and the shared work buffers (megatron-core's freed buffers count 0).
        optimizer: the optimizer's main (fp32) parameter copies and its state (Adam's moments, ...).
        num_params: elements of the model's parameters (each parameter once).
    """

    params: int
    grads: int
    optimizer: int
    num_params: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def per_param(self) -> float:
        """Total bytes per model parameter."""
        return self.total / self.num_params


class _Storages:
    def __init__(self) -> None:
        self._seen: set[int] = set()

    def add(self, tensors: Iterable[torch.Tensor | None]) -> int:
        total = 0
        for t in tensors:
            if t is None or not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in self._seen:
                continue
            self._seen.add(storage.data_ptr())
            total += storage.nbytes()
        return total


def _grad_tensors(module: Any) -> list[torch.Tensor]:
    """Every gradient storage of a megatron-core DDP chunk (or of a plain module: its ``main_grad``/``grad``)."""
    from megatron_zb.runtime.sharded_grads import ATTR

    sharded = getattr(module, ATTR, None)
    if sharded is not None:
        return ([b.shard for b in sharded.buckets] + [sharded.residual]
                + [slot.data for slot in sharded.work.slots])
    buffers = list(getattr(module, "buffers", ())) + list(getattr(module, "expert_parallel_buffers", ()))
    if buffers:
        return [b.grad_data for b in buffers]
    return [p.main_grad if getattr(p, "main_grad", None) is not None else p.grad for p in module.parameters()]


def model_state_bytes(modules: Iterable[Any], optimizer: Any) -> ModelStateBytes:
    """This rank's :class:`ModelStateBytes`: ``modules`` its model chunks (megatron-core DDP), ``optimizer``
    megatron-core's optimizer over them (a chained optimizer's parts each)."""
    modules = list(modules)
    storages = _Storages()
    params = {id(p): p for m in modules for p in m.parameters()}
    param_bytes = storages.add(params.values())
    grad_bytes = storages.add(t for m in modules for t in _grad_tensors(m))
    opt_tensors: list[torch.Tensor] = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in opt.optimizer.param_groups:
            opt_tensors += group["params"]
        for state in opt.optimizer.state.values():
            opt_tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return ModelStateBytes(params=param_bytes, grads=grad_bytes, optimizer=storages.add(opt_tensors),
                           num_params=sum(p.numel() for p in params.values()))

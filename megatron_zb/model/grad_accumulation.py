"""Where megatron-core keeps a weight's gradient: the one rule, for every deferred weight gradient (the
runtime's linear route and the vocabulary-parallel slices' W)."""

from __future__ import annotations

import torch

__all__ = ["add_weight_grad"]


def add_weight_grad(weight: torch.Tensor, grad_weight: torch.Tensor) -> None:
    """Add a computed weight gradient where megatron-core keeps it: ``weight.main_grad`` (what
    megatron-core DDP's grad hook adds into), else ``weight.grad``. The one copy of the rule."""
    if getattr(weight, "main_grad", None) is not None:
        weight.main_grad.add_(grad_weight)
    elif weight.grad is None:
        weight.grad = grad_weight
    else:
        weight.grad += grad_weight

"""Evaluation: ``--eval-iters`` forward-only batches through the run's ``forward_backward_func``."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from megatron_zb.training.distributed import DistributedContext
from megatron_zb.training.gpt_step import run_batch, sum_lm_loss
from megatron_zb.training.run_config import RunConfig
from megatron_zb.training.training_log import gather_losses

__all__ = ["evaluate"]


def evaluate(config: RunConfig, *, pipeline: Any, modules: Sequence[Any],
             iterators: Sequence[Any], stage_to_rank: Sequence[int], dist_ctx: DistributedContext,
             after_step: Callable[[], None] | None = None) -> float:
    """The lm loss over ``config.data.eval_iters`` global batches (masked sum / tokens, all DP ranks),
    forward-only calls of ``pipeline`` (:data:`~megatron_zb.training.replanning.Pipeline`).

    ``after_step`` runs after each batch (``--empty-unused-memory-level``'s cache emptying).

    Puts ``modules`` in eval mode (no dropout) and back in train mode; no gradients. Collective;
    the result is the same on every rank (``nan`` when no token was unmasked).
    """
    for m in modules:
        m.eval()
    total = torch.zeros(2, dtype=torch.float64, device="cpu")  # host bookkeeping, as sum_lm_loss
    with torch.no_grad():
        for _ in range(config.data.eval_iters):
            out = run_batch(pipeline, model=modules, iterators=iterators, config=config,
                            device=dist_ctx.device, forward_only=True).data
            sum_lm_loss(out or [], into=total)
            if after_step is not None:
                after_step()
    for m in modules:
        m.train()
    [(num, den)] = gather_losses([(float(total[0]), float(total[1]))], stage_to_rank=stage_to_rank,
                                 dist_ctx=dist_ctx)
    return num / den if den > 0 else float("nan")

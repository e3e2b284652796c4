"""GPT's forward step and loss, as in Megatron-LM's ``pretrain_gpt.py``, and one pass over a batch.

:func:`forward_step` and :func:`loss_func` are what megatron-core's ``forward_backward_func``
(or megatron-zb's) calls per micro batch; :func:`run_batch` is one such call over one global
batch's micro batches of this data-parallel rank, for training and for evaluation alike.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Iterator, Sequence

import torch

from megatron_zb.runtime.measure import Measure, Measured
from megatron_zb.training.data import get_batch
from megatron_zb.training.nan_check import check_loss
from megatron_zb.training.run_config import RunConfig

__all__ = ["device_batches", "forward_step", "loss_func", "run_batch", "sum_lm_loss"]


def loss_func(loss_mask: torch.Tensor | None, output_tensor: torch.Tensor, *, check_for_nan: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron's GPT loss: masked sum of the per-token losses, the token count, and for reporting
    ``[masked sum, tokens]`` (megatron-core divides by the tokens and the micro batches).

    ``check_for_nan`` (``--check-for-nan-in-loss-and-grad``): the loss is checked for NaN and Inf here, on
    the rank that computes it, before any reduction, as Megatron-LM's ``loss_func`` does
    (:func:`~megatron_zb.training.nan_check.check_loss`)."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.reshape(-1).float()  # type: ignore[union-attr]
    loss = torch.sum(losses * mask)
    if check_for_nan:
        check_loss(loss)
    tokens = mask.sum()
    report = torch.stack([loss.detach(), tokens.detach()])
    return loss, tokens.detach().to(torch.int), {"lm loss": report}


def forward_step(data_iterator: Iterator[Any] | None, model: Any, *, device: Any = None,
                 check_for_nan: bool = False) -> tuple[Any, Any]:
    """megatron-core forward step: the chunk's micro batch (``None`` on middle stages), output, loss
    (``check_for_nan``: :func:`loss_func`'s). With ``--timing-log-level 2`` the batch is timed as
    Megatron-LM's ``batch-generator``."""
    from megatron.core.utils import get_model_config

    timers = get_model_config(model).timers
    if timers is not None:
        timers("batch-generator", log_level=2).start()
    batch = get_batch(data_iterator, device=device)
    if timers is not None:
        timers("batch-generator").stop()
    if batch is None:
        return model(None, None, None), partial(loss_func, None)
    # No mask with --no-create-attention-mask-in-dataloader: megatron-core's causal attention makes its own.
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"], check_for_nan=check_for_nan)


def run_batch(pipeline: Any, measure: Measure = Measure(), *, model: Sequence[Any], iterators: Sequence[Any],
              config: RunConfig, device: torch.device, forward_only: bool,
              num_microbatches: int | None = None) -> Measured:
    """One ``forward_backward_func`` call of ``pipeline`` (:data:`~megatron_zb.training.replanning.Pipeline`)
    over ``num_microbatches`` micro batches (default ``config.num_microbatches``, ``--global-batch-size``'s;
    a training iteration of a batch ramp-up has fewer), measuring what ``measure`` asks.

    ``iterators`` holds one iterator (or ``None``) per model chunk; the result's ``data`` holds the loss
    reports of the last stage's micro batches (empty elsewhere).
    """
    m = num_microbatches if num_microbatches is not None else config.num_microbatches
    seq = config.model.seq_length
    step = partial(forward_step, device=device, check_for_nan=config.precision.checks_nan)
    return pipeline.run(measure, forward_step_func=step,
                        data_iterator=list(iterators) if len(iterators) > 1 else iterators[0],
                        model=list(model), num_microbatches=m, seq_length=seq,
                        micro_batch_size=config.micro_batch_size, decoder_seq_length=seq,
                        forward_only=forward_only)


def device_batches(data_iterator: Iterator[Any], *, device: Any) -> Iterator[dict[str, torch.Tensor]]:
    """``data_iterator``'s micro batches moved to ``device`` (:func:`~megatron_zb.training.data.get_batch`),
    one per ``next()``: what the vocabulary-parallel passes read on every rank (``--enable-vocab-parallel``)."""
    return iter(lambda: get_batch(data_iterator, device=device), None)


def sum_lm_loss(reports: Sequence[dict[str, torch.Tensor]], into: torch.Tensor | None = None) -> torch.Tensor:
    """``[masked loss sum, tokens]`` of ``reports`` (float64, CPU), added to ``into`` in place when given."""
    total = into if into is not None else torch.zeros(2, dtype=torch.float64, device="cpu")
    for d in reports:
        total += d["lm loss"].detach().to("cpu", torch.float64)
    return total

"""The multi-token prediction losses of an iteration (``--mtp-num-layers``), as Megatron-LM logs them.

megatron-core's ``GPTModel`` adds each MTP depth's loss (masked mean over one micro batch) to
``MTPLossLoggingHelper``'s tracker during training forwards; Megatron-LM's ``training_log`` reads it
once per iteration with ``track_mtp_metrics(1 / micro batches, ...)`` -- the data-parallel average
of the micro batches' mean -- and logs ``mtp_1 loss``, ``mtp_2 loss``, ... . :func:`take_mtp_losses` is
that read (it empties the tracker), on every rank: ranks without MTP layers have no tracker and get
``None``.
"""

from __future__ import annotations

import re

__all__ = ["mtp_loss_names", "take_mtp_losses"]

_NAME = re.compile(r"^mtp_(\d+) loss$")


def mtp_loss_names(count: int) -> list[str]:
    """Megatron-LM's log names of ``count`` MTP depths: ``["mtp_1 loss", ...]``."""
    return [f"mtp_{i + 1} loss" for i in range(count)]


def take_mtp_losses(num_microbatches: int) -> tuple[float, ...] | None:
    """This iteration's loss per MTP depth (mean over the micro batches, averaged over the data-parallel
    ranks; collective over them where the tracker holds values), the tracker emptied; ``None`` on a
    rank without MTP layers."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    found: dict[str, object] = {}
    MTPLossLoggingHelper.track_mtp_metrics(1.0 / num_microbatches, 0, None, None, found)
    depth = sorted((int(m.group(1)), float(v)) for k, v in found.items() if (m := _NAME.match(k)))
    return tuple(v for _, v in depth) or None

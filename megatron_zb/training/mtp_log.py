"""The multi-token prediction losses of an iteration (``--mtp-num-layers``), as Megatron-LM logs them.

megatron-core's ``GPTModel`` adds each MTP depth's loss (masked mean over one micro batch) to
``MTPLossLoggingHelper``'s tracker during training forwards; Megatron-LM's ``training_log`` reads it
once per iteration with ``track_mtp_metrics(1 / micro batches, ...)`` -- the data-parallel average
of the micro batches' mean -- and logs ``mtp_1 loss``, ``mtp_2 loss``, ... . :func:`take_mtp_losses` is
that read (it empties the tracker), on every rank: ranks without MTP layers have no tracker and get
``None``. :func:`broadcast_mtp_losses` hands the MTP stage's values to every pipeline rank (the line and the
JSON are the last rank's; with a V the MTP layers are on rank 0).
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import torch
import torch.distributed as dist

__all__ = ["broadcast_mtp_losses", "mtp_loss_names", "take_mtp_losses"]

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


def broadcast_mtp_losses(values: Sequence[tuple[float, ...] | None], *, depth: int, holder_pp: int,
                         dist_ctx: Any) -> list[tuple[float, ...] | None]:
    """``values`` (one entry per iteration: its MTP losses, ``None`` where none were tracked) of the pipeline
    rank ``holder_pp`` holding the MTP layers, on every pipeline rank; ``depth``: MTP layers. Collective over
    the pipeline group (``dist_ctx``: the :class:`~megatron_zb.training.distributed.DistributedContext`)."""
    if dist.get_world_size(dist_ctx.pp_group) == 1:
        return list(values)
    buf = torch.zeros(len(values), depth + 1, dtype=torch.float64, device=dist_ctx.device)  # [present, losses...]
    if dist_ctx.pp_rank == holder_pp:
        for i, v in enumerate(values):
            if v is not None:
                buf[i, 0] = 1.0
                buf[i, 1:] = torch.tensor(v, dtype=torch.float64, device=buf.device)
    dist.broadcast(buf, src=dist.get_global_rank(dist_ctx.pp_group, holder_pp), group=dist_ctx.pp_group)
    return [tuple(row[1:]) if row[0] else None for row in buf.cpu().tolist()]

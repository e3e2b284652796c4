"""The megatron-core internals the training loop, its data and its checkpoints rely on (part of the
table in :mod:`megatron_zb.megatron_compat`, reviewed with it at each megatron-core upgrade)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

__all__ = ["chunk_float16_module", "fix_gpt_dataset_mask_cache", "quiet_mock_dataset_cache_notice"]


def fix_gpt_dataset_mask_cache() -> None:
    """Make megatron-core's ``GPTDataset`` loss mask depend on the sample only (idempotent).

    megatron-core 0.16.1 caches the masks of the first sample a ``GPTDataset`` object serves
    (when no EOD/reset option makes them sample-dependent), but the cached loss mask *is* the
    tensor returned for that sample, and ``__getitem__`` then zeroes its padded-label positions in
    place. Every later sample inherits the first sample's padding zeros, so the loss mask depends
    on which sample was read first -- a resumed run (or another rank) masks differently from an
    uninterrupted one. Mock data hits it whenever a token equals the tokenizer's PAD id. The
    cacheable mask is all ones, so after the first ``__getitem__`` the cache is reset to that.

    Private: ``GPTDataset.masks_and_position_ids_are_cacheable`` / ``..._are_cached`` /
    ``cached_loss_mask``; patches ``GPTDataset.__getitem__`` (``MockGPTDataset`` inherits it).
    """
    import torch
    from megatron.core.datasets.gpt_dataset import GPTDataset

    if getattr(GPTDataset.__getitem__, "_megatron_zb_mask_fix", False):
        return
    original = GPTDataset.__getitem__

    def __getitem__(self, idx):  # type: ignore[no-untyped-def]
        first = self.masks_and_position_ids_are_cacheable and not self.masks_and_position_ids_are_cached
        out = original(self, idx)
        if first and self.cached_loss_mask is not None:
            self.cached_loss_mask = torch.ones_like(self.cached_loss_mask)
        return out

    __getitem__._megatron_zb_mask_fix = True  # type: ignore[attr-defined]
    __getitem__.__doc__ = original.__doc__
    GPTDataset.__getitem__ = __getitem__


def quiet_mock_dataset_cache_notice() -> None:
    """Drop megatron-core's "... because path_to_cache is None" log record of ``MockGPTDataset``.

    Mock datasets are never cached; megatron-core logs that once per split. Private: the logger
    name and the message text of ``megatron.core.datasets.gpt_dataset``.
    """
    import logging

    logging.getLogger("megatron.core.datasets.gpt_dataset").addFilter(
        lambda r: "because path_to_cache is None" not in r.getMessage())


def chunk_float16_module(config: "TransformerConfig", module: "torch.nn.Module", *, first: bool,
                         last: bool) -> "Float16Module":
    """megatron-core's ``Float16Module`` deciding first/last by the chunk's stage, not the pipeline rank.

    megatron-core's own asks ``parallel_state`` (pipeline rank, virtual stage), which is wrong for
    V / interleaved chunks built with ``vp_stage=None``: e.g. on a V's rank 0 the last stage's
    loss would stay in half precision, on the last rank a middle chunk's output would become fp32.

    Private: overrides ``Float16Module.forward`` and uses its ``float16_convertor`` and ``module``
    attributes.
    """
    from megatron.core.transformer.module import Float16Module, float16_to_fp32, fp32_to_float16

    class ChunkFloat16Module(Float16Module):
        def forward(self, *inputs, fp32_output=True, **kwargs):  # type: ignore[no-untyped-def]
            if first:
                inputs = fp32_to_float16(inputs, self.float16_convertor)
            outputs = self.module(*inputs, **kwargs)
            if last and fp32_output is True:
                outputs = float16_to_fp32(outputs)
            return outputs

    return ChunkFloat16Module(config, module)

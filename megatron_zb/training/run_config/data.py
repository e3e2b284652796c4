"""The data section of the run configuration: datasets, their split and cache, the micro-batch
loaders and the tokenizer (Megatron-LM's "data and tokenizer" flags, ``--eval-*``)."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any

from .fields import read_section

__all__ = ["DataBlend", "DataConfig", "TokenizerConfig"]

DataBlend = tuple[list[str], list[float] | None]
"""Dataset prefixes and their weights (``None``: weighted by size), as ``--data-path`` is parsed."""


@dataclass(frozen=True)
class TokenizerConfig:
    """The tokenizer flags (:func:`~megatron_zb.training.tokenizers.add_tokenizer_args`) as validated;
    :meth:`build` makes the tokenizer the datasets use (the one rule,
    :func:`~megatron_zb.training.tokenizers.tokenizer_from_args`, reads these fields by name)."""

    tokenizer_type: str = "ByteLevel"
    """``--tokenizer-type``."""
    tokenizer_model: str | None = None
    """``--tokenizer-model``: the model file or directory of SentencePiece, TikToken and HuggingFace tokenizers."""
    vocab_size: int | None = None
    """``--vocab-size`` as validation resolved it (the tokenizer's size unless the flag is larger;
    ``NullTokenizer``: the flag's value) [tokens]."""
    vocab_file: str | None = None
    """``--vocab-file`` (GPT-2 BPE)."""
    merge_file: str | None = None
    """``--merge-file`` (GPT-2 BPE)."""
    tiktoken_pattern: str | None = None
    """``--tiktoken-pattern``: ``v1`` or ``v2`` (TikTokenizer)."""
    tiktoken_num_special_tokens: int = 1000
    """``--tiktoken-num-special-tokens`` [token ids reserved below the vocabulary] (TikTokenizer)."""
    tiktoken_special_tokens: tuple[str, ...] | None = None
    """``--tiktoken-special-tokens`` (TikTokenizer)."""
    tokenizer_special_tokens: tuple[str, ...] | None = None
    """``--tokenizer-special-tokens`` (TikTokenizer)."""

    def build(self) -> Any:
        """The tokenizer (a megatron-core ``MegatronTokenizerBase``)."""
        from megatron_zb.training.tokenizers import tokenizer_from_args

        return tokenizer_from_args(self)

    @classmethod
    def from_args(cls, args: Any) -> "TokenizerConfig":
        """The section of validated ``args``."""
        special = {d: (tuple(v) if (v := getattr(args, d, None)) is not None else None)
                   for d in ("tiktoken_special_tokens", "tokenizer_special_tokens")}
        return read_section(cls, args, **special)


@dataclass(frozen=True)
class DataConfig:
    """Where the samples come from and how they are served (Megatron-LM's meanings; sizes are
    Megatron-LM's, :func:`~megatron_zb.training.data.train_valid_test_num_samples`)."""

    mock_data: bool = False
    """``--mock-data``: megatron-core's ``MockGPTDataset`` (no files)."""
    data_blend: DataBlend | None = None
    """``--data-path [WEIGHT] PREFIX ...`` as parsed; ``None`` with mock data or per-split paths."""
    data_blend_per_split: tuple[DataBlend | None, ...] | None = None
    """``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path`` as parsed (train, valid,
    test; ``None`` for a split without one); ``None``: not given."""
    split: str | None = "969,30,1"
    """``--split``: train/valid/test proportions of ``--data-path``'s documents."""
    data_cache_path: str | None = None
    """``--data-cache-path``: where the index caches go (else ``SAVE/data_cache``, else a temporary directory)."""
    save: str | None = None
    """``--save`` (the checkpoint directory): the default place of the data cache."""
    reset_position_ids: bool = False
    """``--reset-position-ids``: positions restart after each EOD token."""
    reset_attention_mask: bool = False
    """``--reset-attention-mask``: attention does not cross EOD tokens."""
    eod_mask_loss: bool = False
    """``--eod-mask-loss``: no loss on EOD tokens."""
    create_attention_mask_in_dataloader: bool = True
    """Cleared by ``--no-create-attention-mask-in-dataloader`` (megatron-core's attention builds the causal mask)."""
    mmap_bin_files: bool = True
    """Cleared by ``--no-mmap-bin-files``: read the ``.bin`` files without memory-mapping them."""
    num_workers: int = 2
    """``--num-workers``: DataLoader worker processes per rank."""
    eval_interval: int = 1000
    """``--eval-interval`` [iterations between evaluations]."""
    eval_iters: int = 100
    """``--eval-iters`` [iterations per evaluation]."""
    exit_signal_handler: bool = False
    """``--exit-signal-handler``: the loaders' workers ignore :attr:`exit_signal` (the main process handles it)."""
    exit_signal_handler_for_dataloader: bool = False
    """``--exit-signal-handler-for-dataloader``: the same, for the loaders alone."""
    exit_signal: signal.Signals = signal.SIGTERM
    """``--exit-signal``: the signal a job scheduler stops the job with."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """The tokenizer flags."""

    @classmethod
    def from_args(cls, args: Any) -> "DataConfig":
        """The section of validated ``args``."""
        per_split = args.data_blend_per_split
        return read_section(cls, args, data_blend_per_split=tuple(per_split) if per_split is not None else None,
                            tokenizer=TokenizerConfig.from_args(args))

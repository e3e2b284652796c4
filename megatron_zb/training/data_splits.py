"""What each data split asks of each dataset prefix, and the splits megatron-core cannot build.

Two rules written once here: the samples each split must serve (:func:`split_num_samples`, which
:func:`megatron_zb.training.data.train_valid_test_num_samples` and validation both call) and the
sequences of a prefix each split gets (:func:`split_sequence_ranges`: megatron-core's own
``parse_and_normalize_split`` / ``convert_split_vector_to_split_matrix``, public in
``megatron.core.datasets.blended_megatron_dataset_config`` on 0.16.1 and 0.19.x, then the rounding of
``BlendedMegatronDatasetBuilder._build_megatron_dataset_splits``, inline there in both releases:
``int(round(bookend * num_sequences))``).

**What megatron-core cannot build** (:func:`unbuildable_split`), found with megatron-core 0.16.1 and
its source of 0.19.x:

- a single prefix, or a weighted blend: every split it builds is a ``GPTDataset`` asked for a number of
  samples, and ``GPTDataset._get_num_epochs`` adds epochs until it has ``samples * seq_length + 1``
  tokens. A split whose sequences hold **zero tokens** loops forever -- even for 0 samples
  (``--eval-iters 0``: it still asks for the one extra token).
- a blend weighted by size (several prefixes, no weights): each prefix's split is built as one epoch
  and the ``BlendedDataset`` weights them by their sample counts, asserting every count positive: a
  prefix whose split holds **fewer than seq_length + 1 tokens** (0 samples) fails with a bare
  ``AssertionError``.

Fewer tokens than the requested samples need is *not* a failure: megatron-core repeats the split's
documents over as many epochs as needed (multi-epoch training is legitimate there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy

__all__ = ["SPLIT_NAMES", "SplitShortage", "split_num_samples", "split_sequence_ranges", "unbuildable_split"]

SPLIT_NAMES: tuple[str, str, str] = ("train", "validation", "test")


def split_num_samples(*, train_iters: int, train_samples: int | None, global_batch_size: int,
                      micro_batch_size: int, data_parallel_size: int, eval_interval: int, eval_iters: int,
                      rampup_batch_size: Sequence[int] | None) -> tuple[int, int, int]:
    """Samples the trainer requests per split (Megatron's sizing; unit: sequences of ``seq_length`` tokens).

    Training: ``--train-samples`` when given, else ``train_iters * global_batch_size``; with
    ``--rampup-batch-size`` at least what the iterations read (they overshoot ``--train-samples`` by up
    to one batch when it ends inside the ramp, as Megatron-LM counts them). Validation:
    ``(train_iters // eval_interval + 1) * eval_iters * global_batch_size``; test: ``eval_iters *
    global_batch_size``."""
    evaluations = train_iters // eval_interval + 1
    train = train_samples if train_samples else train_iters * global_batch_size
    if rampup_batch_size is not None:
        from megatron_zb.training.batch_ramp import samples_of_iterations

        train = max(train, samples_of_iterations(train_iters, global_batch_size=global_batch_size,
                                                 micro_batch_size=micro_batch_size,
                                                 data_parallel_size=data_parallel_size,
                                                 rampup_batch_size=tuple(rampup_batch_size)))
    return train, evaluations * eval_iters * global_batch_size, eval_iters * global_batch_size


def split_sequence_ranges(split: str | None, num_sequences: int) -> list[range | None]:
    """The sequences of a prefix of ``num_sequences`` that megatron-core gives each split (train, valid,
    test); ``None`` for a split it does not build. ``split`` ``None``: a per-split path (the whole file
    is that split's -- the caller picks the entry)."""
    from megatron.core.datasets.blended_megatron_dataset_config import (convert_split_vector_to_split_matrix,
                                                                        parse_and_normalize_split)

    if split is None:
        return [range(num_sequences)] * 3
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    return [None if b is None else range(int(round(b[0] * float(num_sequences))),
                                         int(round(b[1] * float(num_sequences)))) for b in matrix]


@dataclass(frozen=True)
class SplitShortage:
    """One split of one prefix that megatron-core cannot build: ``sequences`` of the prefix's
    ``total_sequences`` holding ``tokens`` tokens; ``reason`` says what megatron-core does with it."""

    sequences: int
    total_sequences: int
    tokens: int
    reason: str


def unbuildable_split(lengths: numpy.ndarray, sequences: range, *, by_size: bool,
                      seq_length: int) -> SplitShortage | None:
    """The shortage of a split given ``sequences`` of a prefix whose sequence lengths are ``lengths``
    [tokens], or ``None`` when megatron-core builds it (module docstring: zero tokens hang a sampled
    split; a blend weighted by size (``by_size``) needs at least ``seq_length + 1`` tokens per member)."""
    tokens = int(lengths[sequences.start:sequences.stop].sum(dtype=numpy.int64))
    common = dict(sequences=len(sequences), total_sequences=int(lengths.shape[0]), tokens=tokens)
    if by_size and tokens < seq_length + 1:
        return SplitShortage(**common, reason=f"megatron-core's BlendedDataset (weights by size) asserts every "
                                              f"member has a sample of {seq_length} + 1 tokens")
    if not by_size and tokens == 0:
        return SplitShortage(**common, reason="megatron-core's GPTDataset would loop forever adding empty epochs "
                                              "(even for 0 samples: it asks for one token more)")
    return None

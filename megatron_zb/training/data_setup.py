"""The data of a run: train / validation / test micro-batch iterators, one per model chunk."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch.distributed as dist

from megatron_zb.training.logging_utils import print_rank_0
from megatron_zb.training.run_config import RunConfig
from megatron_zb.training.state import TrainState

__all__ = ["DataBundle", "build_data", "chunk_iterators"]


@dataclass(frozen=True)
class DataBundle:
    """This rank's iterators, one entry per model chunk (``None`` for chunks that read no data).

    Attributes:
        train: training micro batches (one ``next()`` per micro batch).
        valid: validation micro batches.
        test: test micro batches.
        has_valid: whether the job has validation data (agreed by all ranks).
        has_test: whether the job has test data (agreed by all ranks).
        vocab_train: with ``--enable-vocab-parallel``, one more view of the training micro batches, on
            every rank (the vocabulary passes read each micro batch's tokens and labels); else ``None``.
        vocab_valid, vocab_test: the same for the validation and test micro batches.
    """

    train: list[Any]
    valid: list[Any]
    test: list[Any]
    has_valid: bool
    has_test: bool
    vocab_train: Any = None
    vocab_valid: Any = None
    vocab_test: Any = None


def build_data(config: RunConfig, *, reads_data: Sequence[bool], state: TrainState,
               vocab_parallel: bool = False) -> DataBundle:
    """Datasets and iterators (:mod:`megatron_zb.training.data`), resuming at ``state``'s consumed
    samples; ``reads_data`` tells per chunk whether it reads micro batches; ``vocab_parallel``: one more
    view of the training micro batches for the vocabulary passes (every rank reads). Collective."""
    from megatron_zb.megatron_compat.training import quiet_mock_dataset_cache_notice
    from megatron_zb.training.data import build_data_iterators, train_valid_test_num_samples

    t0 = time.perf_counter()
    print_rank_0("> building train, validation and test datasets ...")
    if config.data.mock_data:  # mock datasets are never cached; megatron-core says so once per split
        quiet_mock_dataset_cache_notice()
    train, valid, test = build_data_iterators(config, consumed_train_samples=state.consumed_train_samples,
                                              consumed_valid_samples=state.consumed_valid_samples)
    # Every rank must agree whether there is validation / test data (decided on data ranks).
    holder = [[valid is not None, test is not None]]
    dist.broadcast_object_list(holder, src=0)
    has_valid, has_test = holder[0]
    n_train, n_valid, n_test = train_valid_test_num_samples(config)
    print_rank_0(f"> data ready: {'mock' if config.data.mock_data else 'indexed'} data, {n_train} training, "
                 f"{n_valid} validation, {n_test} test samples requested; starting at sample "
                 f"{state.consumed_train_samples} ({time.perf_counter() - t0:.1f} s)")
    views = [chunk_iterators(source, list(reads_data) + [vocab_parallel]) for source in (train, valid, test)]
    return DataBundle(train=views[0][:-1], valid=views[1][:-1], test=views[2][:-1], has_valid=has_valid,
                      has_test=has_test, vocab_train=views[0][-1], vocab_valid=views[1][-1], vocab_test=views[2][-1])


class _SharedSource:
    """One micro-batch iterator read by several chunks of this rank, each in micro-batch order.

    With the V placement, pipeline rank 0 holds the first stage (needs tokens) and the last stage
    (needs labels): both read the same micro batches. Items are kept until every view has read them.
    """

    def __init__(self, source: Iterator[Any], num_views: int) -> None:
        self.source = source
        self.buffer: collections.deque = collections.deque()
        self.base = 0
        self.pos = [0] * num_views

    def get(self, view: int) -> Any:
        idx = self.pos[view]
        while self.base + len(self.buffer) <= idx:
            self.buffer.append(next(self.source))
        item = self.buffer[idx - self.base]
        self.pos[view] += 1
        while self.buffer and min(self.pos) > self.base:
            self.buffer.popleft()
            self.base += 1
        return item


class _View:
    def __init__(self, shared: _SharedSource, index: int) -> None:
        self.shared, self.index = shared, index

    def __iter__(self) -> "_View":
        return self

    def __next__(self) -> Any:
        return self.shared.get(self.index)


def chunk_iterators(source: Iterator[Any] | None, needs_data: Sequence[bool]) -> list[Any]:
    """One iterator per chunk: views of ``source`` for the chunks that read data, ``None`` for the others."""
    n = sum(needs_data)
    if source is None or n == 0:
        return [None] * len(needs_data)
    if n == 1:
        return [source if need else None for need in needs_data]
    shared = _SharedSource(source, n)
    out, k = [], 0
    for need in needs_data:
        if need:
            out.append(_View(shared, k))
            k += 1
        else:
            out.append(None)
    return out


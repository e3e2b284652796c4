"""GPT datasets and micro-batch iterators, built with megatron-core 0.16.1 (tokenizers re-exported).

Tokenizers (:func:`build_tokenizer`, ``--tokenizer-type``) live in
:mod:`megatron_zb.training.tokenizers` and are re-exported here.

Datasets (:func:`build_datasets`): ``MockGPTDataset`` for ``--mock-data``, else ``GPTDataset``
(one prefix) or ``BlendedDataset`` over ``GPTDataset`` (several prefixes / weights) split by
``--split``, through ``BlendedMegatronDatasetBuilder`` and ``GPTDatasetConfig``. Sizes are
Megatron's: ``--train-samples`` or ``train_iters * global_batch_size`` training samples, ``(train_iters //
eval_interval + 1) * eval_iters * global_batch_size`` validation samples and ``eval_iters *
global_batch_size`` test samples (:func:`train_valid_test_num_samples`). Nothing depends on the
pipeline schedule, so the same seed gives the same samples in the same order for every schedule
(and every TP/PP layout with the same data-parallel size).

Iterators (:func:`build_data_iterators`) yield one micro batch per ``next()``: a dict of
``tokens`` ``[b, s]`` int64, ``labels`` ``[b, s]`` int64 (tokens shifted by one),
``loss_mask`` ``[b, s]`` float32, ``attention_mask`` ``[b, 1, s, s]`` bool (True = masked out,
megatron-core's convention; absent with ``--no-create-attention-mask-in-dataloader``, when
megatron-core's causal attention builds its own) and ``position_ids`` ``[b, s]`` int64, with
``b = micro_batch_size`` and ``s = seq_length``. Each global batch is ``micro_batch_size * DP``
consecutive samples; data parallel rank ``r`` takes the ``r``-th slice (Megatron's pretraining
sampler), resuming after ``consumed_samples``.

**Only the pipeline ranks holding the first or the last stage consume data** (the first needs
``tokens``/``position_ids``/``attention_mask``, the last ``labels``/``loss_mask``): ranks ``0``
and ``PP-1`` for plain and interleaved placements, rank ``0`` alone for V placements (it holds
both ends of the V). Other ranks get ``None`` iterators (:func:`pipeline_rank_consumes_data`).
Every tensor-parallel rank of a consuming pipeline rank builds the same iterator itself, so no
broadcast over the tensor-parallel group is needed.

**Process groups and the index cache.** Real (non-mock) datasets always write index files
(document/sample/shuffle ``.npy``) to a cache directory -- megatron-core otherwise picks
``PREFIX/cache/`` next to the data. :func:`resolve_data_cache_dir` uses ``--data-cache-path``,
else ``SAVE/data_cache`` when ``--save`` is set, else ``<tmp>/megatron_zb_data_cache``. With
``torch.distributed`` initialised, megatron-core builds on global rank 0 first, then a barrier,
then the other ranks load the cache: so :func:`build_datasets` must be called by *every* rank,
and the cache must be visible to every node (checked: :func:`check_cache_dir_shared`). Without a
process group megatron-core's ``BlendedDataset`` still calls ``torch.distributed.get_rank()``
when it caches; :func:`build_datasets` then runs the build inside a temporary single-process
gloo group (:func:`single_process_group`) and destroys it afterwards.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from typing import Any, Iterator

import torch

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.tokenizers import MegatronTokenizerBase

from megatron_zb.megatron_compat.training import fix_gpt_dataset_mask_cache
from megatron_zb.training.data_splits import split_num_samples
from megatron_zb.training.run_config import DataConfig, RunConfig
from megatron_zb.training.tokenizers import (ByteLevelTokenizer, GPT2BPETokenizer, HuggingFaceLocalTokenizer,
                                             NullTokenizer, TokenizerError, build_tokenizer, tokenizer_from_args)

__all__ = [
    "BATCH_KEYS",
    "ByteLevelTokenizer",
    "GPT2BPETokenizer",
    "HuggingFaceLocalTokenizer",
    "MicroBatchSampler",
    "NullTokenizer",
    "TokenizerError",
    "build_data_iterators",
    "build_datasets",
    "build_tokenizer",
    "check_cache_dir_shared",
    "get_batch",
    "gpt_dataset_config",
    "pipeline_rank_consumes_data",
    "resolve_data_cache_dir",
    "single_process_group",
    "tokenizer_from_args",
    "train_valid_test_num_samples",
]

BATCH_KEYS: tuple[str, ...] = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
"""Keys of a micro batch (``attention_mask`` only with ``create_attention_mask_in_dataloader``)."""


# megatron-core 0.16.1's GPTDataset mask cache leaks the first sample's padding into later samples.
fix_gpt_dataset_mask_cache()


# ---------------------------------------------------------------------------- datasets
def train_valid_test_num_samples(config: RunConfig) -> tuple[int, int, int]:
    """Samples to draw per split (unit: sequences of ``seq_length`` tokens): the one rule,
    :func:`~megatron_zb.training.data_splits.split_num_samples`, on ``config``'s values."""
    return split_num_samples(train_iters=config.train_iters, train_samples=config.train_samples,
                             global_batch_size=config.global_batch_size, micro_batch_size=config.micro_batch_size,
                             data_parallel_size=config.parallel.data_parallel_size,
                             eval_interval=config.data.eval_interval, eval_iters=config.data.eval_iters,
                             rampup_batch_size=config.rampup_batch_size)


def resolve_data_cache_dir(data: DataConfig) -> str | None:
    """Where dataset index caches go (``None`` for mock data, which needs no cache)."""
    if data.mock_data:
        return None
    if data.data_cache_path:
        return data.data_cache_path
    if data.save:
        return os.path.join(data.save, "data_cache")
    return os.path.join(tempfile.gettempdir(), "megatron_zb_data_cache")


def gpt_dataset_config(config: RunConfig, tokenizer: MegatronTokenizerBase, *,
                       cache_dir: str | None) -> GPTDatasetConfig:
    """The megatron-core ``GPTDatasetConfig`` of the run (mock when ``config.data.mock_data``)."""
    data = config.data
    blend = None if data.mock_data else data.data_blend
    per_split = None if data.mock_data or data.data_blend_per_split is None else list(data.data_blend_per_split)
    return GPTDatasetConfig(
        random_seed=config.seed,
        sequence_length=config.model.seq_length,
        blend=blend,
        blend_per_split=per_split,
        split=None if per_split else data.split,
        path_to_cache=cache_dir,
        tokenizer=tokenizer,
        reset_position_ids=data.reset_position_ids,
        reset_attention_mask=data.reset_attention_mask,
        eod_mask_loss=data.eod_mask_loss,
        create_attention_mask=data.create_attention_mask_in_dataloader,
        mmap_bin_files=data.mmap_bin_files,
    )


def pipeline_rank_consumes_data(pipeline_rank: int, *, pipeline_size: int, placement: str) -> bool:
    """Whether ``pipeline_rank`` holds the first or the last pipeline stage (and so reads data)."""
    if placement == "v":
        return pipeline_rank == 0
    return pipeline_rank in (0, pipeline_size - 1)


def _default_pipeline_rank() -> int | None:
    from megatron.core import parallel_state
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_pipeline_model_parallel_rank()
    return None


def _default_data_parallel_rank() -> int:
    from megatron.core import parallel_state
    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_data_parallel_rank()
    return 0


@contextlib.contextmanager
def single_process_group() -> Iterator[None]:
    """A temporary one-process gloo group (FileStore in a temp dir) when none is initialised."""
    if torch.distributed.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory(prefix="megatron_zb_pg_") as d:
        store = torch.distributed.FileStore(os.path.join(d, "store"), 1)
        torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            yield
        finally:
            torch.distributed.destroy_process_group()


def check_cache_dir_shared(cache_dir: str) -> None:
    """Raise on every rank unless all ranks see ``cache_dir`` as one directory (no-op without a group).

    megatron-core writes the index cache on global rank 0 only and other ranks read it, so a
    node-local directory (e.g. the default under ``/tmp``) breaks multi-node jobs. Collective:
    every rank must call it (with NCCL, after ``torch.cuda.set_device``).
    """
    dist = torch.distributed
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    token = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    marker = os.path.join(cache_dir, f".megatron_zb_visible_{token[0]}")
    if dist.get_rank() == 0:
        os.makedirs(cache_dir, exist_ok=True)
        with open(marker, "w") as f:
            f.write("rank 0 wrote this to check that every rank sees the data cache directory\n")
    dist.barrier()
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, os.path.isfile(marker))
    dist.barrier()
    if dist.get_rank() == 0:
        os.remove(marker)
    blind = [r for r, ok in enumerate(seen) if not ok]
    if blind:
        raise RuntimeError(f"the data cache directory {cache_dir!r} is not visible to ranks {blind} (written by rank 0); "
                           f"pass --data-cache-path on a filesystem every node can see")


def build_datasets(config: RunConfig, *, tokenizer: MegatronTokenizerBase | None = None,
                   pipeline_rank: int | None = None) -> tuple[Any, Any, Any]:
    """Train, valid and test datasets (each ``None`` when its split is empty or this rank reads no data).

    ``config``: the run (:func:`~megatron_zb.training.run_config.run_config` of validated args); the
    tokenizer defaults to ``config.data.tokenizer``'s. With
    ``torch.distributed`` initialised, call on every rank (megatron-core synchronises with
    barriers). ``pipeline_rank`` defaults to megatron-core's ``parallel_state`` when initialised,
    else this process is treated as a data-consuming rank.
    """
    data = config.data
    tokenizer = tokenizer if tokenizer is not None else data.tokenizer.build()
    if pipeline_rank is None:
        pipeline_rank = _default_pipeline_rank()
    every_rank = config.schedule.enable_vocab_parallel  # the vocabulary passes need tokens and labels
    consumes = pipeline_rank is None or every_rank or pipeline_rank_consumes_data(
        pipeline_rank, pipeline_size=config.parallel.pipeline_model_parallel_size,
        placement=config.schedule.placement)
    if not consumes and not torch.distributed.is_initialized():
        return None, None, None  # no collective to take part in
    cache_dir = resolve_data_cache_dir(data)
    if cache_dir is not None:
        check_cache_dir_shared(cache_dir)
    dataset_config = gpt_dataset_config(config, tokenizer, cache_dir=cache_dir)
    cls = MockGPTDataset if data.mock_data else GPTDataset
    builder = BlendedMegatronDatasetBuilder(cls, list(train_valid_test_num_samples(config)), lambda: consumes,
                                            dataset_config)
    blends = [data.data_blend] + list(data.data_blend_per_split or [])
    blended = any(b is not None and (len(b[0]) > 1 or b[1] is not None) for b in blends)
    with single_process_group() if blended and cache_dir is not None else contextlib.nullcontext():
        train, valid, test = builder.build()
    if not consumes:
        return None, None, None
    return train, valid, test


# ---------------------------------------------------------------------------- iterators
class MicroBatchSampler:
    """Index lists of one micro batch for one data-parallel rank (Megatron's pretraining sampler).

    Global batch ``k`` of micro batches covers samples ``consumed + k*mbs*dp ..`` (consecutive);
    rank ``r`` takes the ``r``-th ``mbs`` of them. Incomplete trailing batches are dropped.
    """

    def __init__(self, *, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int) -> None:
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} not in 0..{data_parallel_size - 1}")
        if micro_batch_size < 1 or consumed_samples < 0:
            raise ValueError(f"need micro_batch_size >= 1 and consumed_samples >= 0, got {micro_batch_size}, "
                             f"{consumed_samples}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size

    @property
    def _step(self) -> int:
        return self.micro_batch_size * self.data_parallel_size

    def __len__(self) -> int:
        return max(0, (self.total_samples - self.consumed_samples) // self._step)

    def __iter__(self) -> Iterator[list[int]]:
        lo = self.data_parallel_rank * self.micro_batch_size
        for start in range(self.consumed_samples, self.total_samples - self._step + 1, self._step):
            yield list(range(start + lo, start + lo + self.micro_batch_size))


def _iterator(dataset: Any, *, consumed_samples: int, config: RunConfig, data_parallel_rank: int
              ) -> Iterator[dict[str, torch.Tensor]] | None:
    if dataset is None:
        return None
    sampler = MicroBatchSampler(total_samples=len(dataset), consumed_samples=consumed_samples,
                                micro_batch_size=config.micro_batch_size, data_parallel_rank=data_parallel_rank,
                                data_parallel_size=config.parallel.data_parallel_size)
    data = config.data
    workers = data.num_workers
    # A generator of its own: iter() draws the workers' base seed from it, not from the default CPU
    # generator -- which dropout draws from (on CPU megatron's "CUDA" stream is that generator too),
    # so building iterators after a checkpoint's random states are restored shifts no dropout mask.
    worker_init_fn = None
    if workers > 0 and (data.exit_signal_handler or data.exit_signal_handler_for_dataloader):
        from megatron_zb.training.preemption import IgnoreSignalInWorker

        worker_init_fn = IgnoreSignalInWorker(data.exit_signal)  # the job's stop signal must not end the workers
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=workers,
                                         pin_memory=torch.cuda.is_available(), persistent_workers=workers > 0,
                                         generator=torch.Generator().manual_seed(config.seed),
                                         worker_init_fn=worker_init_fn)
    return iter(loader)


def build_data_iterators(config: RunConfig, *, datasets: tuple[Any, Any, Any] | None = None,
                         consumed_train_samples: int = 0, consumed_valid_samples: int = 0,
                         data_parallel_rank: int | None = None, pipeline_rank: int | None = None,
                         tokenizer: MegatronTokenizerBase | None = None
                         ) -> tuple[Iterator[dict[str, torch.Tensor]] | None, ...]:
    """Train, valid and test micro-batch iterators (see the module docstring for the batch format).

    Builds the datasets with :func:`build_datasets` unless ``datasets`` is given (then nothing
    collective happens). ``consumed_*_samples`` resume a run (from the checkpoint's counters).
    ``data_parallel_rank`` defaults to megatron-core's ``parallel_state`` when initialised, else 0.
    """
    if datasets is None:
        datasets = build_datasets(config, tokenizer=tokenizer, pipeline_rank=pipeline_rank)
    dp_rank = data_parallel_rank if data_parallel_rank is not None else _default_data_parallel_rank()
    train, valid, test = datasets
    return (_iterator(train, consumed_samples=consumed_train_samples, config=config, data_parallel_rank=dp_rank),
            _iterator(valid, consumed_samples=consumed_valid_samples, config=config, data_parallel_rank=dp_rank),
            _iterator(test, consumed_samples=0, config=config, data_parallel_rank=dp_rank))


def get_batch(data_iterator: Iterator[dict[str, torch.Tensor]] | None, *, device: torch.device | str | None = None
              ) -> dict[str, torch.Tensor] | None:
    """The next micro batch moved to ``device`` (default: CUDA's current device if available, else CPU).

    Returns ``None`` for a ``None`` iterator (pipeline ranks that read no data).
    """
    if data_iterator is None:
        return None
    batch = next(data_iterator)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return {k: batch[k].to(device, non_blocking=True) for k in BATCH_KEYS if k in batch}

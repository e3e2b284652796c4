"""The compatibility matrix's ``vocab-parallel`` column, rank side: a family's vocabulary-parallel form.

A megatron-zb arm of a :class:`~megatron_zb.testing.compat_features.Feature` with ``vocab_parallel``
runs the family's vocabulary-parallel schedule (:func:`vocab_schedule`: ``<family>-vocab-1``, the
paper's Vocab-1, two barriers) on the same chunks as every other arm with their word embedding and
output layer handed to :class:`~megatron_zb.model.vocab_parallel.VocabParallelSlices` over the
model-parallel group (:func:`attach_slices`, as ``pretrain_gpt_zb.py --enable-vocab-parallel`` wires
them: the slices in their own megatron-core DDP, stepped by the same optimizer, T's weight gradient
in T -- the product's default). The reference arm is megatron-core's schedule on the unsliced model;
the slices' gradients and parameters are gathered and reported under megatron-core's names
(:func:`gathered`), so every cell compares them as it compares the chunks'.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["VOCAB_FORM", "attach_slices", "gathered", "vocab_schedule"]

VOCAB_FORM = 1
"""The vocabulary form the column runs (``-vocab-1``: two barriers, megatron-core's exact softmax arithmetic)."""


def vocab_schedule(family: str) -> str:
    """The registered vocabulary-parallel form of ``family``; a family without one is refused by name
    (``ValueError``, listing the forms there are)."""
    from ..schedules.registry import vocab_schedule_names

    name = f"{family}-vocab-{VOCAB_FORM}"
    names = vocab_schedule_names()
    if name not in names:
        forms = ", ".join(n for n in names if n.endswith(f"-vocab-{VOCAB_FORM}"))
        raise ValueError(f"'{family}' has no vocabulary-parallel form (no schedule '{name}'; the forms there are: "
                         f"{forms})")
    return name


def attach_slices(chunks: list[Any], *, vocab: int, hidden: int, seed: int, dtype: torch.dtype,
                  device: torch.device) -> tuple[Any, Any]:
    """Strip the chunks' word embedding and output layer and build this rank's slices of them over the
    model-parallel group, drawn from the same seeds (the slices of the same matrices), wrapped in megatron-core
    DDP as the product wraps them (``overlap_grad_reduce`` off: the runtime reduces them after the schedule).

    Returns ``(VocabParallelModel, slices' DDP module)``; the DDP module goes to the optimizer and is zeroed
    with the chunks. ``vocab``: the padded vocabulary (rows); ``hidden``: the hidden size.
    """
    import dataclasses

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel

    from ..model.vocab_chunks import strip_vocab_layers
    from ..model.vocab_parallel import VocabParallelSlices
    from ..runtime.vocab_runtime import VocabParallelModel
    from ..training.run_config import ParallelConfig, PrecisionConfig
    from ..training.wiring import ddp_config

    for c in chunks:
        strip_vocab_layers(c.module)
    config = chunks[0].module.config
    slices = VocabParallelSlices(padded_size=vocab, hidden_size=hidden, group=parallel_state.get_model_parallel_group(),
                                 tied=False, seed=seed, init_method=config.embedding_init_method,
                                 output_init_method=config.init_method, params_dtype=dtype)
    cfg = dataclasses.replace(ddp_config(ParallelConfig(), PrecisionConfig()), overlap_grad_reduce=False,
                              overlap_param_gather=False)
    module = DistributedDataParallel(config=config, ddp_config=cfg, module=slices.to(device),
                                     disable_bucketing=True)
    return VocabParallelModel(slices, ddp=module), module


def gathered(vocab: Any, *, grads: bool) -> dict[str, torch.Tensor]:
    """The slices' full matrices (``grads``: their ``main_grad``; else the parameters) under megatron-core's
    names, on model-parallel rank 0 only (every rank takes part in the gathers; the others return ``{}``,
    so that merging the ranks' results never sees a name twice)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_model_parallel_group()
    out = {}
    for name, weight in (("embedding.word_embeddings.weight", vocab.slices.word_embeddings),
                         ("output_layer.weight", vocab.slices.output_layer_weight)):
        t = (weight.main_grad if grads else weight).detach().contiguous()
        parts = [torch.empty_like(t) for _ in range(group.size())]
        dist.all_gather(parts, t, group=group)
        out[name] = torch.cat(parts).cpu()
    return out if dist.get_rank(group) == 0 else {}

"""GPT chunks for vocabulary parallelism: the first stage's word embedding and the last stage's output
layer (with its cross entropy) handed to :class:`~megatron_zb.model.vocab_parallel.VocabParallelSlices`,
which every pipeline rank holds a slice of (docs/vocab_parallel.md).

:func:`strip_vocab_layers` turns a megatron-core ``GPTModel`` chunk built as usual (e.g. by
:func:`~megatron_zb.model.build_gpt_chunks`) into one that runs everything else of megatron-core's
model unchanged:

* first stage: ``embedding.word_embeddings`` becomes :class:`VocabEmbeddingInput`, which returns the
  embedding the runtime's ``IF`` all-reduce produced for the microbatch in flight (checked against
  the token ids the model was called with); the position embedding and the embedding dropout stay;
  with sequence parallelism it returns what megatron-core's word embedding returns there (below);
* last stage: the output layer becomes :class:`HiddenOutput` (no parameter) and the chunk's
  ``compute_language_model_loss`` hands the final norm's output ``X`` ``[s, b, h]`` back unchanged,
  so that the chunk's forward returns ``X`` (the runtime's ``S``/``T`` passes compute the loss);
* with sequence parallelism (a tensor rank holds ``s / TP`` rows of the activations) the stand-ins do
  megatron-core's sequence-parallel mappings: :class:`HiddenOutput` all-gathers the final norm's rows over
  the tensor group, as ``ColumnParallelLinear`` does before its GEMM, so ``X`` is whole and the same on
  every tensor rank, and its backward takes this rank's rows of ``X``'s gradient (which the runtime gives
  whole: the sum over every slice); :class:`VocabEmbeddingInput` returns IF's whole sum where
  megatron-core's ``LanguageModelEmbedding`` scatters it itself (a learned position embedding), or this
  rank's rows ``[s / TP, b, h]`` of it where megatron-core's word embedding would reduce-scatter
  (``reduce_scatter_embeddings``: no position embedding), whose backward all-gathers the gradient, so the
  embedding's gradient is whole and the same on every tensor rank either way;
* its ``sharded_state_dict`` (checkpoints) holds neither layer: the slices' holds them.

The full-vocabulary weights the chunk was built with are dropped (built first, then freed: a build
without them is not done yet).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch

__all__ = ["HiddenOutput", "VocabEmbeddingInput", "embedding_source", "strip_vocab_layers"]

_SOURCE: Callable[[torch.Tensor], torch.Tensor] | None = None


@contextlib.contextmanager
def embedding_source(source: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """While open, :class:`VocabEmbeddingInput` returns ``source(input_ids)`` (the runtime opens it
    around the first stage's ``F``; process-wide, as the weight-gradient store's window)."""
    global _SOURCE
    if _SOURCE is not None:
        raise RuntimeError("embedding_source: a first-stage forward is already in flight")
    _SOURCE = source
    try:
        yield
    finally:
        _SOURCE = None


class VocabEmbeddingInput(torch.nn.Module):
    """Stand-in for the first stage's word embedding: the ``[b, s, h]`` embedding of the microbatch
    in flight, summed over the pipeline ranks' slices by the runtime (``IF``); no parameter.

    ``reduce_scatter_group``: the tensor group where megatron-core's word embedding reduce-scatters its
    output to the sequence-parallel region (``VocabParallelEmbedding.reduce_scatter_embeddings``): then
    this rank's rows ``[s / TP, b, h]`` of the sum (``scatter_to_sequence_parallel_region``: the sum is
    already whole; its backward all-gathers the gradient)."""

    def __init__(self, reduce_scatter_group: Any = None) -> None:
        super().__init__()
        self.reduce_scatter_group = reduce_scatter_group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if _SOURCE is None:
            raise RuntimeError("the word embedding of this chunk is vocabulary-parallel: run it through "
                               "megatron-zb's runtime with a vocabulary-parallel schedule (e.g. 1f1b-vocab-1)")
        out = _SOURCE(input_ids)
        if self.reduce_scatter_group is None:
            return out
        from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

        return scatter_to_sequence_parallel_region(out.transpose(0, 1).contiguous(), group=self.reduce_scatter_group)


class HiddenOutput(torch.nn.Module):
    """Stand-in for the last stage's output layer: returns its input (the final norm's output) and no
    bias, as ``ColumnParallelLinear`` returns ``(output, bias)``; no parameter.

    ``gather_group``: with sequence parallelism the tensor group, over which the input's ``s / TP`` rows are
    all-gathered first (as ``ColumnParallelLinear`` does), ``[s, b, h]`` on every tensor rank; the backward
    takes this rank's rows of the (whole, already summed) gradient: ``tensor_parallel_output_grad=False``."""

    def __init__(self, gather_group: Any = None) -> None:
        super().__init__()
        self.gather_group = gather_group

    def forward(self, hidden_states: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None
                ) -> tuple[torch.Tensor, None]:
        if self.gather_group is None:
            return hidden_states, None
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        return gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False,
                                                    group=self.gather_group), None


def _hidden_as_loss(labels: Any, logits: torch.Tensor) -> torch.Tensor:
    """The chunk's ``compute_language_model_loss``: ``X`` ``[s, b, h]`` back unchanged."""
    return logits


def _stripped_sharded_state_dict(module: Any, prefix: str = "", sharded_offsets: tuple = (),
                                 metadata: Any = None) -> dict[str, Any]:
    """A stripped chunk's megatron-core ``sharded_state_dict``: its ``GPTModel``'s without the vocabulary
    layers (the slices checkpoint those: ``VocabParallelSlices.sharded_state_dict``). megatron-core's
    ``LanguageModule`` marks the last stage's ``output_layer.weight``, which :class:`HiddenOutput` does
    not have: the method runs with ``post_process`` off (nothing else of it reads that flag)."""
    post = module.post_process
    module.post_process = False
    try:
        return type(module).sharded_state_dict(module, prefix, sharded_offsets, metadata)
    finally:
        module.post_process = post


def strip_vocab_layers(module: Any) -> None:
    """Make the megatron-core ``GPTModel`` chunk ``module`` vocabulary-parallel (module docstring).

    Untied embeddings only (``share_embeddings_and_output_weights=False``); multi-token prediction
    is refused. Idempotent."""
    if getattr(module, "vocab_parallel_stripped", False):
        return
    if getattr(module, "share_embeddings_and_output_weights", False):
        raise NotImplementedError("vocabulary parallelism with tied embeddings is not run by the runtime yet "
                                  "(build the model with share_embeddings_and_output_weights=False)")
    if getattr(module.config, "mtp_num_layers", None):
        raise NotImplementedError("vocabulary parallelism with multi-token prediction is not supported")
    if module.pre_process:
        old = module.embedding.word_embeddings
        module.embedding.word_embeddings = VocabEmbeddingInput(
            old.tp_group if getattr(old, "reduce_scatter_embeddings", False) else None)
    if module.post_process:
        layer = module.output_layer
        module.output_layer = HiddenOutput(layer.tp_group if getattr(layer, "sequence_parallel", False) else None)
        module.compute_language_model_loss = _hidden_as_loss
    module.sharded_state_dict = functools.partial(_stripped_sharded_state_dict, module)
    module.vocab_parallel_stripped = True

"""Multi-token prediction (MTP, ``--mtp-num-layers``) in the chunks of any placement.

megatron-core builds the MTP block (``MultiTokenPredictionBlock``) on the chunk that holds the
output layer when ``GPTModel`` is given an ``mtp_block_spec``; :func:`mtp_block_spec` is
Megatron-LM's (``gpt_builders.py``: ``get_gpt_mtp_block_spec`` of the decoder's last layer spec),
with each MTP layer built as :class:`SeededMTPLayer` so that its weights are the same in every
placement (the rule of :mod:`megatron_zb.model.gpt_chunks`: one derived seed per named part).
The chunk's :class:`~megatron_zb.model.gpt_chunks.ChunkPlan` answers megatron-core's layout
questions for ``LayerType.mtp`` (how many MTP layers the chunk builds, their offset 0).

The MTP chunk keeps its own copy of the word embedding (and learned position embedding) when it
is not the first stage, as megatron-core does; megatron-core keeps the word embedding in sync with
stage 0's through the embedding group (``setup_embeddings_and_output_layer`` at construction,
``finalize_model_grads`` after each backward). :func:`~megatron_zb.model.gpt_chunks.build_gpt_chunks`
draws both from stage 0's seeds.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator, Sequence

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

from ..param_marks import WGRAD_IN_B

__all__ = ["WGRAD_IN_B", "OneRankEmbeddingGPTModel", "SeededMTPLayer", "check_mtp_placement", "mtp_block_spec",
           "inner_layer_name", "mtp_on_first_rank", "no_virtual_stages", "share_word_embedding", "tie_mtp_stage"]


def _seed(seed: int, *key: int | str) -> int:
    from megatron_zb.model.gpt_chunks import derive_seed  # gpt_chunks imports this module

    return derive_seed(seed, *key)


def _mtp_layer_class() -> type:
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    return MultiTokenPredictionLayer


class SeededMTPLayer(_mtp_layer_class()):  # type: ignore[misc]
    """megatron-core's ``MultiTokenPredictionLayer`` whose parameters (projection, norms and its
    transformer layer) are drawn from ``derive_seed(init_seed, "mtp_layer", k)``, ``k`` the 0-based
    MTP depth: the same weights whatever rank or stage builds it. The CPU RNG is restored afterwards."""

    def __init__(self, config: TransformerConfig, submodules: Any, layer_number: int = 1, *args: Any,
                 init_seed: int, **kwargs: Any) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_seed(init_seed, "mtp_layer", layer_number - 1))
            super().__init__(config, submodules, layer_number, *args, **kwargs)
        reseed = getattr(getattr(self, inner_layer_name(self.submodules)), "reseed", None)  # e.g. experts (MoE)
        if reseed is not None and config.perform_initialization:
            reseed(init_seed, "mtp_layer", layer_number - 1)


def check_mtp_placement(plans: Sequence[Any], mtp_num_layers: int | None) -> None:
    """Refuse MTP on a placement whose MTP stage (the last) has no way to share the first stage's word
    embedding: either the first stage on rank 0 and the last alone on the last rank (megatron-core's
    embedding group keeps the MTP stage's copy in sync), or both on one rank (a V: one parameter,
    :func:`share_word_embedding`), or everything one stage. ``plans``: the placement's
    :class:`~megatron_zb.model.gpt_chunks.ChunkPlan` s in stage order."""
    if not mtp_num_layers or len(plans) == 1 or mtp_on_first_rank(plans):
        return
    last = max(p.rank for p in plans)
    if plans[0].rank != 0 or plans[-1].rank != last:
        raise NotImplementedError(
            "multi-token prediction needs the last stage on the last pipeline rank and the first on rank 0 "
            "(megatron-core syncs the MTP stage's word-embedding copy over their embedding group), or both on "
            f"rank 0 (a V); this placement has them on ranks {plans[0].rank} and {plans[-1].rank}")


def mtp_on_first_rank(plans: Sequence[Any]) -> bool:
    """True when the MTP stage (the last) shares rank 0 with the first stage (the V placement)."""
    return len(plans) > 1 and bool(plans[-1].num_mtp_layers) and plans[0].rank == plans[-1].rank == 0


class OneRankEmbeddingGPTModel(GPTModel):
    """A first or MTP chunk of a placement that holds both on rank 0 (the V): the word embedding is one
    parameter (stage 0's; :func:`share_word_embedding`), not a copy on another stage, so megatron-core's
    embedding-group set-up and gradient all-reduce have nothing to do. megatron-core would ask them
    because the config has ``mtp_num_layers`` (it assumes the MTP stage is on another rank): the set-up runs
    as without MTP (its ``mtp_process`` asserts the stage is not on the first rank), and the first chunk
    answers ``finalize_model_grads``' "duplicated word embedding?" with None, as the V's middle chunks on
    the last rank do (else rank 0 alone would enter the all-reduce)."""

    def setup_embeddings_and_output_layer(self) -> None:
        saved, self.config.mtp_num_layers = self.config.mtp_num_layers, None  # the chunk's own config copy
        try:
            super().setup_embeddings_and_output_layer()
        finally:
            self.config.mtp_num_layers = saved

    def shared_embedding_or_output_weight(self) -> Any:
        if self.pre_process and not self.post_process:
            return None  # not duplicated on another stage
        return super().shared_embedding_or_output_weight()

    def sharded_state_dict(self, prefix: str = "", *args: Any, **kwargs: Any) -> Any:
        """megatron-core's, without the MTP stage's word-embedding copy: it has none (the first chunk saves the
        one parameter), so the MTP chunk's state dict has no such key either."""
        if not (self.mtp_process and not self.pre_process):
            return super().sharded_state_dict(prefix, *args, **kwargs)
        emb = self.embedding.word_embeddings
        word = emb.__dict__.pop("weight")
        emb.register_parameter("weight", word)  # for megatron-core's traversal only
        try:
            out = super().sharded_state_dict(prefix, *args, **kwargs)
        finally:
            del emb.weight
            object.__setattr__(emb, "weight", word)
        del out[f"{prefix}embedding.word_embeddings.weight"]
        return out


def share_word_embedding(module: Any, word: torch.nn.Parameter) -> None:
    """Make the MTP chunk ``module`` (a V's last stage, on rank 0) look its MTP tokens up in ``word``, the
    first stage's word-embedding parameter on the same rank, instead of its own copy: one parameter, its
    gradient the sum of both stages' (megatron-core at PP > 1: two copies whose gradients the embedding group
    all-reduces, the same sum in another order). Not registered in ``module`` (DDP wraps it once, with stage
    0). The MTP chunk's learned position table, if any, stays its own as megatron-core's (never synced)."""
    emb = module.embedding.word_embeddings
    if tuple(emb.weight.shape) != tuple(word.shape):
        raise ValueError(f"word embedding of shape {tuple(word.shape)} does not fit the MTP stage's "
                         f"{tuple(emb.weight.shape)}")
    del emb.weight
    object.__setattr__(emb, "weight", word)  # an attribute, not a parameter of this chunk


@contextlib.contextmanager
def no_virtual_stages() -> Iterator[None]:
    """Build an MTP chunk as the one-stage chunk it is (``vp_stage=None``, like every chunk): megatron-core
    0.19's ``GPTModel`` asks ``mtp_on_this_rank`` with virtual stages whenever ``parallel_state`` has a
    virtual pipeline size (megatron-core's interleaved schedule sets one), and asserts a ``vp_stage``;
    without one it reads the chunk's layout (:attr:`~megatron_zb.model.gpt_chunks.ChunkPlan.layout`)."""
    from megatron.core import parallel_state

    saved = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    parallel_state.set_virtual_pipeline_model_parallel_world_size(None)
    try:
        yield
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(saved)


def mtp_block_spec(config: TransformerConfig, layer_spec: ModuleSpec, *, seed: int) -> Any:
    """The MTP block spec of the chunk whose config is ``config`` (``None`` when it builds no MTP
    layer): megatron-core's ``get_gpt_mtp_block_spec`` of the decoder's layer spec ``layer_spec``
    (local implementation), each layer a :class:`SeededMTPLayer` drawn from ``seed``. A decoder layer class
    that picks its submodules per layer (e.g. MoE or dense MLP by ``--moe-layer-freq``) names the MTP's
    transformer layer with a static ``mtp_inner_spec(layer_spec) -> ModuleSpec`` -- as megatron-core's, the
    decoder's last layer's kind -- whose module may define ``reseed(seed, *key)``, called after the MTP layer
    is built (``key``: ``("mtp_layer", depth)``)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    base = copy.copy(layer_spec)
    inner = None
    if isinstance(base.module, type) and issubclass(base.module, TransformerLayer):
        inner_of = getattr(base.module, "mtp_inner_spec", None)
        inner = inner_of(base) if inner_of is not None else None
        if inner is not None:
            base.submodules = inner.submodules
        base.module = TransformerLayer  # megatron-core asks for exactly TransformerLayer; the MTP layer seeds it
        base.params = {}
    block = get_gpt_mtp_block_spec(config, base, use_transformer_engine=False)
    if block is None:
        return None
    block = copy.copy(block)
    block.layer_specs = [_seeded(spec, seed, inner) for spec in block.layer_specs]
    return block


def _seeded(spec: ModuleSpec, seed: int, inner: ModuleSpec | None) -> ModuleSpec:
    """``spec`` built as :class:`SeededMTPLayer` drawn from ``seed``; ``inner``: its transformer layer's spec
    (the decoder layer class's ``mtp_inner_spec``; ``None``: megatron-core's)."""
    out = copy.copy(spec)
    out.module = SeededMTPLayer
    out.params = {**out.params, "init_seed": seed}
    if inner is not None:
        out.submodules = copy.copy(out.submodules)
        setattr(out.submodules, inner_layer_name(out.submodules), inner)
    return out


def inner_layer_name(submodules: Any) -> str:
    """The name of an MTP layer's transformer layer, in its submodules and as its attribute: megatron-core
    0.16's ``transformer_layer``, 0.19's ``mtp_model_layer`` (the submodules dataclass has the field)."""
    return "mtp_model_layer" if hasattr(submodules, "mtp_model_layer") else "transformer_layer"


def tie_mtp_stage(module: Any) -> None:
    """On a chunk with MTP layers and tied embeddings (the word embedding serves the MTP layers' lookup
    and the output layer): mark the word embedding so that the output layer's weight gradient is
    computed in B (:data:`WGRAD_IN_B`, read by the runtime's linear route) -- its lookup's gradient
    arrives in B, through autograd, and autograd must sum every use before DDP's hook adds them once,
    as megatron-core does; deferring it instead would drop the lookup's gradient (DDP's hook skips a
    ``.grad`` once a deferred linear marked the weight ``grad_added_to_main_grad``) or, with
    ``zero_out_wgrad``, add it separately (not bitwise). On a stage that is not the first, also drop the
    output layer's own weight, which megatron-core allocates there but never uses (the forward passes the
    embedding's): its own ``sharded_state_dict`` asserts it is absent, so no checkpoint could be saved
    (megatron-core 0.16.1 and 0.19). No-op elsewhere."""
    if not getattr(module, "mtp_process", False) or not module.share_embeddings_and_output_weights:
        return
    setattr(module.shared_embedding_or_output_weight(), WGRAD_IN_B, True)
    if module.post_process and not module.pre_process and module.output_layer.weight is not None:
        del module.output_layer.weight
        module.output_layer.weight = None

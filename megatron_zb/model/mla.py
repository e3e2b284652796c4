"""Multi-latent attention on megatron-core's local layer spec.

megatron-core's ``MLASelfAttention`` builds its core attention with the query/key and value head sizes
(``k_channels=qk_head_dim + qk_pos_emb_head_dim``, ``v_channels=v_head_dim``), which Transformer Engine's
``TEDotProductAttention`` takes and megatron-core's local ``DotProductAttention`` does not (0.16.1 and
0.19 alike: ``get_gpt_layer_local_spec(multi_latent_attention=True)`` fails with a ``TypeError`` when the
layer is built, in Megatron-LM's ``--transformer-impl local`` too). :class:`MLADotProductAttention` is
megatron-core's ``DotProductAttention`` taking them -- the same unfused softmax(Q K^T * scale) V, with MLA's
softmax scale (it always passes one) and a context of ``heads * v_channels`` -- and
:func:`mla_local_spec` puts it into a local layer spec. Every other module of the spec is megatron-core's.
(megatron-core 0.16.1 also needs to be told that Transformer Engine is absent:
:func:`megatron_zb.megatron_compat.mla.fix_mla_without_te`.)
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import divide

__all__ = ["MLADotProductAttention", "mla_local_spec"]


class MLADotProductAttention(DotProductAttention):
    """megatron-core's local ``DotProductAttention`` with per-head query/key channels ``k_channels`` and
    value channels ``v_channels`` (elements), as ``TEDotProductAttention`` takes them; without them (the
    ``Attention`` base class builds one before ``MLASelfAttention`` replaces it) megatron-core's own."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str, *,
                 k_channels: int | None = None, v_channels: int | None = None, softmax_scale: float | None = None,
                 **kwargs: Any) -> None:
        super().__init__(config, layer_number, attn_mask_type, attention_type, softmax_scale=softmax_scale, **kwargs)
        if k_channels is None or v_channels is None:
            return
        tp = self.tp_group.size()
        self.hidden_size_per_attention_head = v_channels
        self.hidden_size_per_partition = divide(v_channels * config.num_attention_heads, tp)
        if softmax_scale is None:  # TE's default: 1 / sqrt(query/key channels)
            self.softmax_scale = 1.0 / math.sqrt(k_channels)
            if config.apply_query_key_layer_scaling:
                self.softmax_scale /= self.layer_number


def mla_local_spec(spec: ModuleSpec) -> ModuleSpec:
    """A copy of the local layer spec ``spec`` (``get_gpt_layer_local_spec(multi_latent_attention=True)``,
    or a MoE spec built from it) whose self-attention's core attention is :class:`MLADotProductAttention`;
    also lets megatron-core 0.16.1's ``MLASelfAttention`` build without Transformer Engine
    (:func:`megatron_zb.megatron_compat.mla.fix_mla_without_te`)."""
    from megatron_zb.megatron_compat.mla import fix_mla_without_te

    fix_mla_without_te()
    attention = copy.copy(spec.submodules.self_attention)
    attention.submodules = dataclasses.replace(attention.submodules, core_attention=MLADotProductAttention)
    out = copy.copy(spec)
    out.submodules = copy.copy(spec.submodules)
    out.submodules.self_attention = attention
    return out

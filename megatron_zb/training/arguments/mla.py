"""Multi-latent attention flags (Megatron-LM's "mla" group, ``--multi-latent-attention`` and ``--rope-type``):
names, defaults and meanings as Megatron-LM's; their checks.

With ``--multi-latent-attention`` the model's config is megatron-core's ``MLATransformerConfig`` and its
layers megatron-core's local spec with ``multi_latent_attention=True`` (``MLASelfAttention``), as
Megatron-LM's ``core_transformer_config_from_args`` and ``gpt_builders``: the MLA fields the flags set
(:data:`MLA_DEFAULTS`), ``--normalization``, ``--rotary-base`` and ``--rotary-percent`` go into the
config, ``--rope-type`` only when given (else ``MLATransformerConfig``'s ``yarn``). Every projection of
``MLASelfAttention`` (``linear_q_proj`` or ``linear_q_down_proj`` / ``linear_q_up_proj``,
``linear_kv_down_proj``, ``linear_kv_up_proj``, ``linear_proj``) is a megatron-core
``ColumnParallelLinear`` / ``RowParallelLinear``, so its weight gradient goes to W through the runtime's
``linear`` route; ``q_layernorm`` / ``kv_layernorm`` (with ``--qk-layernorm``) compute their weight
gradients in B, as every norm does.

Refused with the flag named: Megatron-LM's and megatron-core's own refusals (grouped-query attention,
``--rotary-interleaved``, ``--rope-type yarn`` without MLA), an odd ``--qk-pos-emb-head-dim`` (rotary
embeddings rotate pairs of channels), an MLA flag set without ``--multi-latent-attention`` (it would
have no effect), and what megatron-zb has not verified with MLA: Transformer Engine's layer spec
(:func:`.implementation.resolve_transformer_impl`) and ``--profile-out`` (the planner models standard
attention). ``--log-throughput`` counts MLA's FLOPs as Megatron-LM (:mod:`megatron_zb.planning.model_flops`).
``--cache-mla-latents`` (inference with FlashMLA) is not in the parser.
"""

from __future__ import annotations

import argparse
from typing import Any

from .common import ArgumentError

__all__ = ["MLA_DEFAULTS", "add_mla_args", "check_mla"]

MLA_DEFAULTS: dict[str, Any] = {
    "q_lora_rank": None, "kv_lora_rank": 32, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64, "v_head_dim": 128,
    "rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0,
}
"""The MLA flags' ``dest`` -> Megatron-LM's default (its ``_add_mla_args``; ``MLATransformerConfig`` has
other defaults, which Megatron-LM's flags override)."""


def add_mla_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("mla")
    d = MLA_DEFAULTS
    g.add_argument("--multi-latent-attention", action="store_true",
                   help="Multi-latent attention (DeepSeek-V2/V3): megatron-core's MLATransformerConfig and "
                        "MLASelfAttention (local layer spec).")
    g.add_argument("--q-lora-rank", type=int, default=d["q_lora_rank"],
                   help="Rank of the query's low-rank representation (default: none, one query projection).")
    g.add_argument("--kv-lora-rank", type=int, default=d["kv_lora_rank"],
                   help="Rank of the keys' and values' low-rank representation (default 32).")
    g.add_argument("--qk-head-dim", type=int, default=d["qk_head_dim"],
                   help="Channels of a head in the QK projection; q_head_dim = qk_head_dim + qk_pos_emb_head_dim "
                        "(default 128).")
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=d["qk_pos_emb_head_dim"],
                   help="Channels of the position embedding in the QK projection (default 64).")
    g.add_argument("--v-head-dim", type=int, default=d["v_head_dim"],
                   help="Channels of a head in the V projection (default 128).")
    g.add_argument("--rotary-scaling-factor", type=float, default=d["rotary_scaling_factor"],
                   help="Rotary scaling factor of the rotary embeddings (YaRN; default 1.0).")
    g.add_argument("--mscale", type=float, default=d["mscale"],
                   help="Mscale of YaRN RoPE in multi-latent attention (default 1.0).")
    g.add_argument("--mscale-all-dim", type=float, default=d["mscale_all_dim"],
                   help="Mscale of all dimensions of YaRN RoPE in multi-latent attention (default 0.0).")
    g.add_argument("--rope-type", type=str, default=None, choices=("rope", "yarn"),
                   help="Type of RoPE: multi-latent attention takes yarn by default, standard attention rope "
                        "(the only type it supports).")


def check_mla(args: argparse.Namespace) -> None:
    """The MLA flags form a combination Megatron-LM and megatron-core build, and megatron-zb has verified."""
    if not args.multi_latent_attention:
        if args.rope_type == "yarn":  # Megatron-LM's core_transformer_config_from_args
            raise ArgumentError("--rope-type", "yarn needs --multi-latent-attention (standard attention supports "
                                               "only rope); drop it or add --multi-latent-attention")
        for dest, default in MLA_DEFAULTS.items():
            if getattr(args, dest) != default:
                name = "--" + dest.replace("_", "-")
                raise ArgumentError(name, "has no effect without --multi-latent-attention; add "
                                          "--multi-latent-attention or drop it")
        return
    for dest, on, why in (
            ("group_query_attention", args.group_query_attention, "is mutually exclusive with multi-latent attention "
                                                                  "(Megatron-LM); drop it"),
            ("rotary_interleaved", args.rotary_interleaved, "does not work with multi-latent attention "
                                                            "(megatron-core); drop it"),
            ("profile_out", getattr(args, "profile_out", None),
             "writes standard attention's planner model: not supported with --multi-latent-attention yet; drop it")):
        if on:
            raise ArgumentError("--" + dest.replace("_", "-"), why)
    if args.qk_pos_emb_head_dim % 2:
        raise ArgumentError("--qk-pos-emb-head-dim", f"must be even (rotary embeddings rotate pairs of channels), "
                                                     f"got {args.qk_pos_emb_head_dim}")
    if not args.rotary_scaling_factor > 0:
        raise ArgumentError("--rotary-scaling-factor", f"must be > 0, got {args.rotary_scaling_factor}")

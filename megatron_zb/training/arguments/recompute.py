"""Activation recomputation and pipeline-split flags (Megatron-LM's names, defaults and meanings).

Recomputation is megatron-core's own (``TransformerConfig.recompute_*``: full layers through
``tensor_parallel.checkpoint``, selective submodules through its checkpoint helpers); the
zero-bubble runtime's B still queues every linear layer's weight gradient for W when the
recomputed forward runs inside B (see ``docs/training.md``).

The uneven split flags decide ``num_layers_per_stage``
(:func:`~megatron_zb.training.arguments.zero_bubble.check_layers`, by the one split rule
:func:`megatron_zb.planning.layout.layers_per_stage`: megatron-core's rule for plain and
interleaved placements, per stage for V).
"""

from __future__ import annotations

import argparse

from .common import ArgumentError

__all__ = ["RECOMPUTE_MODULES", "add_pipeline_split_args", "add_recompute_args", "check_recompute"]

RECOMPUTE_MODULES: tuple[str, ...] = ("core_attn", "layernorm", "mlp", "moe", "shared_experts", "mla_up_proj")
"""``--recompute-modules`` choices of megatron-core 0.16.1 that this build can run (``mla_up_proj`` with
``--multi-latent-attention`` only, as megatron-core; its other choice, ``moe_act``, needs grouped-GEMM
experts)."""


def add_recompute_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("activation recomputation")
    g.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                   help="Recompute activations in backward: 'full' recomputes whole transformer layers (with "
                        "--recompute-method and --recompute-num-layers), 'selective' the submodules of "
                        "--recompute-modules. Default: no recomputation.")
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None,
                   help="With --recompute-granularity full: 'uniform' recomputes every group of "
                        "--recompute-num-layers layers, 'block' the first --recompute-num-layers layers of "
                        "each pipeline stage.")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="Layers per recomputed group (uniform) or recomputed layers per stage (block).")
    g.add_argument("--recompute-modules", nargs="*", type=str, default=None,
                   help=f"With --recompute-granularity selective: submodules to recompute, of "
                        f"{', '.join(RECOMPUTE_MODULES)} (default: core_attn).")


def add_pipeline_split_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("pipeline split")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="Transformer layers on the first pipeline stage (interleaved: the first rank, split "
                        "over its chunks; V: the first stage). The other stages share the rest evenly.")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="Transformer layers on the last pipeline stage (interleaved: the last rank; V: the "
                        "last stage, which sits on the first rank).")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="Count the embedding as one layer of the first stage when splitting the layers evenly.")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="Count the loss as one layer of the last stage when splitting the layers evenly.")


def check_recompute(args: argparse.Namespace) -> None:
    """The recompute flags form one of megatron-core's valid combinations."""
    gran, method, n = args.recompute_granularity, args.recompute_method, args.recompute_num_layers
    if gran is None:
        for dest, flag_ in (("recompute_method", "--recompute-method"), ("recompute_num_layers",
                                                                        "--recompute-num-layers"),
                            ("recompute_modules", "--recompute-modules")):
            if getattr(args, dest) is not None:
                raise ArgumentError(flag_, "has no effect without --recompute-granularity; add "
                                           "--recompute-granularity full|selective or drop it")
        return
    if gran == "full":
        if method is None or n is None:
            raise ArgumentError("--recompute-method", "--recompute-granularity full needs --recompute-method "
                                                      "uniform|block and --recompute-num-layers N")
        if n < 1 or (method == "uniform" and n > args.num_layers):
            raise ArgumentError("--recompute-num-layers", f"must be in [1, --num-layers {args.num_layers}], got {n}")
        if args.recompute_modules is not None:
            raise ArgumentError("--recompute-modules", "only applies to --recompute-granularity selective; drop it")
        return
    if method is not None or n is not None:
        raise ArgumentError("--recompute-method" if method is not None else "--recompute-num-layers",
                            "only applies to --recompute-granularity full; drop it (selective recomputes the "
                            "--recompute-modules of every layer)")
    bad = sorted(set(args.recompute_modules or ()) - set(RECOMPUTE_MODULES))
    if bad:
        raise ArgumentError("--recompute-modules", f"{', '.join(bad)} not supported; choose from "
                                                   f"{', '.join(RECOMPUTE_MODULES)}")
    if "mla_up_proj" in (args.recompute_modules or ()) and not getattr(args, "multi_latent_attention", False):
        raise ArgumentError("--recompute-modules", "mla_up_proj recomputes multi-latent attention's up projections; "
                                                   "add --multi-latent-attention or drop mla_up_proj")
    if "mlp" in (args.recompute_modules or ()) and getattr(args, "add_bias_linear", True):
        # megatron-core 0.16.1's MLP returns fc2's bias parameter out of its checkpoint; the backward
        # then recurses in CheckpointFunction.backward until the stack overflows, under its own
        # schedules too (seen on CPU, docs/training.md)
        raise ArgumentError("--recompute-modules", "mlp with linear biases fails in megatron-core 0.16.1's "
                                                   "recompute backward; add --disable-bias-linear or drop mlp")

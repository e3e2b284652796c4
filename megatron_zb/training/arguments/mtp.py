"""Multi-token prediction flags (Megatron-LM's ``--mtp-num-layers``, ``--mtp-loss-scaling-factor``):
names, defaults and meanings as Megatron-LM's; the placements and options they are verified with.

The MTP layers are built on the chunk holding the output layer (the last pipeline stage; with an
interleaved schedule the last virtual chunk of the last rank; with a V rank 0's second chunk, which looks
its tokens up in the first stage's word embedding), as megatron-core places them without a
custom layout (:mod:`megatron_zb.model.mtp`); their linear
layers defer W like every other (the runtime's ``linear`` route, which sums the output layer's
weight gradients of one microbatch -- it is used once per prediction depth -- before adding them,
as autograd does); with tied embeddings the MTP stage's output layer computes its weight gradient
in B (:func:`megatron_zb.model.mtp.tie_mtp_stage`).
"""

from __future__ import annotations

import argparse

from .common import ArgumentError

__all__ = ["add_mtp_args", "check_mtp"]


def add_mtp_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("multi-token prediction")
    g.add_argument("--mtp-num-layers", type=int, default=None,
                   help="Number of multi-token prediction layers (DeepSeek-V3's MTP), built on the last pipeline "
                        "stage; each predicts one more token ahead. Default: none.")
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1,
                   help="Scaling factor of the MTP loss: the MTP layers' mean loss times this factor is added to "
                        "the training loss (default 0.1).")


def check_mtp(args: argparse.Namespace) -> None:
    """``--mtp-num-layers``: >= 1; the local implementation; no ``--save`` with learned absolute positions at
    PP > 1 (needs ``transformer_impl``)."""
    n = args.mtp_num_layers
    if n is None:
        return
    if n < 1:
        raise ArgumentError("--mtp-num-layers", f"must be >= 1 (or omitted for no MTP), got {n}")
    if args.mtp_loss_scaling_factor < 0:
        raise ArgumentError("--mtp-loss-scaling-factor", f"must be >= 0, got {args.mtp_loss_scaling_factor}")
    if args.save and args.position_embedding_type == "learned_absolute" and args.pipeline_model_parallel_size > 1:
        raise ArgumentError("--mtp-num-layers", "with learned absolute position embeddings at PP > 1 no checkpoint can "
                                                "be saved: megatron-core keeps a second, unsynchronised copy of the "
                                                "position table on the MTP stage and saves it under stage 0's key "
                                                "(its own sharded state dict; Megatron-LM fails the same way); use "
                                                "--position-embedding-type rope (as DeepSeek-V3) or drop --save")
    if args.transformer_impl == "transformer_engine":
        raise ArgumentError("--mtp-num-layers", "not verified with Transformer Engine's layers yet; use "
                                                "--transformer-impl local, or drop --mtp-num-layers")

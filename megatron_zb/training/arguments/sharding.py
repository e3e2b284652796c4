"""``--data-parallel-sharding-strategy``: Megatron-LM's name for what the data-parallel ranks shard.
``optim`` is the distributed optimizer's sharding (its state); ``optim_grads`` (ZeRO-2) shards the
gradients too, with megatron-zb's sharded gradients under a zero-bubble schedule
(:mod:`megatron_zb.runtime.sharded_grads`); ``optim_grads_params`` (ZeRO-3) is not supported. In
Megatron-LM the flag configures Megatron FSDP (``--use-megatron-fsdp``), which cannot serve a split
backward (``flags.WHY_NOT``)."""

from __future__ import annotations

import argparse

from .common import ArgumentError, notice

__all__ = ["SHARDING_STRATEGIES", "add_sharding_args", "check_sharding_strategy"]

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
"""Megatron-LM's choices of ``--data-parallel-sharding-strategy``."""

FLAG = "--data-parallel-sharding-strategy"


def add_sharding_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data-parallel sharding")
    g.add_argument(FLAG, choices=SHARDING_STRATEGIES, default="no_shard",
                   help="What the data-parallel ranks shard (Megatron-LM's flag): no_shard (default); optim: the "
                        "optimizer state (what --use-distributed-optimizer does); optim_grads (ZeRO-2): the "
                        "gradients too -- each rank keeps its shard of every bucket's reduced gradient and two "
                        "bucket-sized work buffers instead of the whole gradient buffer, each bucket "
                        "reduce-scattered after each group of W's (--zero-bubble-wgrad-group); needs "
                        "--use-distributed-optimizer and a zero-bubble schedule (docs/training.md \"Sharded "
                        "gradients\"). optim_grads_params (ZeRO-3) is not supported.")


def _unsupported_with_sharded_grads(args: argparse.Namespace) -> list[ArgumentError]:
    """Everything set that sharded gradients do not serve yet, one error each: each reads or writes the whole
    ``main_grad`` after the reduce (megatron-core's ``finalize_model_grads``) or adds gradients outside W."""
    with_it = f"with {FLAG} optim_grads"
    problems = [ArgumentError(flag, f"not supported {with_it} yet: {why}") for on, flag, why in (
        (args.sequence_parallel, "--sequence-parallel",
         "its layer-norm gradients are all-reduced over the tensor-parallel ranks from the whole gradient"),
        (bool(getattr(args, "num_experts", None)), "--num-experts", "the experts' buffers are not sharded yet"),
        (bool(getattr(args, "mtp_num_layers", None)), "--mtp-num-layers",
         "the multi-token prediction layer's embedding is all-reduced from the whole gradient"),
        (getattr(args, "transformer_impl", "local") == "transformer_engine", "--transformer-impl",
         "Transformer Engine's modules add their weight gradients themselves; use --transformer-impl local"),
        (bool(getattr(args, "enable_vocab_parallel", False)), "--enable-vocab-parallel",
         "the vocabulary slices reduce their own gradients"),
        (bool(getattr(args, "enable_optimizer_post_validation", False)), "--enable-optimizer-post-validation",
         "post-validation has not been verified on sharded gradients")) if on]
    if (not args.untie_embeddings_and_output_weights and args.pipeline_model_parallel_size > 1
            and args.schedule_placement != "v"):
        problems.append(ArgumentError("--untie-embeddings-and-output-weights",
                                      f"needed {with_it} at --pipeline-model-parallel-size > 1: a word embedding tied "
                                      f"to the output layer on another pipeline rank is all-reduced from the whole "
                                      f"gradient; add it, or use a V schedule (both on one rank)"))
    return problems


def check_sharding_strategy(args: argparse.Namespace) -> None:
    """The strategy's needs, every problem in one error (each naming its flag and the fix)."""
    s = args.data_parallel_sharding_strategy
    if s == "no_shard":
        return
    if s == "optim_grads_params":
        raise ArgumentError(FLAG, "optim_grads_params (ZeRO-3: the parameters sharded too) is not supported; use "
                                  "optim_grads (gradients and optimizer state) or optim")
    problems = []
    if not args.use_distributed_optimizer:
        problems.append(ArgumentError(FLAG, f"{s} shards through megatron-core's distributed optimizer; add "
                                            f"--use-distributed-optimizer"))
    if s == "optim_grads":
        if not args.split_backward:
            problems.append(ArgumentError(FLAG, f"optim_grads reduces each bucket after the W's of a zero-bubble "
                                                f"schedule, but schedule {args.schedule!r} fuses its backward; add "
                                                f"--enable-zero-bubble (or another zero-bubble schedule)"))
        problems += _unsupported_with_sharded_grads(args)
    if problems:
        raise ArgumentError.combine(problems)
    if s == "optim_grads" and args.zero_bubble_wgrad_group is None:
        notice(args, f"{FLAG} optim_grads without --zero-bubble-wgrad-group: each W reduce-scatters the buckets it "
                     f"wrote ({args.num_microbatches} per bucket per iteration); --zero-bubble-wgrad-group K reduces "
                     f"once per K micro batches")

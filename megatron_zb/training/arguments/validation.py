"""Validation of the whole command line: the order of the checks, the numeric ranges of all flags.

Each flag group's module checks its own flags and fills in its derived values; this module calls
those checks in a fixed order (the first failure raises :class:`~.common.ArgumentError`, so with
several bad flags the message names the first in this order) and returns the args with the
schedule built along the way (:class:`ValidatedArgs`). No communication: call it before any
process group starts.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from megatron_zb.schedules.ir import Schedule

from .checkpointing_logging import check_checkpointing
from .common import ArgumentError, flag
from .data import check_data, resolve_tokenizer_vocab
from .implementation import resolve_gradient_accumulation_fusion, resolve_transformer_impl
from .logging_flags import check_logging
from .model import check_architecture, check_attention_heads, check_position_embeddings, fill_model_sizes
from .moe import check_moe
from .parallel import (check_batch_sizes, check_data_parallel_overlap, check_sequence_parallel, check_world_size,
                       resolve_backend)
from .recompute import check_recompute
from .training import check_learning_rate, check_precision, fill_training_values
from .zero_bubble import check_layers, check_schedule_builds, check_zero_bubble_options, resolve_schedule

__all__ = ["NON_NEGATIVE", "POSITIVE", "REQUIRED", "UNIT_INTERVAL", "ValidatedArgs", "check_ranges",
           "validate_args", "validate_args_and_schedule"]

# Numeric ranges, one table for every flag group; checked in this order (dest names).
REQUIRED: tuple[str, ...] = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                             "train_iters", "lr")
"""Flags without a default."""
POSITIVE: tuple[str, ...] = (
    "num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "train_iters",
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "global_batch_size", "ffn_hidden_size",
    "max_position_embeddings", "vocab_size", "make_vocab_size_divisible_by", "num_virtual_stages_per_pipeline_rank",
    "log_interval", "eval_interval", "save_interval", "distributed_timeout_minutes", "ckpt_step")
"""Integer flags that must be >= 1 when given."""
NON_NEGATIVE: tuple[str, ...] = ("eval_iters", "lr_warmup_iters", "num_workers")
"""Integer flags that must be >= 0."""
UNIT_INTERVAL: tuple[str, ...] = ("hidden_dropout", "attention_dropout")
"""Probabilities in [0, 1)."""


@dataclass(frozen=True)
class ValidatedArgs:
    """What validation produced.

    Attributes:
        args: the parsed namespace, checked and updated in place with the derived values listed in
            :mod:`megatron_zb.training.arguments` (Megatron's ``args``).
        schedule: the pipeline schedule of ``args.schedule`` built with unit costs while checking
            that it exists for these sizes (the run starts with it; global rank 0's copy is the
            one every rank runs).
    """

    args: argparse.Namespace
    schedule: Schedule


def validate_args_and_schedule(args: argparse.Namespace, *, world_size: int) -> ValidatedArgs:
    """Check ``args`` for a job of ``world_size`` processes, fill in derived values, build the schedule.

    Checks run in a fixed order and the first failure raises :class:`ArgumentError`. Idempotent:
    validating validated args again changes nothing.
    """
    if world_size < 1:
        raise ArgumentError("world_size", f"must be >= 1, got {world_size}")
    args.world_size = world_size
    check_ranges(args)
    resolve_transformer_impl(args)
    resolve_gradient_accumulation_fusion(args)
    check_world_size(args, world_size)
    check_attention_heads(args)
    check_architecture(args)
    check_recompute(args)
    check_sequence_parallel(args)
    check_data_parallel_overlap(args)
    check_precision(args)
    check_position_embeddings(args)
    check_batch_sizes(args)
    spec = resolve_schedule(args)
    check_layers(args)
    schedule = check_schedule_builds(args, spec)
    check_zero_bubble_options(args, spec)
    check_data(args)
    resolve_tokenizer_vocab(args)
    fill_model_sizes(args)
    check_moe(args)
    check_logging(args)
    check_checkpointing(args)
    fill_training_values(args)
    resolve_backend(args)
    return ValidatedArgs(args=args, schedule=schedule)


def validate_args(args: argparse.Namespace, *, world_size: int) -> argparse.Namespace:
    """Megatron-LM's ``validate_args``: :func:`validate_args_and_schedule` returning only the args."""
    return validate_args_and_schedule(args, world_size=world_size).args


def check_ranges(args: argparse.Namespace) -> None:
    """Required flags given; the numeric ranges of :data:`POSITIVE`, :data:`NON_NEGATIVE`, :data:`UNIT_INTERVAL`."""
    for dest in REQUIRED:
        if getattr(args, dest) is None:
            raise ArgumentError(flag(dest), f"is required; add {flag(dest)} VALUE to the command line")
    for dest in POSITIVE:
        value = getattr(args, dest, None)
        if value is not None and value < 1:
            raise ArgumentError(flag(dest), f"must be a positive integer, got {value}")
    for dest in NON_NEGATIVE:
        if getattr(args, dest) < 0:
            raise ArgumentError(flag(dest), f"must be >= 0, got {getattr(args, dest)}")
    for dest in UNIT_INTERVAL:
        if not 0.0 <= getattr(args, dest) < 1.0:
            raise ArgumentError(flag(dest), f"must be in [0, 1), got {getattr(args, dest)}")
    check_learning_rate(args)
    if args.pipeline_timeout_seconds <= 0:
        raise ArgumentError("--pipeline-timeout-seconds", f"must be > 0, got {args.pipeline_timeout_seconds}")

"""Validation of the whole command line: the checks and what each needs, the numeric ranges of all flags.

Each flag group's module checks its own flags and fills in its derived values; this module runs
those checks in a fixed order (:data:`CHECKS`) and reports **every** failing one in one
:class:`~.common.ArgumentError` (one :class:`~.common.Problem` each, in this order, after the
unknown flags the parser found). A check whose inputs come from a check that failed (its
``needs``) is skipped, so it reports nothing spurious. It returns the args with the schedule built
along the way and the start-up log lines of the adjustments (:class:`ValidatedArgs`). No
communication: call it before any process group starts.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from megatron_zb.schedules.ir import Schedule

from .checkpointing_logging import (check_auto_detect_ckpt_format, check_checkpointing, check_exit_duration,
                                    check_load_flags, check_load_format, check_save_directory)
from .common import NOTICES, ArgumentError, flag
from .data import check_data, check_data_files, check_data_splits, resolve_tokenizer_vocab
from .housekeeping import check_memory_flags, check_profiling
from .implementation import resolve_gradient_accumulation_fusion, resolve_transformer_impl
from .fork_flags import check_fork_flags
from .fp8 import check_fp8
from .kernels import resolve_kernels
from .logging_flags import check_logging, check_memory_logging, check_timing_log
from .model import (check_architecture, check_attention_heads, check_model_kind, check_position_embeddings,
                    check_zero_centered_gamma, fill_model_sizes)
from .mla import check_mla
from .moe import check_expert_tensor_parallel, check_moe
from .mtp import check_mtp
from .parallel import (check_batch_sizes, check_context_parallel, check_data_parallel_overlap, check_sequence_parallel,
                       check_world_size, resolve_backend, resolve_p2p_overlap)
from .recompute import check_recompute
from .sharding import check_sharding_strategy
from .training import (check_learning_rate, check_lr_schedule, check_precision, check_rampup_batch_size,
                       check_rampup_schedule, check_training_length, fill_training_values, resolve_nan_check)
from .zero_bubble import (check_layers, check_schedule_builds, check_vocab_parallel, check_wgrad_group,
                          check_zero_bubble_options, resolve_schedule)

__all__ = ["CHECKS", "NON_NEGATIVE", "POSITIVE", "REQUIRED", "UNIT_INTERVAL", "Check", "ValidatedArgs",
           "check_pipeline_timeout", "check_ranges", "validate_args", "validate_args_and_schedule"]

# Numeric ranges, one table for every flag group; checked in this order (dest names).
REQUIRED: tuple[str, ...] = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                             "lr")
"""Flags without a default (and one of ``--train-iters`` / ``--train-samples``: ``check_training_length``)."""
POSITIVE: tuple[str, ...] = (
    "num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "train_iters",
    "train_samples", "lr_decay_iters", "lr_decay_samples",
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "global_batch_size", "ffn_hidden_size",
    "max_position_embeddings", "vocab_size", "make_vocab_size_divisible_by", "num_virtual_stages_per_pipeline_rank",
    "num_layers_per_virtual_pipeline_stage", "log_interval", "eval_interval", "save_interval", "distributed_timeout_minutes", "ckpt_step",
    "context_parallel_size", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
"""Integer flags that must be >= 1 when given."""
NON_NEGATIVE: tuple[str, ...] = ("eval_iters", "lr_warmup_iters", "lr_warmup_samples", "num_workers")
"""Integer flags that must be >= 0."""
UNIT_INTERVAL: tuple[str, ...] = ("hidden_dropout", "attention_dropout", "lr_warmup_fraction")
"""Probabilities and fractions in [0, 1) (when given)."""


@dataclass(frozen=True)
class Check:
    """One step of validation: ``run(args, results)`` checks flags and fills derived values (raising
    :class:`ArgumentError`), may return a value later checks read from ``results[name]``; it runs only
    when every check named in ``needs`` passed (else it is skipped, and counts as failed for its own
    dependants)."""

    name: str
    run: Callable[[argparse.Namespace, dict[str, Any]], Any]
    needs: tuple[str, ...] = ()


CHECKS: tuple[Check, ...] = (
    Check("ranges", lambda a, r: check_ranges(a)),
    Check("learning_rate", lambda a, r: check_learning_rate(a), needs=("ranges",)),
    Check("training_length", lambda a, r: check_training_length(a)),
    Check("pipeline_timeout", lambda a, r: check_pipeline_timeout(a)),
    Check("transformer_impl", lambda a, r: resolve_transformer_impl(a)),
    Check("gradient_accumulation_fusion", lambda a, r: resolve_gradient_accumulation_fusion(a),
          needs=("transformer_impl",)),
    Check("kernels", lambda a, r: resolve_kernels(a), needs=("transformer_impl",)),
    Check("model_kind", lambda a, r: check_model_kind(a)),
    Check("world_size", lambda a, r: check_world_size(a, a.world_size), needs=("ranges",)),
    Check("context_parallel", lambda a, r: check_context_parallel(a), needs=("ranges",)),
    Check("attention_heads", lambda a, r: check_attention_heads(a), needs=("ranges",)),
    Check("architecture", lambda a, r: check_architecture(a), needs=("ranges",)),
    Check("zero_centered_gamma", lambda a, r: check_zero_centered_gamma(a), needs=("transformer_impl",)),
    Check("recompute", lambda a, r: check_recompute(a), needs=("ranges",)),
    Check("sequence_parallel", lambda a, r: check_sequence_parallel(a), needs=("ranges",)),
    Check("fp8", lambda a, r: check_fp8(a), needs=("transformer_impl", "sequence_parallel")),
    Check("data_parallel_overlap", lambda a, r: check_data_parallel_overlap(a)),
    Check("precision", lambda a, r: check_precision(a)),
    Check("nan_check", lambda a, r: resolve_nan_check(a), needs=("precision",)),
    Check("position_embeddings", lambda a, r: check_position_embeddings(a), needs=("ranges",)),
    Check("batch_sizes", lambda a, r: check_batch_sizes(a), needs=("ranges", "world_size")),
    Check("schedule", lambda a, r: resolve_schedule(a), needs=("ranges",)),
    Check("p2p_overlap", lambda a, r: resolve_p2p_overlap(a), needs=("schedule",)),
    Check("layers", lambda a, r: check_layers(a), needs=("schedule",)),
    Check("schedule_builds", lambda a, r: check_schedule_builds(a, r["schedule"]), needs=("schedule", "batch_sizes")),
    Check("wgrad_group", lambda a, r: check_wgrad_group(a, r["schedule"], r["schedule_builds"]),
          needs=("schedule_builds",)),
    Check("sharding_strategy", lambda a, r: check_sharding_strategy(a),
          needs=("schedule", "transformer_impl", "sequence_parallel", "batch_sizes", "wgrad_group")),
    Check("rampup_batch_size", lambda a, r: check_rampup_batch_size(a),
          needs=("ranges", "batch_sizes", "training_length")),
    Check("rampup_schedule", lambda a, r: check_rampup_schedule(a),
          needs=("schedule_builds", "rampup_batch_size")),
    Check("zero_bubble_options", lambda a, r: check_zero_bubble_options(a, r["schedule"]), needs=("schedule",)),
    Check("vocab_parallel", lambda a, r: check_vocab_parallel(a), needs=("schedule", "world_size")),
    Check("data", lambda a, r: check_data(a)),
    Check("tokenizer_vocab", lambda a, r: resolve_tokenizer_vocab(a), needs=("ranges",)),
    Check("model_sizes", lambda a, r: fill_model_sizes(a), needs=("ranges",)),
    Check("moe", lambda a, r: check_moe(a), needs=("world_size", "model_sizes", "sequence_parallel", "schedule")),
    Check("mtp", lambda a, r: check_mtp(a), needs=("schedule", "transformer_impl")),
    Check("mla", lambda a, r: check_mla(a), needs=("ranges",)),
    Check("logging", lambda a, r: check_logging(a)),
    Check("checkpointing", lambda a, r: check_checkpointing(a)),
    Check("training_values", lambda a, r: fill_training_values(a),
          needs=("ranges", "batch_sizes", "training_length", "rampup_batch_size")),
    Check("lr_schedule", lambda a, r: check_lr_schedule(a), needs=("training_values",)),
    Check("data_files", lambda a, r: check_data_files(a), needs=("data",)),
    Check("data_splits", lambda a, r: check_data_splits(a, r["data_files"]),
          needs=("data_files", "training_values", "ranges")),
    Check("load_flags", lambda a, r: check_load_flags(a)),
    Check("load_format", lambda a, r: check_load_format(a)),
    Check("save_directory", lambda a, r: check_save_directory(a)),
    Check("exit_duration", lambda a, r: check_exit_duration(a)),
    Check("memory_logging", lambda a, r: check_memory_logging(a)),
    Check("timing_log", lambda a, r: check_timing_log(a)),
    Check("profiling", lambda a, r: check_profiling(a), needs=("ranges", "training_values")),
    Check("memory_flags", lambda a, r: check_memory_flags(a)),
    Check("backend", lambda a, r: resolve_backend(a)),
    Check("fork_flags", lambda a, r: check_fork_flags(a)),
    Check("expert_tensor_parallel", lambda a, r: check_expert_tensor_parallel(a), needs=("ranges",)),
    Check("auto_detect_ckpt_format", lambda a, r: check_auto_detect_ckpt_format(a)),
)
"""Every check in order; the names are what ``needs`` refer to (extra checks may name them too)."""


@dataclass(frozen=True)
class ValidatedArgs:
    """What validation produced.

    Attributes:
        args: the parsed namespace, checked and updated in place with the derived values listed in
            :mod:`megatron_zb.training.arguments` (Megatron's ``args``).
        schedule: the pipeline schedule of ``args.schedule`` built with unit costs while checking
            that it exists for these sizes (the run starts with it; global rank 0's copy is the
            one every rank runs).
        notices: start-up log lines (global rank 0 prints them): flags adjusted or accepted without
            effect (``"WARNING: ..."``, as Megatron-LM) and defaults resolved for this machine.
    """

    args: argparse.Namespace
    schedule: Schedule
    notices: tuple[str, ...] = ()


def validate_args_and_schedule(args: argparse.Namespace, *, world_size: int, unknown: ArgumentError | None = None,
                               extra_checks: Sequence[Check] = ()) -> ValidatedArgs:
    """Check ``args`` for a job of ``world_size`` processes, fill in derived values, build the schedule.

    Runs :data:`CHECKS`, then ``extra_checks``, and raises one :class:`ArgumentError` holding the
    problems of ``unknown`` (the parser's unknown flags) and of every failing check. Idempotent:
    validating validated args again changes nothing.
    """
    if world_size < 1:
        raise ArgumentError("world_size", f"must be >= 1, got {world_size}")
    args.world_size = world_size
    setattr(args, NOTICES, [])
    errors: list[ArgumentError] = [unknown] if unknown is not None else []
    results: dict[str, Any] = {}
    failed: set[str] = set()
    for check in (*CHECKS, *extra_checks):
        if failed.intersection(check.needs):
            failed.add(check.name)
            continue
        try:
            results[check.name] = check.run(args, results)
        except ArgumentError as e:
            errors.append(e)
            failed.add(check.name)
    if errors:
        raise ArgumentError.combine(errors)
    return ValidatedArgs(args=args, schedule=results["schedule_builds"], notices=tuple(getattr(args, NOTICES)))


def validate_args(args: argparse.Namespace, *, world_size: int) -> argparse.Namespace:
    """Megatron-LM's ``validate_args``: :func:`validate_args_and_schedule` returning only the args."""
    return validate_args_and_schedule(args, world_size=world_size).args


def check_ranges(args: argparse.Namespace) -> None:
    """Required flags given; the numeric ranges of :data:`POSITIVE`, :data:`NON_NEGATIVE`, :data:`UNIT_INTERVAL`.
    Reports every flag out of range at once (most checks need these: they are skipped when it fails)."""
    errors = [ArgumentError(flag(d), f"is required; add {flag(d)} VALUE to the command line")
              for d in REQUIRED if getattr(args, d) is None]
    for dest in POSITIVE:
        value = getattr(args, dest, None)
        if value is not None and value < 1:
            errors.append(ArgumentError(flag(dest), f"must be a positive integer, got {value}"))
    for dest in NON_NEGATIVE:
        if getattr(args, dest) < 0:
            errors.append(ArgumentError(flag(dest), f"must be >= 0, got {getattr(args, dest)}"))
    for dest in UNIT_INTERVAL:
        value = getattr(args, dest)
        if value is not None and not 0.0 <= value < 1.0:
            errors.append(ArgumentError(flag(dest), f"must be in [0, 1), got {value}"))
    if errors:
        raise ArgumentError.combine(errors)


def check_pipeline_timeout(args: argparse.Namespace) -> None:
    if args.pipeline_timeout_seconds <= 0:
        raise ArgumentError("--pipeline-timeout-seconds", f"must be > 0, got {args.pipeline_timeout_seconds}")

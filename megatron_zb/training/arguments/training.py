"""Training flags (Megatron's "training", "learning rate" and "mixed precision" groups): batch
sizes, iterations, optimizer, learning-rate schedule, precision; their checks and derived values."""

from __future__ import annotations

import argparse

import torch

from .common import ArgumentError, flag, notice

__all__ = ["CHECK_FOR_NAN_HELP", "DYNAMIC_LOSS_SCALE_NAN_CHECK_WARNING", "add_learning_rate_args",
           "add_mixed_precision_args", "add_training_args", "check_learning_rate", "check_lr_schedule",
           "check_precision", "check_rampup_batch_size", "check_rampup_schedule", "check_training_length",
           "fill_training_values", "resolve_nan_check"]

CHECK_FOR_NAN_HELP = (
    "Check every micro batch's loss (on the rank that computes it) and every gradient bucket's norm (before "
    "its data-parallel reduce, after the last W that adds into it) for NaN/Inf, as Megatron-LM (default on; "
    "off for fp16 with dynamic loss scaling, where an overflow is the loss scaler's signal). A NaN/Inf stops "
    "every rank at its iteration, whose update is not applied: the iteration is logged as skipped (and as a nan "
    "iteration when its loss is not finite), then one error line names the iteration and the rank, exit status "
    "1. With --enable-optimizer-post-validation the same: an eager step is skipped where the NaN/Inf was seen, "
    "rolled back on the other stages when it is validated, and the run stops there.")
"""``--check-for-nan-in-loss-and-grad``'s help (the rule; docs/training.md, "NaN and Inf")."""
DYNAMIC_LOSS_SCALE_NAN_CHECK_WARNING = ("WARNING: Setting args.check_for_nan_in_loss_and_grad to False since "
                                        "dynamic loss scaling is being used")
"""Megatron-LM's start-up warning (its ``validate_args``) when fp16's dynamic loss scaling turns the check off."""


def add_training_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None,
                   help="Samples per micro batch per data-parallel rank (required).")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="Samples per iteration over all data-parallel ranks; must be a multiple of "
                        "--micro-batch-size times the data-parallel size. Default: micro batch x DP "
                        "(one micro batch per iteration).")
    g.add_argument("--rampup-batch-size", type=int, nargs=3, default=None, metavar=("START", "INCREMENT", "SAMPLES"),
                   help="Batch size ramp-up (with --train-samples): the global batch starts at START and grows by "
                        "INCREMENT up to --global-batch-size, in equal steps over the first SAMPLES samples "
                        "(megatron-core's RampupBatchsizeNumMicroBatchesCalculator). Each value must be a multiple of "
                        "--micro-batch-size x DP; the pipeline schedule is rebuilt for each new number of micro "
                        "batches. Default: a constant --global-batch-size.")
    g.add_argument("--train-iters", type=int, default=None,
                   help="Number of training iterations; give this or --train-samples.")
    g.add_argument("--train-samples", type=int, default=None,
                   help="Number of training samples [sequences]; give this or --train-iters. The run trains "
                        "--train-samples // --global-batch-size iterations (with --rampup-batch-size: the ramp's "
                        "iterations plus the rest at --global-batch-size, as Megatron-LM counts them).")
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam", help="Optimizer (default adam).")
    g.add_argument("--weight-decay", type=float, default=0.01, help="L2 weight decay coefficient (default 0.01).")
    g.add_argument("--clip-grad", type=float, default=1.0,
                   help="Clip the global gradient norm to this value; 0 disables (default 1.0).")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1 (default 0.9).")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2 (default 0.999).")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon (default 1e-8).")
    g.add_argument("--seed", type=int, default=1234,
                   help="Random seed for initialisation, dropout and data shuffling (default 1234).")
    g.add_argument("--check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad", action="store_true",
                   default=True, help=CHECK_FOR_NAN_HELP)
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false",
                   help="Do not check the loss and the gradients for NaN/Inf (Megatron-LM's flag): a diverging run "
                        "trains on (megatron-core's optimizer step; fp16 skips overflowing steps through its loss "
                        "scaler; --enable-optimizer-post-validation rolls back a step whose gradients overflowed "
                        "only where megatron-core's step would skip it).")


def add_learning_rate_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("learning rate")
    g.add_argument("--lr", type=float, default=None, help="Peak learning rate (required).")
    g.add_argument("--min-lr", type=float, default=0.0, help="Learning rate floor after decay (default 0).")
    g.add_argument("--lr-warmup-iters", type=int, default=0,
                   help="Iterations of linear warm-up from --lr-warmup-init to --lr (default 0; with --train-iters).")
    g.add_argument("--lr-warmup-samples", type=int, default=0,
                   help="Samples of linear warm-up from --lr-warmup-init to --lr (default 0; with --train-samples).")
    g.add_argument("--lr-warmup-init", type=float, default=0.0,
                   help="Learning rate at the start of the linear warm-up, which rises from it to --lr (default 0; "
                        "megatron-core's OptimizerParamScheduler init_lr, as Megatron-LM). Between 0 and --lr.")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="Warm-up as a fraction of the decay length (--lr-decay-iters or --lr-decay-samples), "
                        "instead of --lr-warmup-iters / --lr-warmup-samples.")
    g.add_argument("--lr-decay-iters", type=int, default=None,
                   help="Iterations over which the learning rate decays to --min-lr (with --train-iters). "
                        "Default: --train-iters.")
    g.add_argument("--lr-decay-samples", type=int, default=None,
                   help="Samples over which the learning rate decays to --min-lr (with --train-samples). "
                        "Default: --train-samples.")
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine", "WSD"),
                   default="linear", help="Learning rate decay function (default linear; megatron-core's "
                                          "OptimizerParamScheduler).")
    g.add_argument("--lr-wsd-decay-style", choices=("exponential", "linear", "cosine", "minus_sqrt"),
                   default="exponential", help="With --lr-decay-style WSD: the decay of its annealing phase "
                                               "(default exponential).")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None,
                   help="With --lr-decay-style WSD: iterations of the annealing phase, at the end of the decay "
                        "(with --train-iters).")
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None,
                   help="With --lr-decay-style WSD: samples of the annealing phase (with --train-samples).")
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="Separate peak learning rate of the input embedding and the output layer (default: --lr).")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="Minimum learning rate of the input embedding and the output layer with --decoupled-lr "
                        "(default: --min-lr).")


def add_mixed_precision_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("mixed precision")
    g.add_argument("--fp16", action="store_true", help="Train in fp16 mixed precision (loss scaling).")
    g.add_argument("--bf16", action="store_true", help="Train in bf16 mixed precision.")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="Static loss scale (fp16). Default: dynamic loss scaling.")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32,
                   help="Initial dynamic loss scale (fp16; default 2^32).")
    g.add_argument("--min-loss-scale", type=float, default=1.0,
                   help="Minimum loss scale for dynamic loss scaling (default 1.0).")
    g.add_argument("--loss-scale-window", type=float, default=1000,
                   help="Window over which to raise/lower dynamic scale [iterations] (default 1000).")
    g.add_argument("--hysteresis", type=int, default=2,
                   help="Hysteresis for dynamic loss scaling: overflows tolerated before lowering (default 2).")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="Gradient accumulation and all-reduce in fp32 (on with --bf16 unless --grad-reduce-in-bf16, "
                        "as Megatron-LM).")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="With --bf16: accumulate and reduce gradients in bf16 instead of fp32.")


def check_training_length(args: argparse.Namespace) -> None:
    """Megatron-LM's rules (arguments.py, "Iteration-based training" / "Sample-based training"):
    exactly one of ``--train-iters`` and ``--train-samples``; the warm-up, decay and ramp-up flags of
    the other unit refused; ``--lr-warmup-fraction`` instead of the warm-up length, not beside it.
    Keeps ``--train-iters`` as given in ``train_iters_requested`` (``train_iters`` is then derived)."""
    if not hasattr(args, "train_iters_requested"):
        args.train_iters_requested = args.train_iters
    iters, samples = args.train_iters_requested, args.train_samples
    if (iters is None) == (samples is None):
        raise ArgumentError("--train-iters", "give exactly one of --train-iters N and --train-samples N "
                                             f"(got {'both' if iters is not None else 'neither'})")
    errors = []
    if iters is not None:
        for given, dest, fix in ((args.lr_decay_samples is not None, "lr_decay_samples", "--lr-decay-iters"),
                                 (args.lr_warmup_samples != 0, "lr_warmup_samples", "--lr-warmup-iters"),
                                 (args.lr_wsd_decay_samples is not None, "lr_wsd_decay_samples",
                                  "--lr-wsd-decay-iters"),
                                 (args.rampup_batch_size is not None, "rampup_batch_size", "--train-samples")):
            if given:
                errors.append(ArgumentError(flag(dest), f"counts samples, and this run counts iterations "
                                                        f"(--train-iters); use {fix} instead"))
        if args.lr_warmup_fraction is not None and args.lr_warmup_iters != 0:
            errors.append(ArgumentError("--lr-warmup-fraction", "and --lr-warmup-iters both set the warm-up; "
                                                                "keep one of them"))
    else:
        for given, dest, fix in ((args.lr_decay_iters is not None, "lr_decay_iters", "--lr-decay-samples"),
                                 (args.lr_warmup_iters != 0, "lr_warmup_iters", "--lr-warmup-samples"),
                                 (args.lr_wsd_decay_iters is not None, "lr_wsd_decay_iters",
                                  "--lr-wsd-decay-samples")):
            if given:
                errors.append(ArgumentError(flag(dest), f"counts iterations, and this run counts samples "
                                                        f"(--train-samples); use {fix} instead"))
        if args.lr_warmup_fraction is not None and args.lr_warmup_samples != 0:
            errors.append(ArgumentError("--lr-warmup-fraction", "and --lr-warmup-samples both set the warm-up; "
                                                                "keep one of them"))
    if errors:
        raise ArgumentError.combine(errors)


def check_rampup_batch_size(args: argparse.Namespace) -> None:
    """``--rampup-batch-size START INCREMENT SAMPLES``: megatron-core's calculator's conditions
    (``START`` < ``--global-batch-size``, their difference a multiple of ``INCREMENT``, ``SAMPLES`` >= 1:
    it divides by both), and every
    global batch of the ramp a multiple of ``--micro-batch-size`` x DP (megatron-core checks it at
    each change; here before the run starts)."""
    if args.rampup_batch_size is None:
        return
    from megatron_zb.megatron_compat import megatron_core_version, rampup_calculator

    if rampup_calculator() is None:
        raise ArgumentError("--rampup-batch-size", f"megatron-core {megatron_core_version()} has no batch-size "
                                                   f"ramp-up calculator (its step schedule replaced it); use a "
                                                   f"constant --global-batch-size, or megatron-core 0.16.1")
    start, increment, samples = args.rampup_batch_size
    gbs, unit = args.global_batch_size, args.micro_batch_size * args.data_parallel_size
    if start < 1 or increment < 1 or samples < 1:
        raise ArgumentError("--rampup-batch-size", f"START, INCREMENT and SAMPLES must be >= 1, got "
                                                   f"{start} {increment} {samples}")
    if start >= gbs or (gbs - start) % increment:
        # megatron-core's calculator divides SAMPLES by (GBS - START) / INCREMENT steps
        raise ArgumentError("--rampup-batch-size", f"the ramp from {start} by {increment} does not reach "
                                                   f"--global-batch-size {gbs}; START must be below it and "
                                                   f"{gbs} - START a multiple of INCREMENT")
    if start % unit or increment % unit:
        raise ArgumentError("--rampup-batch-size", f"START {start} and INCREMENT {increment} must be multiples of "
                                                   f"--micro-batch-size x data-parallel size = {unit} (each global "
                                                   f"batch is whole micro batches on every data-parallel rank)")


def check_rampup_schedule(args: argparse.Namespace) -> None:
    """With ``--rampup-batch-size``: the schedule also builds (unit costs) for the ramp's first number of
    micro batches, the smallest (validation built it for the last, ``--global-batch-size``'s); the
    ones between are built when the batch grows."""
    from megatron_zb.schedules import ScheduleError
    from megatron_zb.schedules.registry import build_schedule

    if args.rampup_batch_size is None:
        return
    pp, m = args.pipeline_model_parallel_size, args.rampup_batch_size[0] // (args.micro_batch_size * args.data_parallel_size)
    try:
        build_schedule(args.schedule, num_ranks=pp, num_microbatches=m, memory_limit=args.schedule_memory_limit,
                       num_chunks=args.num_model_chunks)
    except ScheduleError as e:
        raise ArgumentError("--rampup-batch-size", f"schedule {args.schedule!r} cannot be built for the ramp's first "
                                                   f"global batch {args.rampup_batch_size[0]} (PP={pp}, {m} micro "
                                                   f"batches: {e}); start the ramp higher") from None


def check_learning_rate(args: argparse.Namespace) -> None:
    """``--min-lr`` and ``--lr-warmup-init`` within ``[0, --lr]`` (megatron-core's scheduler asserts the upper bounds)."""
    errors = []
    if args.min_lr > args.lr:
        errors.append(ArgumentError("--min-lr", f"{args.min_lr} exceeds --lr {args.lr}; set --min-lr <= --lr"))
    if not 0.0 <= args.lr_warmup_init <= args.lr:
        errors.append(ArgumentError("--lr-warmup-init", f"{args.lr_warmup_init} is not between 0 and --lr {args.lr} "
                                                        f"(the warm-up rises from it to --lr); give a value in that range"))
    if errors:
        raise ArgumentError.combine(errors)


def check_precision(args: argparse.Namespace) -> None:
    if args.fp16 and args.bf16:
        raise ArgumentError("--bf16", "--fp16 and --bf16 are mutually exclusive; keep one of them")


def resolve_nan_check(args: argparse.Namespace) -> None:
    """``--check-for-nan-in-loss-and-grad`` is turned off for fp16 with dynamic loss scaling, where NaN/Inf in
    the gradients are the loss scaler's signal, with Megatron-LM's warning (its ``validate_args``); the flag
    itself is kept as ``check_for_nan_in_loss_and_grad_requested``."""
    if not hasattr(args, "check_for_nan_in_loss_and_grad_requested"):
        args.check_for_nan_in_loss_and_grad_requested = args.check_for_nan_in_loss_and_grad
    dynamic = args.fp16 and not args.loss_scale
    args.check_for_nan_in_loss_and_grad = args.check_for_nan_in_loss_and_grad_requested and not dynamic
    if args.check_for_nan_in_loss_and_grad_requested and dynamic:
        notice(args, DYNAMIC_LOSS_SCALE_NAN_CHECK_WARNING)


def fill_training_values(args: argparse.Namespace) -> None:
    """``params_dtype`` (from ``--fp16`` / ``--bf16``); ``train_iters`` (``--train-iters``, or from
    ``--train-samples`` as Megatron-LM's ``update_train_iters``); the decay length's default:
    ``lr_decay_iters`` = ``--train-iters``, or ``lr_decay_samples`` = ``--train-samples``."""
    from megatron_zb.training.batch_ramp import train_iters_from_samples

    args.params_dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32
    if args.train_samples is None:
        args.train_iters = args.train_iters_requested
        if args.lr_decay_iters is None:
            args.lr_decay_iters = args.train_iters
        return
    args.train_iters = train_iters_from_samples(
        args.train_samples, global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
        data_parallel_size=args.data_parallel_size, rampup_batch_size=args.rampup_batch_size)
    if args.lr_decay_samples is None:
        args.lr_decay_samples = args.train_samples
    if args.train_iters < 1:
        raise ArgumentError("--train-samples", f"{args.train_samples} samples are less than one global batch "
                                               f"({args.global_batch_size}); give at least that many")


def check_lr_schedule(args: argparse.Namespace) -> None:
    """The learning-rate schedule's lengths in samples (:meth:`~megatron_zb.training.run_config.OptimConfig.
    scheduler_steps`, the one rule): the warm-up shorter than the decay, as megatron-core's
    ``OptimizerParamScheduler`` asserts. Needs the filled training values."""
    from megatron_zb.training.run_config import OptimConfig

    optim = OptimConfig(lr=args.lr, lr_warmup_iters=args.lr_warmup_iters, lr_decay_iters=args.lr_decay_iters,
                        lr_warmup_samples=args.lr_warmup_samples, lr_decay_samples=args.lr_decay_samples,
                        lr_warmup_fraction=args.lr_warmup_fraction, lr_wsd_decay_iters=args.lr_wsd_decay_iters,
                        lr_wsd_decay_samples=args.lr_wsd_decay_samples)
    steps = optim.scheduler_steps(train_iters=args.train_iters, train_samples=args.train_samples,
                                  global_batch_size=args.global_batch_size)
    wsd = "--lr-wsd-decay-iters" if args.train_samples is None else "--lr-wsd-decay-samples"
    if args.lr_decay_style == "WSD" and steps.wsd_decay_steps is None:
        raise ArgumentError("--lr-decay-style", f"WSD needs the length of its annealing phase: add {wsd} N")
    if args.lr_decay_style == "WSD" and not 0 < steps.wsd_decay_steps <= steps.lr_decay_steps:  # type: ignore[operator]
        raise ArgumentError(wsd, f"the annealing phase ({steps.wsd_decay_steps} samples) must be within the decay "
                                 f"({steps.lr_decay_steps} samples) and at least one sample")
    if steps.lr_decay_steps <= 0:
        raise ArgumentError("--lr-decay-iters" if args.train_samples is None else "--lr-decay-samples",
                            f"the decay must last at least one sample, got {steps.lr_decay_steps}")
    if steps.lr_warmup_steps >= steps.lr_decay_steps:
        which = ("--lr-warmup-fraction" if args.lr_warmup_fraction is not None else
                 "--lr-warmup-iters" if args.train_samples is None else "--lr-warmup-samples")
        raise ArgumentError(which, f"the warm-up ({steps.lr_warmup_steps:g} samples) must be shorter than the decay "
                                   f"({steps.lr_decay_steps} samples; megatron-core's scheduler asserts it); "
                                   f"shorten the warm-up or lengthen the decay")

"""Training flags (Megatron's "training", "learning rate" and "mixed precision" groups): batch
sizes, iterations, optimizer, learning-rate schedule, precision; their checks and derived values."""

from __future__ import annotations

import argparse

import torch

from .common import ArgumentError

__all__ = ["add_learning_rate_args", "add_mixed_precision_args", "add_training_args", "check_learning_rate",
           "check_precision", "fill_training_values"]


def add_training_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None,
                   help="Samples per micro batch per data-parallel rank (required).")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="Samples per iteration over all data-parallel ranks; must be a multiple of "
                        "--micro-batch-size times the data-parallel size. Default: micro batch x DP "
                        "(one micro batch per iteration).")
    g.add_argument("--train-iters", type=int, default=None, help="Number of training iterations (required).")
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam", help="Optimizer (default adam).")
    g.add_argument("--weight-decay", type=float, default=0.01, help="L2 weight decay coefficient (default 0.01).")
    g.add_argument("--clip-grad", type=float, default=1.0,
                   help="Clip the global gradient norm to this value; 0 disables (default 1.0).")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1 (default 0.9).")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2 (default 0.999).")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon (default 1e-8).")
    g.add_argument("--seed", type=int, default=1234,
                   help="Random seed for initialisation, dropout and data shuffling (default 1234).")


def add_learning_rate_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("learning rate")
    g.add_argument("--lr", type=float, default=None, help="Peak learning rate (required).")
    g.add_argument("--min-lr", type=float, default=0.0, help="Learning rate floor after decay (default 0).")
    g.add_argument("--lr-warmup-iters", type=int, default=0,
                   help="Iterations of linear warm-up from 0 to --lr (default 0).")
    g.add_argument("--lr-decay-iters", type=int, default=None,
                   help="Iterations over which the learning rate decays to --min-lr. Default: --train-iters.")
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="linear",
                   help="Learning rate decay function (default linear).")
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


def check_learning_rate(args: argparse.Namespace) -> None:
    if args.min_lr > args.lr:
        raise ArgumentError("--min-lr", f"{args.min_lr} exceeds --lr {args.lr}; set --min-lr <= --lr")


def check_precision(args: argparse.Namespace) -> None:
    if args.fp16 and args.bf16:
        raise ArgumentError("--bf16", "--fp16 and --bf16 are mutually exclusive; keep one of them")


def fill_training_values(args: argparse.Namespace) -> None:
    """``params_dtype`` (from ``--fp16`` / ``--bf16``) and ``lr_decay_iters`` (default ``--train-iters``)."""
    args.params_dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters

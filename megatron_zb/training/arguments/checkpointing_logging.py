"""Checkpointing, evaluation and logging flags (Megatron's "checkpointing", "validation" and
"logging" groups). Their only checks are the ranges in :mod:`.validation`."""

from __future__ import annotations

import argparse

__all__ = ["add_checkpointing_args", "add_validation_and_logging_args"]


def add_checkpointing_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", type=str, default=None, help="Directory to save checkpoints to.")
    g.add_argument("--load", type=str, default=None, help="Directory to load a checkpoint from.")
    g.add_argument("--save-interval", type=int, default=None, help="Iterations between checkpoint saves.")


def add_validation_and_logging_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("validation")
    g.add_argument("--eval-interval", type=int, default=1000,
                   help="Iterations between evaluations on the validation set (default 1000).")
    g.add_argument("--eval-iters", type=int, default=100,
                   help="Iterations (global batches) per evaluation; 0 disables evaluation (default 100).")
    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100, help="Iterations between log lines (default 100).")
    g.add_argument("--tensorboard-dir", type=str, default=None,
                   help="Write TensorBoard scalars here (needs the tensorboard package).")

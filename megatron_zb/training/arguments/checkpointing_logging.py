"""Checkpointing, preemption, evaluation and logging flags (Megatron's "checkpointing", "validation"
and "logging" groups, and its exit-signal flags). Checks: the ranges in :mod:`.validation` and
:func:`check_checkpointing`."""

from __future__ import annotations

import argparse
import signal

from .common import ArgumentError

__all__ = ["CKPT_FORMATS", "add_checkpointing_args", "add_validation_and_logging_args", "check_checkpointing"]

CKPT_FORMATS: tuple[str, ...] = ("torch", "torch_dist", "torch_dcp", "fsdp_dtensor")
"""Megatron-LM core_v0.16.1's ``--ckpt-format`` choices (``CheckpointConfig.ckpt_format``)."""


def _signal(name: str) -> signal.Signals:
    """``SIGTERM`` -> ``signal.SIGTERM`` (Megatron-LM's ``--exit-signal`` values)."""
    try:
        return signal.Signals[name]
    except KeyError:
        raise argparse.ArgumentTypeError(f"{name!r} is not a signal name (e.g. SIGTERM, SIGUSR1)") from None


def add_checkpointing_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", type=str, default=None, help="Directory to save checkpoints to.")
    g.add_argument("--load", type=str, default=None,
                   help="Directory to load a checkpoint from (the iteration its latest_checkpointed_iteration.txt "
                        "names). A damaged checkpoint, or one of another model or learning-rate schedule, is "
                        "refused in one line before anything is written.")
    g.add_argument("--ckpt-format", choices=CKPT_FORMATS, default="torch_dist",
                   help="Checkpoint format (Megatron-LM's choices, default torch_dist): megatron-zb writes and "
                        "reads torch_dist only; the others are refused.")
    g.add_argument("--save-interval", type=int, default=None, help="Iterations between checkpoint saves.")
    g.add_argument("--ckpt-step", type=int, default=None, metavar="N",
                   help="With --load: load the checkpoint of iteration N (DIR/iter_NNNNNNN) instead of the one "
                        "latest_checkpointed_iteration.txt names (as Megatron). A damaged checkpoint's error names "
                        "the --ckpt-step of the previous complete one.")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="On --exit-signal (default SIGTERM, what torchrun forwards and SLURM sends before killing "
                        "a job), finish the current iteration, save a checkpoint when --save is set and exit with "
                        "status 0 (as Megatron). Every rank checks for the signal after each iteration.")
    g.add_argument("--exit-signal", type=_signal, default=signal.SIGTERM, metavar="SIGNAL",
                   help="The signal --exit-signal-handler handles (a name, default SIGTERM).")
    g.add_argument("--exit-signal-handler-for-dataloader", action="store_true",
                   help="Data-loader worker processes (--num-workers > 0) ignore --exit-signal, so that a signal "
                        "sent to every process of the job does not end them before the checkpoint is saved "
                        "(with --exit-signal-handler they always do, as Megatron-LM).")


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


def check_checkpointing(args: argparse.Namespace) -> None:
    """``--ckpt-step`` needs ``--load``; ``--exit-signal`` must be a signal a process can handle;
    ``--ckpt-format`` is torch_dist."""
    if args.ckpt_format != "torch_dist":
        raise ArgumentError("--ckpt-format", f"{args.ckpt_format} is not supported: megatron-zb writes and reads "
                                             f"Megatron-LM's torch_dist checkpoints only; use --ckpt-format torch_dist")
    if args.ckpt_step is not None and not args.load:
        raise ArgumentError("--ckpt-step", "names a checkpoint of --load DIR; add --load DIR")
    if args.exit_signal in (signal.SIGKILL, signal.SIGSTOP):
        raise ArgumentError("--exit-signal", f"{args.exit_signal.name} cannot be handled by a process; use SIGTERM "
                                             f"or SIGUSR1")

"""Developer flags of ``pretrain_gpt_zb.py`` (group "megatron-zb developer"): the megatron-core
reference schedule, exact loss logging, ``--exit-interval`` and Megatron's LR-scheduler-on-load
flags. Added with ``build_parser(extra_args_provider=add_developer_args)``; checked after
``validate_args`` by :func:`validate_developer_args` (pass :data:`DEVELOPER_CHECK` to
``validate_args_and_schedule(extra_checks=...)`` to have its problems in the same report)."""

from __future__ import annotations

import argparse
import os

from .common import ArgumentError, notice
from .validation import Check

__all__ = ["DEVELOPER_CHECK", "add_developer_args", "validate_developer_args"]


def add_developer_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``pretrain_gpt_zb.py`` beyond :func:`~megatron_zb.training.arguments.build_parser`'s."""
    g = parser.add_argument_group("megatron-zb developer")
    g.add_argument("--use-megatron-core-schedule", action="store_true",
                   help="Reference run: megatron-core's own forward_backward_func (its 1F1B; plain placement "
                        "only, so not together with a zero-bubble schedule flag). For comparing loss curves.")
    g.add_argument("--loss-log-json", type=str, default=None, metavar="PATH",
                   help="Write every iteration's exact lm loss, learning rate, grad norm and loss scale, and "
                        "every validation loss, to this JSON file (written by the last rank at each log line "
                        "and at the end).")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="Exit after the iteration that is divisible by this value, saving a checkpoint first "
                        "when --save is set (as Megatron).")
    g.add_argument("--override-opt_param-scheduler", dest="override_opt_param_scheduler", action="store_true",
                   help="On --load, take the learning-rate schedule from the command line, ignoring the "
                        "checkpoint's (as Megatron).")
    g.add_argument("--use-checkpoint-opt_param-scheduler", dest="use_checkpoint_opt_param_scheduler",
                   action="store_true",
                   help="On --load, take the learning-rate schedule from the checkpoint (as Megatron).")


def validate_developer_args(args: argparse.Namespace) -> None:
    """Check the flags of :func:`add_developer_args` (after ``validate_args``); raise ``ArgumentError``."""
    if args.use_megatron_core_schedule:
        if args.schedule != "1f1b":
            raise ArgumentError("--use-megatron-core-schedule",
                                f"runs megatron-core's own 1F1B, but {args.schedule_selected_by} selected schedule "
                                f"{args.schedule!r}; drop one of the two")
        if args.enable_optimizer_post_validation:
            raise ArgumentError("--use-megatron-core-schedule", "cannot be combined with "
                                "--enable-optimizer-post-validation")
    if args.exit_interval is not None and args.exit_interval < 1:
        raise ArgumentError("--exit-interval", f"must be a positive integer, got {args.exit_interval}")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise ArgumentError("--override-opt_param-scheduler",
                            "and --use-checkpoint-opt_param-scheduler contradict each other; keep one")
    if args.loss_log_json:
        parent = os.path.dirname(os.path.abspath(args.loss_log_json))
        if not os.path.isdir(parent):
            raise ArgumentError("--loss-log-json", f"directory {parent!r} does not exist")
    if args.load and os.path.exists(args.load) and not os.path.isdir(args.load):
        raise ArgumentError("--load", f"{args.load!r} is not a directory")
    if args.load and not os.path.exists(args.load):  # Megatron-LM: no checkpoint there, start from scratch
        notice(args, f"WARNING: --load {args.load} does not exist: no checkpoint to load, training from scratch "
                     f"(as Megatron-LM; a launch script that passes the same --save and --load starts this way)")


DEVELOPER_CHECK = Check("developer", lambda args, results: validate_developer_args(args), needs=("schedule",))
""":func:`validate_developer_args` as a step of validation (it reads the resolved schedule)."""

"""Logging flags beyond the basic ones (Megatron's "logging" group): ``--log-throughput``,
``--log-timers-to-tensorboard`` and Weights & Biases (``--wandb-project`` ...); their checks."""

from __future__ import annotations

import argparse
import importlib.util

from .common import ArgumentError

__all__ = ["add_logging_extra_args", "check_logging"]


def add_logging_extra_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("logging (throughput, timers, wandb)")
    g.add_argument("--log-throughput", action="store_true",
                   help="Add the model's TFLOP/s per GPU (Megatron-LM's FLOPs formula) to the iteration line.")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="Write the timers (forward-backward, optimizer; seconds per iteration) to TensorBoard.")
    g.add_argument("--no-barrier-with-level-1-timing", action="store_false", dest="barrier_with_L1_time",
                   help="Megatron-LM: no barrier before level-1 timers. megatron-zb's timers never synchronise "
                        "the ranks, so this is what always happens here.")
    g.add_argument("--wandb-project", type=str, default=None,
                   help="Log to Weights & Biases under this project (needs the wandb package; offline mode "
                        "when api.wandb.ai is unreachable or WANDB_MODE=offline).")
    g.add_argument("--wandb-exp-name", type=str, default=None, help="The W&B run name.")
    g.add_argument("--wandb-save-dir", type=str, default=None,
                   help="Directory for W&B files. Default: SAVE/wandb with --save, else ./wandb.")


def check_logging(args: argparse.Namespace) -> None:
    """W&B flags need the ``wandb`` package and a project."""
    if args.wandb_project is None:
        for flag, value in (("--wandb-exp-name", args.wandb_exp_name), ("--wandb-save-dir", args.wandb_save_dir)):
            if value is not None:
                raise ArgumentError(flag, "needs --wandb-project; add it or drop this flag")
        return
    if importlib.util.find_spec("wandb") is None:
        raise ArgumentError("--wandb-project", "needs the wandb package, which is not installed; pip install wandb "
                                               "or drop --wandb-project")

"""Logging flags beyond the basic ones (Megatron's "logging" group): ``--log-throughput``,
``--log-timers-to-tensorboard``, ``--log-params-norm``, ``--log-num-zeros-in-grad``,
``--log-memory-to-tensorboard``, Megatron-LM's timers (``--timing-log-level``, ``--timing-log-option``,
``--no-barrier-with-level-1-timing``; :mod:`megatron_zb.training.timing_log`) and Weights & Biases (``--wandb-project`` ...); their checks."""

from __future__ import annotations

import argparse
import importlib.util

import torch

from .common import ArgumentError, notice

__all__ = ["add_logging_extra_args", "check_logging", "check_memory_logging", "check_timing_log"]


def add_logging_extra_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("logging (throughput, timers, wandb)")
    g.add_argument("--log-throughput", action="store_true",
                   help="Add the model's TFLOP/s per GPU (Megatron-LM's FLOPs formula) to the iteration line.")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="Write the timers (forward-backward, optimizer; seconds per iteration) to TensorBoard.")
    g.add_argument("--log-params-norm", action="store_true",
                   help="Add the L2 norm of the model's parameters after the step to the iteration line "
                        "(params norm) and TensorBoard (params-norm), over all ranks, as Megatron-LM.")
    g.add_argument("--log-num-zeros-in-grad", action="store_true",
                   help="Add the number of zero gradient elements of the step to the iteration line (num zeros) "
                        "and TensorBoard (num-zeros): megatron-core's OptimizerConfig.log_num_zeros_in_grad; with "
                        "optimizer post-validation, the validated count.")
    g.add_argument("--logging-level", type=int, default=None,
                   help="The level of Python's root logger (logging.DEBUG = 10, INFO = 20, ...), as Megatron-LM; "
                        "default: $MEGATRON_LOGGING_LEVEL, else unchanged.")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                   help="Accepted: megatron-zb always writes the validation perplexity to TensorBoard "
                        "('lm loss validation ppl').")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="Write the CUDA caching allocator's statistics to TensorBoard (mem-reserved-bytes, "
                        "mem-allocated-bytes, mem-max-allocated-bytes, mem-allocated-count), as Megatron-LM; "
                        "nothing without CUDA (a start-up line says so).")
    g.add_argument("--timing-log-level", type=int, choices=(0, 1, 2), default=0,
                   help="Megatron-LM's timers, printed after the iteration line every --log-interval (ms per "
                        "iteration): 0 (default) none; 1 what runs once per iteration (forward-backward, gradient "
                        "reduces, the optimizer and its parts); 2 also what runs per micro batch (batch-generator, "
                        "forward-compute, backward-compute; megatron-core's p2p timers under its own schedules).")
    g.add_argument("--timing-log-option", choices=("max", "minmax", "all"), default="minmax",
                   help="With --timing-log-level 1 or 2: the largest time over ranks (max), the smallest and "
                        "largest (minmax, default) or every rank's (all), as Megatron-LM.")
    g.add_argument("--no-barrier-with-level-1-timing", action="store_false", dest="barrier_with_L1_time",
                   help="With --timing-log-level 1 or 2: start level-1 timers without a barrier over the ranks "
                        "first (Megatron-LM's default barriers, so that a timer measures its own work, not the wait "
                        "for the slowest rank).")
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


def check_timing_log(args: argparse.Namespace) -> None:
    """``--timing-log-option`` / ``--no-barrier-with-level-1-timing`` at level 0 do nothing: a start-up line says so."""
    given = [f for f, on in (("--timing-log-option", args.timing_log_option != "minmax"),
                             ("--no-barrier-with-level-1-timing", not args.barrier_with_L1_time)) if on]
    if given and args.timing_log_level == 0:
        notice(args, f"WARNING: {', '.join(given)} without --timing-log-level 1 or 2: no timers, no effect (as "
                     f"Megatron-LM)")


def check_memory_logging(args: argparse.Namespace) -> None:
    """``--log-memory-to-tensorboard`` writes nothing without CUDA or without ``--tensorboard-dir``:
    a start-up line says which."""
    if not args.log_memory_to_tensorboard:
        return
    if not torch.cuda.is_available():
        notice(args, "WARNING: --log-memory-to-tensorboard: no CUDA device, so torch.cuda.memory_stats() has "
                     "nothing to report: no memory scalars are written")
    elif args.tensorboard_dir is None:
        notice(args, "WARNING: --log-memory-to-tensorboard without --tensorboard-dir: no TensorBoard, no memory "
                     "scalars (as Megatron-LM); add --tensorboard-dir DIR")

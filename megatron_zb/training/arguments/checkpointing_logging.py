"""Checkpointing, preemption, evaluation and logging flags (Megatron's "checkpointing", "validation"
and "logging" groups, and its exit-signal flags). Checks: the ranges in :mod:`.validation` and
:func:`check_checkpointing`, :func:`check_save_directory`."""

from __future__ import annotations

import argparse
import signal

from .common import ArgumentError, notice

__all__ = ["CKPT_FORMATS", "add_checkpointing_args", "add_validation_and_logging_args", "check_checkpointing",
           "check_exit_duration", "check_load_flags", "check_load_format", "check_save_directory"]

CKPT_FORMATS: tuple[str, ...] = ("torch", "torch_dist", "torch_dcp", "fsdp_dtensor")
"""Megatron-LM core_v0.16.1's ``--ckpt-format`` choices (``CheckpointConfig.ckpt_format``)."""


DIST_CKPT_STRICTNESS = ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
                        "ignore_all")
"""``--dist-ckpt-strictness`` choices: Megatron-LM core_v0.16.1's but ``return_unexpected`` / ``return_all``."""


def _signal(name: str) -> signal.Signals:
    """``SIGTERM`` -> ``signal.SIGTERM`` (Megatron-LM's ``--exit-signal`` values)."""
    try:
        return signal.Signals[name]
    except KeyError:
        raise argparse.ArgumentTypeError(f"{name!r} is not a signal name (e.g. SIGTERM, SIGUSR1)") from None


def add_checkpointing_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", type=str, default=None,
                   help="Directory to save checkpoints to: a writable directory, or one that can be created "
                        "(checked before any process group starts). Before each save the checkpoint's expected "
                        "size is compared with the file system's free space: one that does not fit is not started "
                        "(exit 1, naming the latest intact checkpoint).")
    g.add_argument("--load", type=str, default=None,
                   help="Directory to load a checkpoint from (the iteration its latest_checkpointed_iteration.txt "
                        "names). A damaged checkpoint, or one of another model or learning-rate schedule, is "
                        "refused in one line before anything is written.")
    g.add_argument("--dist-ckpt-strictness", choices=DIST_CKPT_STRICTNESS, default="assume_ok_unexpected",
                   help="What loading a checkpoint does with keys missing from it or unexpected in it "
                        "(megatron-core's StrictHandling; Megatron-LM's return_* modes, which return the keys "
                        "instead of acting on them, are not offered).")
    g.add_argument("--auto-detect-ckpt-format", action="store_true",
                   help="Accepted: megatron-zb always detects the format of --load (torch_dist is read; Megatron-LM's "
                        "torch format is refused naming the conversion).")
    g.add_argument("--ckpt-format", choices=CKPT_FORMATS, default="torch_dist",
                   help="Checkpoint format (Megatron-LM's choices, default torch_dist): megatron-zb writes and "
                        "reads torch_dist only; the others are refused.")
    g.add_argument("--save-interval", type=int, default=None, help="Iterations between checkpoint saves.")
    g.add_argument("--ckpt-step", type=int, default=None, metavar="N",
                   help="With --load: load the checkpoint of iteration N (DIR/iter_NNNNNNN) instead of the one "
                        "latest_checkpointed_iteration.txt names (as Megatron). A damaged checkpoint's error names "
                        "the --ckpt-step of the previous intact one.")
    g.add_argument("--no-ckpt-verify", dest="ckpt_verify", action="store_false",
                   help="With --load: do not verify the checkpoint's files against the sizes and CRC-32 checksums "
                        "of its manifest.json (megatron-zb's; every save writes one). Verifying reads the "
                        "checkpoint once more, shared over the ranks: about 0.45 s per GB per rank on a 2-core CPU "
                        "when the files are in the page cache, at the file system's read speed otherwise. Without "
                        "it a changed byte loads silently, as before megatron-zb wrote manifests.")
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
    add_loading_and_exit_args(g)


def _minutes(text: str) -> int | float:
    """``--exit-duration-in-mins``: Megatron-LM's whole minutes (an ``int``), or here also a fraction."""
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of minutes") from None


def add_loading_and_exit_args(g: argparse._ArgumentGroup) -> None:
    """Megatron-LM's ``--no-load-optim``, ``--no-load-rng``, ``--finetune``, ``--exit-duration-in-mins``."""
    g.add_argument("--no-load-optim", action="store_true", default=None,
                   help="With --load: do not load the optimizer state nor the learning-rate scheduler (fresh "
                        "ones; the fp32 main parameters are refreshed from the loaded model), as Megatron-LM.")
    g.add_argument("--no-load-rng", action="store_true", default=None,
                   help="With --load: do not restore the random states (this run's --seed streams).")
    g.add_argument("--finetune", action="store_true",
                   help="With --load: load the model only and start at iteration 0 (no optimizer, scheduler, "
                        "random states, consumed samples or profiled costs from the checkpoint), as Megatron-LM.")
    g.add_argument("--exit-duration-in-mins", type=_minutes, default=None, metavar="MINUTES",
                   help="Save (with --save) and exit with status 0 after the first iteration that ends this many "
                        "minutes after the run started; every rank checks after every iteration (as Megatron-LM, "
                        "which takes whole minutes; a fraction is accepted here). 0: off.")


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


def check_save_directory(args: argparse.Namespace) -> None:
    """``--save`` is a writable directory or can be created as one
    (:func:`~megatron_zb.training.save_space.save_directory_problem`): refused now, not at the first save."""
    from megatron_zb.training.save_space import save_directory_problem

    problem = save_directory_problem(args.save) if args.save else None
    if problem is not None:
        raise ArgumentError("--save", problem)


def check_load_flags(args: argparse.Namespace) -> None:
    """``--no-load-optim`` / ``--no-load-rng`` / ``--finetune`` without ``--load`` do nothing, as in
    Megatron-LM: a start-up line says so."""
    given = [f for f, v in (("--no-load-optim", args.no_load_optim), ("--no-load-rng", args.no_load_rng),
                            ("--finetune", args.finetune)) if v]
    if given and not args.load:
        notice(args, f"WARNING: {', '.join(given)} without --load: nothing is loaded, no effect (as Megatron-LM)")


def check_exit_duration(args: argparse.Namespace) -> None:
    """``--exit-duration-in-mins`` is a duration: not negative (0 is off, as Megatron-LM's ``if`` reads it)."""
    if args.exit_duration_in_mins is not None and args.exit_duration_in_mins < 0:
        raise ArgumentError("--exit-duration-in-mins", f"must be >= 0 minutes, got {args.exit_duration_in_mins}; "
                                                       f"give the time after which to save and exit")


def check_load_format(args: argparse.Namespace) -> None:
    """The checkpoint ``--load`` names is not in Megatron-LM's torch format (a legacy model's, with
    ``--use-legacy-models``, or ``--ckpt-format torch``): refused now, before any process group starts
    (:func:`~megatron_zb.training.checkpoint_check.torch_format`). Reads the tracker and one file's index."""
    from megatron_zb.training.checkpoint_check import CheckpointError, load_directory, torch_format

    if not args.load:
        return
    try:
        path = load_directory(args.load, args.ckpt_step)
    except CheckpointError:  # an unreadable tracker: the load itself reports it
        return
    problem = None if path is None else torch_format(path)
    if problem is not None:
        raise ArgumentError("--load", problem)


def check_auto_detect_ckpt_format(args: argparse.Namespace) -> None:
    """``--auto-detect-ckpt-format``: a start-up WARNING (the format of ``--load`` is always detected)."""
    if args.auto_detect_ckpt_format:
        notice(args, "WARNING: --auto-detect-ckpt-format has no effect: megatron-zb always detects the format of "
                     "--load; it reads torch_dist checkpoints and refuses Megatron-LM's torch format by name, with "
                     "the conversion to run")

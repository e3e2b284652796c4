"""Entry point of ``pretrain_gpt_zb.py``: parse and validate the command line, then run the Trainer.

:func:`main` does what Megatron-LM's ``pretrain_gpt.py`` does, with megatron-zb's
``forward_backward_func`` in place of megatron-core's:

1. parse and validate the command line (:mod:`megatron_zb.training.arguments`, plus the
   developer flags of :mod:`megatron_zb.training.arguments.developer`) *before* any process group
   exists; a bad flag prints one ``pretrain_gpt_zb.py: error: --flag: ...`` line (on local rank 0)
   and exits with status 2 -- several bad flags, one report: a header line and one line per flag,
   the unknown flags first; global rank 0 then prints validation's start-up lines (adjusted flags,
   ``WARNING: ...`` as Megatron-LM). Between the two, a partial launch environment (``WORLD_SIZE``
   without ``RANK`` / ``MASTER_ADDR`` / ``MASTER_PORT``, or the reverse:
   :func:`~megatron_zb.training.distributed.launch_environment_problem`; a ``WORLD_SIZE`` that is no
   integer, before the command line) prints one ``pretrain_gpt_zb.py: error: partial launch environment:
   ...`` line on every process, naming what is set, what is missing and the fix, and exits with status 2;
2. :class:`~megatron_zb.training.trainer.Trainer` sets the run up and trains (see its module); a
   checkpoint ``--load`` cannot load (:class:`~megatron_zb.training.checkpoint_check.CheckpointError`)
   prints one ``pretrain_gpt_zb.py: error: ...`` line (global rank 0) and exits with status 1
   before anything is written; so does a NaN/Inf in a loss or a gradient with
   ``--check-for-nan-in-loss-and-grad`` (:class:`~megatron_zb.training.nan_check.NonFiniteError`, raised
   on every rank at the same point: the line names the iteration and the rank that found it), and a
   checkpoint that does not fit on ``--save``'s file system or whose write fails (the line names the
   latest intact checkpoint; the tracker is not advanced). A write that fails in a step megatron-core
   runs on one rank alone (rank 0's ``common.pt``:
   :class:`~megatron_zb.training.checkpoint_check.OneRankSaveError`) is printed by that rank, which
   exits 1 at once without a collective -- the others wait inside the save, and the launcher ends them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Sequence

import torch.distributed as dist

from megatron_zb.training.arguments import ArgumentError, ValidatedArgs, build_parser, validate_args_and_schedule
from megatron_zb.training.arguments.developer import DEVELOPER_CHECK, add_developer_args
from megatron_zb.training.checkpoint_check import CheckpointError, OneRankSaveError
from megatron_zb.training.distributed import launch_environment_problem, local_rank
from megatron_zb.training.nan_check import NonFiniteError
from megatron_zb.training.trainer import Trainer

__all__ = ["PROG", "main", "parse_and_validate", "parse_command_line"]

PROG = "pretrain_gpt_zb.py"


def _usage_error(message: str) -> int:
    """Print one error line on local rank 0; other ranks wait briefly so the launcher shows it."""
    if local_rank() == 0:
        print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    else:
        time.sleep(5)  # let local rank 0 print before the launcher tears the job down
    return 2


def _environment_error(problem: str) -> int:
    """Print the launch environment's one error line (every process: which is local rank 0 is not known)."""
    print(f"{PROG}: error: {problem}", file=sys.stderr, flush=True)
    return 2


def parse_command_line(argv: Sequence[str] | None, *, world_size: int) -> ValidatedArgs:
    """Parse and validate ``argv`` (developer flags included) for ``world_size`` processes.

    Raises ``ArgumentError`` (every unknown flag and every failed check, in one report) or
    ``SystemExit(2)`` (argparse: a bad value; the usage and one error line are printed on local rank 0).
    """
    parser = build_parser(extra_args_provider=add_developer_args)

    def error(message: str) -> None:
        if local_rank() == 0:
            parser.print_usage(sys.stderr)
        raise SystemExit(_usage_error(message))

    parser.error = error  # type: ignore[method-assign]
    args, unknown = parser.parse_known_flags(argv)
    return validate_args_and_schedule(args, world_size=world_size, unknown=unknown, extra_checks=(DEVELOPER_CHECK,))


def parse_and_validate(argv: Sequence[str] | None, world_size: int) -> argparse.Namespace:
    """:func:`parse_command_line` returning only the args (``Trainer(args)`` then builds the schedule again)."""
    return parse_command_line(argv, world_size=world_size).args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``pretrain_gpt_zb.py``; returns the exit status."""
    problem = None if dist.is_initialized() else launch_environment_problem(os.environ)
    world_size = os.environ.get("WORLD_SIZE", "1")
    if problem is not None and not world_size.strip().isdigit():
        return _environment_error(problem)
    try:
        validated = parse_command_line(argv, world_size=int(world_size))
    except ArgumentError as e:
        return _usage_error(str(e))
    if problem is not None:
        return _environment_error(problem)
    if os.environ.get("RANK", "0") == "0":
        for line in validated.notices:
            print(line, flush=True)
    try:
        trainer = Trainer(validated.args, schedule=validated.schedule)
    except CheckpointError:
        return 1  # the Trainer printed the one line (rank 0) before it shut the process groups down
    try:
        return trainer.run()
    except OneRankSaveError as e:  # this rank alone: no collective (close() has some); exiting ends the others
        if e.peer_lost:  # a consequence: the cause is the other rank's error line
            print(f"{PROG}: rank {os.environ.get('RANK', '0')} stops: another rank ended during the checkpoint save",
                  flush=True)
        else:
            print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    except (NonFiniteError, CheckpointError) as e:  # every rank, together (a save): global rank 0 says it once
        if os.environ.get("RANK", "0") == "0":
            print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        trainer.close()

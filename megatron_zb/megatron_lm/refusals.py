"""What the Megatron-LM loop route refuses, and how it says so: the zero-bubble flags it cannot honour
there (:data:`NOT_YET`), the Megatron-LM flags refused with any zero-bubble schedule
(:func:`refused_with_a_schedule`; a V's own: :func:`megatron_zb.megatron_lm.v.refused_with_a_v`), and the
exit that prints the one report once per job (:func:`exit_refused`)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import NoReturn

from ..training.arguments.common import ArgumentError

__all__ = ["NOT_YET", "QUIET_RANKS_WAIT_S", "exit_refused", "refused_with_a_schedule"]

NOT_YET: dict[str, str] = {
    "allow_padding_num_layers": "Megatron-LM splits the layers itself; use its --decoder-first-pipeline-num-layers "
                                "/ --decoder-last-pipeline-num-layers, or drop the flag",
    "enable_vocab_parallel": "Megatron-LM's model provider builds the whole word embedding and output layer; "
                             "run vocabulary parallelism with pretrain_gpt_zb.py, or drop the flag",
    "zero_bubble_wgrad_group": "weight-gradient groups run in pretrain_gpt_zb.py's trainer only so far (issue 42); "
                               "use pretrain_gpt_zb.py, or drop the flag",
}
"""Zero-bubble flags (``args`` attribute -> why and what to do) refused inside Megatron-LM's loop."""


def refused_with_a_schedule(args: argparse.Namespace, schedule: str) -> list[ArgumentError]:
    """Megatron-LM flags refused with any zero-bubble ``schedule`` inside Megatron-LM's loop, one
    :class:`ArgumentError` each: ``--use-megatron-fsdp``, ``--moe-shared-expert-overlap`` and
    ``--moe-router-force-load-balancing``, for the reasons ``pretrain_gpt_zb.py`` refuses them
    (:data:`~megatron_zb.training.arguments.flags.WHY_NOT`), and ``--data-parallel-sharding-strategy
    optim_grads`` without Megatron FSDP (sharded gradients are ``pretrain_gpt_zb.py``'s so far). ``--mtp-num-layers`` is refused with a V only
    (:func:`~megatron_zb.megatron_lm.v.refused_with_a_v`)."""
    from ..training.arguments.flags import WHY_NOT

    refused = []
    if getattr(args, "use_megatron_fsdp", False):
        refused.append(ArgumentError("--use-megatron-fsdp", f"refused with the zero-bubble schedule {schedule!r}: "
                                                            f"{WHY_NOT['--use-megatron-fsdp']}; drop it or the "
                                                            f"zero-bubble flags"))
    for name in ("--moe-shared-expert-overlap", "--moe-router-force-load-balancing"):  # DeepSeek's MoE: as ours
        if getattr(args, name[2:].replace("-", "_"), False):
            refused.append(ArgumentError(name, f"refused with the zero-bubble schedule {schedule!r}: {WHY_NOT[name]}; "
                                               f"drop it or the zero-bubble flags"))
    if getattr(args, "data_parallel_sharding_strategy", None) == "optim_grads" and not getattr(args, "use_megatron_fsdp",
                                                                                               False):
        # Megatron-LM applies the flag to Megatron FSDP only: without it, it would be ignored here
        refused.append(ArgumentError("--data-parallel-sharding-strategy",
                                     "optim_grads without --use-megatron-fsdp is megatron-zb's sharded gradients, which "
                                     "run in pretrain_gpt_zb.py's trainer only so far (issue 42); use pretrain_gpt_zb.py, "
                                     "or drop the flag"))
    return refused


QUIET_RANKS_WAIT_S = 2.0
"""Seconds every rank but global rank 0 waits before exiting 2 on a refused command line: rank 0 prints
the report meanwhile, before a launcher tears the job down at the first exit (torchrun: 0.1 s polls)."""


def exit_refused(error: ArgumentError) -> NoReturn:
    """Exit 2 for ``error`` (every problem of the command line): global rank 0 (``RANK``; no process
    group exists yet) prints ``megatron-zb: error: ...`` on stderr, every other rank prints nothing and
    exits after :data:`QUIET_RANKS_WAIT_S`: the report is printed once per job."""
    if os.environ.get("RANK", "0") == "0":
        print(f"megatron-zb: error: {error}", file=sys.stderr, flush=True)
    else:
        time.sleep(QUIET_RANKS_WAIT_S)
    raise SystemExit(2) from None

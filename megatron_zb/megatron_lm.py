"""megatron-zb inside NVIDIA Megatron-LM's own training loop: the zero-bubble flags on Megatron-LM's
parser, checked before Megatron-LM initialises, and the schedule routed in.

Two lines at the top of the user's ``pretrain_gpt.py`` (before ``pretrain(...)`` runs)::

    import megatron_zb.megatron_lm
    megatron_zb.megatron_lm.install()

:func:`install` wraps Megatron-LM's ``parse_args`` (``megatron.training.arguments`` and the name
``megatron.training.initialize`` imported): the parser gets the zero-bubble flags beside whatever
``extra_args_provider`` the script passes, and right after parsing -- before any process group --
the zero-bubble flags are checked (one line per problem naming the flag, exit 2) and
:func:`megatron_zb.patch_megatron` routes megatron-core's ``get_forward_backward_func`` to the
chosen schedule. Flags: ``--enable-zero-bubble``, ``--zero-bubble-max-pending-backward``,
``--schedule``, ``--pipeline-timeout-seconds`` and the rest of the zero-bubble group of
``pretrain_gpt_zb.py`` (one definition: :func:`~megatron_zb.training.arguments.zero_bubble.add_zero_bubble_args`).

What this route cannot honour yet is refused up front (:data:`NOT_YET`): V schedules (Megatron-LM's
``get_model`` builds one chunk per rank, not the V), optimizer post-validation, the profiling window
with re-planning and ``--profile-out`` (cost-aware schedules run with unit costs ``T_F = T_B = T_W``
here), ``--allow-padding-num-layers``. ``pretrain_gpt_zb.py`` has all of them.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

from .training.arguments.common import ArgumentError, flag

NOT_YET: dict[str, str] = {
    "zero_bubble_v_schedule": "V schedules need the model built for the V placement, which Megatron-LM's "
                              "get_model does not do; use pretrain_gpt_zb.py, or --enable-zero-bubble",
    "enable_optimizer_post_validation": "post-validation is not wired into Megatron-LM's loop yet; use "
                                        "pretrain_gpt_zb.py, or drop the flag",
    "profile_out": "the profiling window is not wired into Megatron-LM's loop yet; use pretrain_gpt_zb.py, "
                   "or drop the flag",
    "allow_padding_num_layers": "Megatron-LM splits the layers itself; use its --decoder-first-pipeline-num-layers "
                                "/ --decoder-last-pipeline-num-layers, or drop the flag",
}
"""Zero-bubble flags (``args`` attribute -> why and what to do) refused inside Megatron-LM's loop."""

_INSTALLED: list[tuple[Any, str, Callable]] = []


def install() -> None:
    """Add the zero-bubble flags to Megatron-LM's parser and route the schedule (module docstring).
    Idempotent; :func:`uninstall` restores Megatron-LM's ``parse_args``."""
    from megatron.training import arguments, initialize

    if _INSTALLED:
        return
    original = arguments.parse_args

    def parse_args(extra_args_provider: Callable | None = None, ignore_unknown_args: bool = False) -> argparse.Namespace:
        def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            add_flags(parser)
            return parser

        args = original(provider, ignore_unknown_args)
        try:
            options = configure(args)
        except ArgumentError as e:
            print(f"megatron-zb: error: {e}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        if options is not None:  # else megatron-core's schedule runs untouched
            from .patching import patch_megatron

            patch_megatron(options.pop("schedule"), **options)
        return args

    for module in (arguments, initialize):
        _INSTALLED.append((module, "parse_args", module.parse_args))
        module.parse_args = parse_args


def uninstall() -> None:
    """Restore Megatron-LM's ``parse_args`` and megatron-core's ``get_forward_backward_func``."""
    from .patching import unpatch_megatron

    while _INSTALLED:
        module, name, fn = _INSTALLED.pop()
        setattr(module, name, fn)
    unpatch_megatron()


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The zero-bubble group of ``pretrain_gpt_zb.py`` on Megatron-LM's parser."""
    from .training.arguments.zero_bubble import add_zero_bubble_args

    add_zero_bubble_args(parser)


def configure(args: argparse.Namespace) -> dict[str, Any] | None:
    """Check the zero-bubble flags of Megatron-LM's parsed ``args``; return :func:`patch_megatron`'s
    arguments (``schedule`` and options), or ``None`` when no zero-bubble schedule was asked for.
    Raises :class:`ArgumentError` naming the flag."""
    from .schedules.ir import Placement
    from .schedules.registry import get_spec

    for dest, why in NOT_YET.items():
        if getattr(args, dest, None):
            raise ArgumentError(flag(dest), f"not supported inside Megatron-LM's loop: {why}")
    if args.zero_bubble_v_schedule_mem_setup is not None:
        raise ArgumentError("--zero-bubble-v-schedule-mem-setup", "only applies to V schedules, which are not "
                                                                  "supported inside Megatron-LM's loop; drop it")
    if args.schedule_requested is not None and args.enable_zero_bubble:
        raise ArgumentError("--schedule", "give --schedule or --enable-zero-bubble, not both")
    name = args.schedule_requested or ("zb" if args.enable_zero_bubble else None)
    pending = args.zero_bubble_max_pending_backward
    if name is None:
        if pending is not None:
            raise ArgumentError("--zero-bubble-max-pending-backward", "only applies with --enable-zero-bubble or "
                                                                      "--schedule; add one or drop this flag")
        return None
    spec, chunks = get_spec(name), _virtual_chunks(args)
    if spec.placement is Placement.V:
        raise ArgumentError("--schedule", f"{name!r} is a V schedule: {NOT_YET['zero_bubble_v_schedule']}")
    if (spec.placement is Placement.INTERLEAVED) != (chunks > 1):
        raise ArgumentError("--schedule", f"{name!r} has the {spec.placement.value} placement but Megatron-LM "
                                          f"builds {chunks} model chunk(s) per rank; match --num-layers-per-virtual-"
                                          f"pipeline-stage to the schedule")
    if pending is None and args.enable_zero_bubble:
        pending = args.pipeline_model_parallel_size  # ZB-1p: 1F1B's activation memory, as the fork does
    if pending is not None and pending < 1:
        raise ArgumentError("--zero-bubble-max-pending-backward", f"must be >= 1 micro batch, got {pending}")
    options: dict[str, Any] = {"schedule": name, "timeout": args.pipeline_timeout_seconds}
    if chunks > 1:
        options["num_chunks"] = chunks
    if pending is not None:
        options["memory_limit"] = float(pending * chunks)
    return options


def _virtual_chunks(args: argparse.Namespace) -> int:
    """Model chunks per pipeline rank Megatron-LM will build (its interleaving flags)."""
    if getattr(args, "num_virtual_stages_per_pipeline_rank", None):
        return int(args.num_virtual_stages_per_pipeline_rank)
    per_stage = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    if per_stage:
        return args.num_layers // args.pipeline_model_parallel_size // per_stage
    return 1

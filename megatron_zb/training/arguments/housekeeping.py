"""Megatron-LM's profiling, garbage-collection and CUDA-cache flags (its ``ProfilingConfig`` group and
the ``--manual-gc*`` / ``--empty-unused-memory-level`` flags of its training group), with their
checks: :func:`check_profiling` and :func:`check_memory_flags`. What they do at run time:
:mod:`megatron_zb.training.profile_window` and :mod:`megatron_zb.training.housekeeping`."""

from __future__ import annotations

import argparse

import torch

from .common import ArgumentError, notice

__all__ = ["add_housekeeping_args", "check_memory_flags", "check_profiling"]

PROFILE_DEFAULTS = {"profile_step_start": 10, "profile_step_end": 12, "profile_ranks": [0],
                    "use_pytorch_profiler": False}
"""Megatron-LM core_v0.16.1's defaults (``megatron/training/common_config.py``, ``ProfilingConfig``)."""


def add_housekeeping_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("profiling")
    g.add_argument("--profile", action="store_true",
                   help="Profile iterations --profile-step-start to --profile-step-end on --profile-ranks: with "
                        "CUDA, CUDA's capture range (cudaProfilerStart/Stop and NVTX ranges, for nsys "
                        "--capture-range=cudaProfilerApi), as Megatron-LM; with --use-pytorch-profiler or "
                        "without CUDA, PyTorch's profiler, one Chrome trace per profiled rank in --tensorboard-dir.")
    g.add_argument("--profile-step-start", type=int, default=10,
                   help="Iterations completed when profiling starts (default 10). PyTorch's profiler records "
                        "iterations START to END-1 (the one before is its warm-up); CUDA's capture range "
                        "START+1 to END, as Megatron-LM.")
    g.add_argument("--profile-step-end", type=int, default=12,
                   help="Iteration after which profiling stops (default 12).")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="Use PyTorch's profiler (traces for TensorBoard's profiler plugin or Perfetto) instead of "
                        "CUDA's capture range.")
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0],
                   help="Global ranks to profile (default 0).")
    g = parser.add_argument_group("garbage collection and the CUDA cache")
    g.add_argument("--manual-gc", action="store_true",
                   help="Turn Python's automatic garbage collector off and collect at fixed points instead "
                        "(every --manual-gc-interval iterations, around evaluation), the same on every rank, as "
                        "Megatron-LM.")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="With --manual-gc: a full collection after every N iterations; 0 (default): none "
                        "between iterations.")
    g.add_argument("--no-manual-gc-eval", "--disable-manual-gc-eval", action="store_false", dest="manual_gc_eval",
                   help="With --manual-gc: no collection before and after each evaluation during training.")
    g.add_argument("--empty-unused-memory-level", type=int, choices=(0, 1, 2), default=0,
                   help="torch.cuda.empty_cache() after forward-backward and after each evaluation step (1), "
                        "also after the optimizer step (2); 0 (default): never. A no-op without CUDA.")


def _pytorch_profiler(args: argparse.Namespace) -> bool:
    """Whether ``--profile`` runs PyTorch's profiler: asked for, or no CUDA for the capture range."""
    return args.use_pytorch_profiler or not torch.cuda.is_available()


def check_profiling(args: argparse.Namespace) -> None:
    """The ``--profile`` window: after its start, within the run, on ranks of the job, with a place
    for PyTorch's traces. The window flags without ``--profile`` do nothing, as in Megatron-LM: a
    start-up line says so."""
    if not args.profile:
        given = [f"--{d.replace('_', '-')}" for d, v in PROFILE_DEFAULTS.items() if getattr(args, d) != v]
        if given:
            notice(args, f"WARNING: {', '.join(given)} without --profile: no effect (as Megatron-LM); add --profile "
                         f"to profile")
        return
    start, end = args.profile_step_start, args.profile_step_end
    if start < 0:
        raise ArgumentError("--profile-step-start", f"must be >= 0, got {start}")
    if end <= start:
        raise ArgumentError("--profile-step-end", f"{end} must be greater than --profile-step-start {start}")
    if start >= args.train_iters:
        raise ArgumentError("--profile-step-start", f"{start}: profiling starts after iteration {start}, and the run "
                                                    f"ends at --train-iters {args.train_iters}; give a smaller value")
    outside = [r for r in args.profile_ranks if not 0 <= r < args.world_size]
    if outside:
        raise ArgumentError("--profile-ranks", f"{outside} not among the job's ranks 0-{args.world_size - 1}; "
                                               f"give ranks of the job")
    if _pytorch_profiler(args):
        if args.tensorboard_dir is None:
            which = "--use-pytorch-profiler" if args.use_pytorch_profiler else "--profile"
            raise ArgumentError(which, "PyTorch's profiler writes one trace per profiled rank into --tensorboard-dir "
                                       "(as Megatron-LM); add --tensorboard-dir DIR")
        if not args.use_pytorch_profiler:
            notice(args, "WARNING: --profile without CUDA: PyTorch's profiler is used (as with "
                         "--use-pytorch-profiler); CUDA's capture range needs a GPU")


def check_memory_flags(args: argparse.Namespace) -> None:
    """``--manual-gc-interval`` >= 0 (as Megatron-LM asserts); the GC flags without ``--manual-gc`` and
    ``--empty-unused-memory-level`` without CUDA do nothing: a start-up line says so."""
    if args.manual_gc_interval < 0:
        raise ArgumentError("--manual-gc-interval", f"must be >= 0 iterations, got {args.manual_gc_interval}")
    if not args.manual_gc:
        given = [f for f, on in (("--manual-gc-interval", args.manual_gc_interval != 0),
                                 ("--no-manual-gc-eval", not args.manual_gc_eval)) if on]
        if given:
            notice(args, f"WARNING: {', '.join(given)} without --manual-gc: no effect (as Megatron-LM)")
    if args.empty_unused_memory_level > 0 and not torch.cuda.is_available():
        notice(args, f"--empty-unused-memory-level {args.empty_unused_memory_level}: no CUDA device, so "
                     f"torch.cuda.empty_cache() has nothing to release: a no-op here")

"""Parallelism flags (Megatron's "distributed" group): TP/PP/DP sizes, how a global batch splits
into micro batches, the ``torch.distributed`` backend; their checks and derived values."""

from __future__ import annotations

import argparse

import torch

from .common import ArgumentError

__all__ = ["add_distributed_args", "check_batch_sizes", "check_sequence_parallel", "check_world_size",
           "resolve_backend"]


def add_distributed_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="Tensor-parallel size (default 1).")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="Pipeline-parallel size (default 1).")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                   help="Model chunks per pipeline rank for interleaved schedules (--schedule "
                        "interleaved-1f1b / interleaved-zb). Default 2 for those; V schedules always use 2.")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron sequence parallelism (needs --tensor-model-parallel-size > 1).")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Shard optimizer state over data-parallel ranks (Megatron distributed optimizer).")
    g.add_argument("--distributed-backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="torch.distributed backend. auto (default): nccl when CUDA is available, else gloo.")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10,
                   help="Timeout of collective operations, minutes (default 10).")


def check_world_size(args: argparse.Namespace, world_size: int) -> None:
    """TP x PP divides the world size; sets ``data_parallel_size``."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world_size % (tp * pp):
        raise ArgumentError(
            "--tensor-model-parallel-size",
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp} = {tp * pp}; launch a multiple of {tp * pp} processes "
            f"or change the parallel sizes")
    args.data_parallel_size = world_size // (tp * pp)


def check_sequence_parallel(args: argparse.Namespace) -> None:
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        raise ArgumentError("--sequence-parallel", "needs --tensor-model-parallel-size > 1; drop --sequence-parallel "
                                                   "or raise the tensor-parallel size")


def check_batch_sizes(args: argparse.Namespace) -> None:
    """Default and check ``--global-batch-size``; sets ``num_microbatches`` (per iteration per DP rank)."""
    mbs, dp = args.micro_batch_size, args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = mbs * dp
    if args.global_batch_size % (mbs * dp):
        raise ArgumentError("--global-batch-size",
                            f"{args.global_batch_size} is not divisible by --micro-batch-size {mbs} x data-parallel "
                            f"size {dp} = {mbs * dp}; use a multiple of {mbs * dp}")
    args.num_microbatches = args.global_batch_size // (mbs * dp)


def resolve_backend(args: argparse.Namespace) -> None:
    """``--distributed-backend auto`` -> ``nccl`` with CUDA, else ``gloo``; ``nccl`` needs CUDA."""
    if args.distributed_backend == "auto":
        args.distributed_backend = "nccl" if torch.cuda.is_available() else "gloo"
    elif args.distributed_backend == "nccl" and not torch.cuda.is_available():
        raise ArgumentError("--distributed-backend", "nccl needs CUDA, which is not available here; use gloo or auto")

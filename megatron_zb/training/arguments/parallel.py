"""Parallelism flags (Megatron's "distributed" group): TP/PP/DP sizes, how a global batch splits
into micro batches, the ``torch.distributed`` backend; their checks and derived values."""

from __future__ import annotations

import argparse

import torch

from .common import ArgumentError, notice

__all__ = ["add_distributed_args", "check_batch_sizes", "check_context_parallel", "check_data_parallel_overlap",
           "check_sequence_parallel", "check_world_size", "data_parallel_summary", "resolve_backend",
           "resolve_p2p_overlap"]


def add_distributed_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1, help="Tensor-parallel size (default 1).")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="Pipeline-parallel size (default 1).")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                   help="Model chunks per pipeline rank for interleaved schedules (--schedule "
                        "interleaved-1f1b / interleaved-zb). Default 2 for those; V schedules always use 2.")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="Megatron-LM's other way to ask for model chunks: layers per chunk; chunks per rank = "
                        "num-layers / PP / this (not with --num-virtual-stages-per-pipeline-rank or the uneven "
                        "first/last stage flags).")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron sequence parallelism; at --tensor-model-parallel-size 1 it is turned off with a "
                        "log line (as Megatron-LM).")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="Context-parallel size; only 1 (no context parallelism) is supported.")
    g.add_argument("--no-overlap-p2p-communication", action="store_false", dest="overlap_p2p_comm",
                   help="Megatron-LM: do not overlap the interleaved schedule's p2p with compute (batched p2p "
                        "instead). megatron-zb's runtime never batches its transfers (each is its own isend/irecv, "
                        "receives posted ahead), so its schedules run the same; sets megatron-core's "
                        "overlap_p2p_comm/batch_p2p_comm.")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Shard optimizer state over data-parallel ranks (Megatron distributed optimizer).")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="Overlap the data-parallel gradient reduce (all-reduce, or reduce-scatter with "
                        "--use-distributed-optimizer) with the pipeline: a bucket is reduced as soon as every "
                        "parameter in it has its final gradient (a weight: after its last W).")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="Overlap the distributed optimizer's parameter all-gather with the next iteration's "
                        "forwards (needs --use-distributed-optimizer and --overlap-grad-reduce, as Megatron).")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="Elements per data-parallel bucket (default: megatron-core's, max(40M, 1M x DP size)); "
                        "only with --overlap-grad-reduce, and only on the first pipeline stage, as Megatron.")
    g.add_argument("--ddp-average-in-collective", action="store_true",
                   help="Average the gradients in the data-parallel collective (ReduceOp.AVG, which gloo "
                        "supports in torch >= 2.13, as NCCL does) instead of scaling them by 1/DP before a sum (as "
                        "Megatron). Not with --calculate-per-token-loss.")
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
    """``--sequence-parallel`` at TP 1 is turned off with a log line, as Megatron-LM does (arguments.py
    906-913); the flag itself is kept as ``sequence_parallel_requested``."""
    if not hasattr(args, "sequence_parallel_requested"):
        args.sequence_parallel_requested = args.sequence_parallel
    args.sequence_parallel = args.sequence_parallel_requested and args.tensor_model_parallel_size > 1
    if args.sequence_parallel_requested and not args.sequence_parallel:
        notice(args, "WARNING: Disabling sequence parallelism because tensor model parallelism is disabled "
                     "(--sequence-parallel at --tensor-model-parallel-size 1)")


def check_context_parallel(args: argparse.Namespace) -> None:
    """Only ``--context-parallel-size 1``."""
    cp = args.context_parallel_size
    if cp != 1:
        raise ArgumentError("--context-parallel-size", f"{cp} is not supported: megatron-zb's pipeline runtime and data "
                                                       f"set-up do not split sequences over ranks (context parallelism "
                                                       f"also needs Transformer Engine's attention with CUDA); use "
                                                       f"--context-parallel-size 1")


def resolve_p2p_overlap(args: argparse.Namespace) -> None:
    """megatron-core's ``overlap_p2p_comm`` / ``batch_p2p_comm`` as Megatron-LM derives them (arguments.py
    573-585, 1326): overlap only with several model chunks per rank and without
    ``--no-overlap-p2p-communication``; batched exactly when not overlapped. Needs ``num_model_chunks``.
    The flag is kept as ``overlap_p2p_comm_requested``."""
    if not hasattr(args, "overlap_p2p_comm_requested"):
        args.overlap_p2p_comm_requested = args.overlap_p2p_comm
    args.overlap_p2p_comm = args.overlap_p2p_comm_requested and args.num_model_chunks > 1
    args.batch_p2p_comm = not args.overlap_p2p_comm
    if not args.overlap_p2p_comm_requested:
        notice(args, "WARNING: --no-overlap-p2p-communication changes nothing in megatron-zb's schedules: the runtime "
                     "never batches its p2p (each transfer is its own isend/irecv on one communicator per direction, "
                     "receives posted ahead); it sets megatron-core's overlap_p2p_comm=False, batch_p2p_comm=True")


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
    """``--distributed-backend auto`` -> ``nccl`` with CUDA, else ``gloo``; ``nccl`` needs CUDA; ``gloo`` needs
    the GPUs hidden: the CPU path (the CPU shim) runs only where CUDA is not available, and with CUDA visible
    megatron-core puts its gradient buffers on the GPU beside gloo (a PP=2 x DP=2 run crashed, SIGSEGV,
    on an H200 with megatron-core 0.19.2)."""
    cuda = torch.cuda.is_available()
    if args.distributed_backend == "auto":
        args.distributed_backend = "nccl" if cuda else "gloo"
    elif args.distributed_backend == "nccl" and not cuda:
        raise ArgumentError("--distributed-backend", "nccl needs CUDA, which is not available here; use gloo or auto")
    elif args.distributed_backend == "gloo" and cuda:
        raise ArgumentError("--distributed-backend", "gloo runs the CPU path, but CUDA is visible here (megatron-core "
                                                     "would put its buffers on the GPU); use nccl (or auto) on GPUs, "
                                                     "or hide them (CUDA_VISIBLE_DEVICES=) to train on the CPU")


def check_data_parallel_overlap(args: argparse.Namespace) -> None:
    """The combinations of the data-parallel flags that Megatron (and megatron-core's DDP) refuse."""
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise ArgumentError("--overlap-param-gather", "is only supported with the distributed optimizer; add "
                                                      "--use-distributed-optimizer or drop --overlap-param-gather")
    if args.overlap_param_gather and not args.overlap_grad_reduce:
        raise ArgumentError("--overlap-param-gather", "needs --overlap-grad-reduce (as Megatron); add it")
    if args.ddp_average_in_collective and getattr(args, "calculate_per_token_loss", False):
        # megatron-core's DDP asserts this deep in its constructor
        raise ArgumentError("--ddp-average-in-collective", "cannot be combined with --calculate-per-token-loss "
                                                           "(the gradients are summed over tokens, not averaged); "
                                                           "drop one of them")
    if args.ddp_bucket_size is not None and args.ddp_bucket_size < 1:
        raise ArgumentError("--ddp-bucket-size", f"must be a positive number of elements, got {args.ddp_bucket_size}")


def data_parallel_summary(args: argparse.Namespace) -> str:
    """One log line naming the data-parallel settings and which overlaps are on."""
    def on(x: bool) -> str:
        return "on" if x else "off"

    bucket = args.ddp_bucket_size if args.ddp_bucket_size is not None else "megatron-core default"
    return (f"> data parallel: size {args.data_parallel_size}, distributed optimizer "
            f"{on(args.use_distributed_optimizer)}, overlap-grad-reduce {on(args.overlap_grad_reduce)}, "
            f"overlap-param-gather {on(args.overlap_param_gather)}, average-in-collective "
            f"{on(args.ddp_average_in_collective)}, bucket size "
            f"{bucket if args.overlap_grad_reduce else 'one bucket (no overlap)'}")

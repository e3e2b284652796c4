"""The command line of ``pretrain_gpt_zb.py``: Megatron's GPT flags plus the zero-bubble ones.

Flag names and meanings follow Megatron-LM's ``pretrain_gpt.py`` so that a user's existing
command keeps working with ``--enable-zero-bubble`` added. Three entry points:

* :func:`build_parser` -- the :class:`argparse.ArgumentParser` (groups as in Megatron);
* :func:`parse_args` -- parse ``argv`` (no checks beyond argparse's own);
* :func:`validate_args` -- check every flag combination *before* any process group starts,
  raising :class:`ArgumentError` (names the flag and the fix), and fill in derived values.
  It is idempotent (validating validated args again changes nothing) and builds the schedule
  once with unit costs to check that it exists; :func:`initial_schedule` returns that schedule.

Derived values set by :func:`validate_args` (units in brackets):

==================================  ===========================================================
``world_size``                      processes in the job
``data_parallel_size``              ``world_size / (TP * PP)``
``num_microbatches``                micro batches per iteration per DP rank,
                                    ``global_batch_size / (micro_batch_size * DP)``
``schedule``                        resolved schedule name (``1f1b`` when no zero-bubble flag);
                                    the ``--schedule`` flag itself is ``schedule_requested``
``schedule_selected_by``            the flag that chose the schedule (for error messages)
``schedule_placement``              ``"plain"``, ``"interleaved"`` or ``"v"``
``split_backward``                  whether the schedule splits backward into B and W
``schedule_cost_aware``             whether the schedule is rebuilt from profiled costs
``num_model_chunks``                model chunks (pipeline stages) per pipeline rank
``virtual_pipeline_model_parallel_size``  ``num_model_chunks`` if > 1 else ``None`` (Megatron)
``num_pipeline_stages``             ``PP * num_model_chunks``
``num_layers_per_stage``            transformer layers per pipeline stage, stage order
``zero_bubble_max_pending_backward``  resolved limit [micro batches of activations per rank]
                                    or ``None`` (the schedule's own default)
``schedule_memory_limit``           the same limit in the schedule library's unit (one stage's
                                    activation ``M_B``; ``N * num_model_chunks``) or ``None``
``ffn_hidden_size``                 default ``4 * hidden_size``
``max_position_embeddings``         default ``seq_length``
``kv_channels``                     ``hidden_size / num_attention_heads``
``params_dtype``                    ``torch.float16`` / ``torch.bfloat16`` / ``torch.float32``
``lr_decay_iters``                  default ``train_iters`` [iterations]
``distributed_backend``             ``"nccl"`` or ``"gloo"`` (``auto`` resolved)
``post_validation_warmup_iters``    with ``--enable-optimizer-post-validation``: the flag's value,
                                    default 10 [iterations]; ``None`` without post-validation
``post_validation_fallback_clean_iters``  the same for ``--post-validation-fallback-clean-iters``
``data_blend``                      ``(prefixes, weights or None)`` or ``None`` with mock data
``vocab_size``                      ``--vocab-size``, else the tokenizer's [tokens]
``tokenizer_vocab_size``            the tokenizer's vocabulary (NullTokenizer: ``--vocab-size`` + 1, EOD)
``padded_vocab_size``               embedding rows: the larger of the two above, rounded up to
                                    ``make_vocab_size_divisible_by * TP`` (what the model uses)
==================================  ===========================================================
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Callable, Sequence

import torch

from megatron_zb.model.gpt_chunks import split_layers
from megatron_zb.schedules.ir import Schedule, ScheduleError
from megatron_zb.schedules.registry import ScheduleSpec, build_schedule, get_spec, schedule_names

__all__ = [
    "ArgumentError",
    "POST_VALIDATION_FALLBACK_CLEAN_ITERS",
    "POST_VALIDATION_WARMUP_ITERS",
    "V_MEM_SETUP_TO_SCHEDULE",
    "build_parser",
    "initial_schedule",
    "parse_args",
    "parse_data_blend",
    "split_layers",
    "validate_args",
]

V_MEM_SETUP_TO_SCHEDULE: dict[str, str] = {"zb": "zbv", "half": "v-half", "min": "v-min"}
"""``--zero-bubble-v-schedule-mem-setup`` value -> schedule library name."""

POST_VALIDATION_WARMUP_ITERS = 10
"""Default of ``--post-validation-warmup-iters`` [iterations]."""

POST_VALIDATION_FALLBACK_CLEAN_ITERS = 10
"""Default of ``--post-validation-fallback-clean-iters`` [iterations] (the zero-bubble paper's heuristic)."""

_POST_VALIDATION_TUNING = (("post_validation_warmup_iters", POST_VALIDATION_WARMUP_ITERS),
                           ("post_validation_fallback_clean_iters", POST_VALIDATION_FALLBACK_CLEAN_ITERS))

_SCHEDULE_CACHE: dict[tuple, Schedule] = {}
"""Schedules built by :func:`validate_args`, keyed by (name, PP, micro batches, memory limit, chunks)."""

TOKENIZER_TYPES: tuple[str, ...] = ("ByteLevel", "HuggingFaceTokenizer", "NullTokenizer")


class ArgumentError(ValueError):
    """A bad flag or flag combination; ``flag`` is the flag to change, the message says how."""

    def __init__(self, flag: str, message: str) -> None:
        self.flag = flag
        super().__init__(f"{flag}: {message}")


# ---------------------------------------------------------------------------- the parser
def build_parser(*, extra_args_provider: Callable[[argparse.ArgumentParser], object] | None = None
                 ) -> argparse.ArgumentParser:
    """The ``pretrain_gpt_zb.py`` parser; ``extra_args_provider(parser)`` may add more flags."""
    parser = argparse.ArgumentParser(
        prog="pretrain_gpt_zb.py",
        description="Megatron GPT pretraining with zero-bubble pipeline schedules. Accepts Megatron's "
                    "GPT flags; add --enable-zero-bubble (or --zero-bubble-v-schedule) to switch schedule.",
        allow_abbrev=False,
    )
    _add_network_args(parser)
    _add_training_args(parser)
    _add_learning_rate_args(parser)
    _add_mixed_precision_args(parser)
    _add_distributed_args(parser)
    _add_data_args(parser)
    _add_checkpointing_args(parser)
    _add_validation_and_logging_args(parser)
    _add_zero_bubble_args(parser)
    if extra_args_provider is not None:
        extra_args_provider(parser)
    return parser


def parse_args(argv: Sequence[str] | None = None, *,
               extra_args_provider: Callable[[argparse.ArgumentParser], object] | None = None
               ) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``). Call :func:`validate_args` on the result."""
    return build_parser(extra_args_provider=extra_args_provider).parse_args(argv)


def _add_network_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("network size")
    g.add_argument("--num-layers", type=int, default=None, help="Number of transformer layers (required).")
    g.add_argument("--hidden-size", type=int, default=None, help="Transformer hidden size (required).")
    g.add_argument("--num-attention-heads", type=int, default=None,
                   help="Number of attention heads (required; must divide --hidden-size).")
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="Hidden size of the MLP. Default: 4 * --hidden-size.")
    g.add_argument("--seq-length", type=int, default=None, help="Sequence length in tokens (required).")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="Size of the position embedding table. Default: --seq-length.")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="Vocabulary size. Default: the tokenizer's. Required with --tokenizer-type "
                        "NullTokenizer (token ids 0..N-1; the EOD token N is added).")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="Pad the embedding table to a multiple of this value times the tensor-parallel "
                        "size (default 128).")
    g.add_argument("--hidden-dropout", type=float, default=0.1, help="Dropout after attention and MLP (default 0.1).")
    g.add_argument("--attention-dropout", type=float, default=0.1,
                   help="Dropout on the attention probabilities (default 0.1).")


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None,
                   help="Samples per micro batch per data-parallel rank (required).")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="Samples per iteration over all data-parallel ranks; must be a multiple of "
                        "--micro-batch-size times the data-parallel size. Default: micro batch x DP "
                        "(one micro batch per iteration).")
    g.add_argument("--train-iters", type=int, default=None, help="Number of training iterations (required).")
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam", help="Optimizer (default adam).")
    g.add_argument("--weight-decay", type=float, default=0.01, help="L2 weight decay coefficient (default 0.01).")
    g.add_argument("--clip-grad", type=float, default=1.0,
                   help="Clip the global gradient norm to this value; 0 disables (default 1.0).")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1 (default 0.9).")
    g.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2 (default 0.999).")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon (default 1e-8).")
    g.add_argument("--seed", type=int, default=1234,
                   help="Random seed for initialisation, dropout and data shuffling (default 1234).")


def _add_learning_rate_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("learning rate")
    g.add_argument("--lr", type=float, default=None, help="Peak learning rate (required).")
    g.add_argument("--min-lr", type=float, default=0.0, help="Learning rate floor after decay (default 0).")
    g.add_argument("--lr-warmup-iters", type=int, default=0,
                   help="Iterations of linear warm-up from 0 to --lr (default 0).")
    g.add_argument("--lr-decay-iters", type=int, default=None,
                   help="Iterations over which the learning rate decays to --min-lr. Default: --train-iters.")
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="linear",
                   help="Learning rate decay function (default linear).")


def _add_mixed_precision_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("mixed precision")
    g.add_argument("--fp16", action="store_true", help="Train in fp16 mixed precision (loss scaling).")
    g.add_argument("--bf16", action="store_true", help="Train in bf16 mixed precision.")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="Static loss scale (fp16). Default: dynamic loss scaling.")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32,
                   help="Initial dynamic loss scale (fp16; default 2^32).")


def _add_distributed_args(parser: argparse.ArgumentParser) -> None:
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


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data and tokenizer")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="Dataset prefix(es) written by tools/preprocess_data.py (PREFIX.bin and PREFIX.idx). "
                        "One prefix, several prefixes (weighted by size), or a blend 'W1 PREFIX1 W2 PREFIX2 ...'.")
    g.add_argument("--mock-data", action="store_true",
                   help="Train on megatron-core's synthetic MockGPTDataset instead of --data-path.")
    g.add_argument("--split", type=str, default="969,30,1",
                   help="Train,valid,test proportions of each --data-path dataset, e.g. 949,50,1 "
                        "(default 969,30,1).")
    g.add_argument("--data-cache-path", type=str, default=None,
                   help="Directory for dataset index caches. Default: SAVE/data_cache with --save, else a "
                        "directory under the system temp dir (single node only: multi-node jobs need a path "
                        "every node can see).")
    g.add_argument("--num-workers", type=int, default=2, help="DataLoader worker processes per rank (default 2).")
    g.add_argument("--reset-position-ids", action="store_true", help="Restart position ids after each EOD token.")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="Do not attend across EOD tokens (per-document attention mask).")
    g.add_argument("--eod-mask-loss", action="store_true", help="Do not compute the loss on EOD tokens.")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default="ByteLevel",
                   help="ByteLevel (default): UTF-8 bytes 0-255 plus EOD and PAD, nothing to download. "
                        "HuggingFaceTokenizer: a tokenizer saved on local disk (--tokenizer-model DIR; needs "
                        "transformers; never downloads). NullTokenizer: whitespace-separated integer ids "
                        "(needs --vocab-size).")
    g.add_argument("--tokenizer-model", type=str, default=None,
                   help="Local directory of a HuggingFace tokenizer (for --tokenizer-type HuggingFaceTokenizer).")


def _add_checkpointing_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", type=str, default=None, help="Directory to save checkpoints to.")
    g.add_argument("--load", type=str, default=None, help="Directory to load a checkpoint from.")
    g.add_argument("--save-interval", type=int, default=None, help="Iterations between checkpoint saves.")


def _add_validation_and_logging_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("validation")
    g.add_argument("--eval-interval", type=int, default=1000,
                   help="Iterations between evaluations on the validation set (default 1000).")
    g.add_argument("--eval-iters", type=int, default=100,
                   help="Iterations (global batches) per evaluation; 0 disables evaluation (default 100).")
    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100, help="Iterations between log lines (default 100).")
    g.add_argument("--tensorboard-dir", type=str, default=None,
                   help="Write TensorBoard scalars here (needs the tensorboard package).")


def _add_zero_bubble_args(parser: argparse.ArgumentParser) -> None:
    names = schedule_names()
    g = parser.add_argument_group("zero bubble")
    g.add_argument("--enable-zero-bubble", action="store_true",
                   help="Use the greedy zero-bubble schedule (schedule 'zb'): backward split into B and W, "
                        "W filling pipeline bubbles, under --zero-bubble-max-pending-backward.")
    g.add_argument("--zero-bubble-v-schedule", action="store_true",
                   help="Use a V-shaped zero-bubble schedule (two model chunks per rank; needs "
                        "--pipeline-model-parallel-size > 1); memory setup from --zero-bubble-v-schedule-mem-setup.")
    g.add_argument("--zero-bubble-v-schedule-mem-setup", choices=tuple(V_MEM_SETUP_TO_SCHEDULE), default=None,
                   help="V schedule memory setup: zb (ZB-V, 1F1B's activation memory, default), half "
                        "(V-Half, about 1/2 of it), min (V-Min, about 1/3 of it).")
    g.add_argument("--zero-bubble-max-pending-backward", type=int, default=None,
                   help="Activation-memory limit of zero-bubble schedules, in micro batches of activations held "
                        "per pipeline rank. PP gives ZB-1p (1F1B's peak), 2*PP gives ZB-2p. Default: PP for "
                        "--enable-zero-bubble, the schedule's own default otherwise.")
    g.add_argument("--zero-bubble-pipeline-timers-start-iter", type=int, default=2,
                   help="First iteration (1-based) in which F/B/W/communication times are profiled (default 2).")
    g.add_argument("--zero-bubble-pipeline-timers-end-iter", type=int, default=4,
                   help="Profiling stops before this iteration; cost-aware schedules are then rebuilt from "
                        "the measured costs (default 4).")
    g.add_argument("--enable-optimizer-post-validation", action="store_true",
                   help="Step the optimizer before the global gradient checks (NaN/inf, grad-norm clipping) "
                        "finish and roll back when they fail, removing the synchronisation bubble "
                        "(zero-bubble schedules only). Tuned by --post-validation-warmup-iters and "
                        "--post-validation-fallback-clean-iters.")
    g.add_argument("--enable-exactly-numeric-match", action="store_true",
                   help="With post-validation, reproduce the numerics of the synchronous optimizer step "
                        "exactly (slower).")
    g.add_argument("--post-validation-warmup-iters", type=int, default=None, metavar="N",
                   help="With --enable-optimizer-post-validation: the first N iterations (optimizer steps) of "
                        "the run use megatron-core's synchronous optimizer step; post-validation starts at "
                        "iteration N+1. Counted from the start of each run, also after --load. 0 "
                        "post-validates from the first step. Iterations, >= 0 "
                        f"(default {POST_VALIDATION_WARMUP_ITERS}).")
    g.add_argument("--post-validation-fallback-clean-iters", type=int, default=None, metavar="N",
                   help="With --enable-optimizer-post-validation: after a step whose gradients were clipped or "
                        "held an inf/nan, fall back to megatron-core's synchronous optimizer step until N "
                        "consecutive steps were neither clipped nor inf/nan, then post-validate again. 0 never "
                        "falls back: every step after the warm-up is post-validated (clipped ones are redone). "
                        "Iterations, >= 0 "
                        f"(default {POST_VALIDATION_FALLBACK_CLEAN_ITERS}).")
    g.add_argument("--allow-padding-num-layers", action="store_true",
                   help="Allow --num-layers not divisible by the number of pipeline stages: the first and "
                        "last stage take fewer layers.")
    g.add_argument("--schedule", dest="schedule_requested", choices=names, default=None, metavar="NAME",
                   help=f"Use any schedule of the library directly: {', '.join(names)}. Not together with "
                        "--zero-bubble-v-schedule.")
    g.add_argument("--pipeline-timeout-seconds", type=float, default=300.0,
                   help="Timeout of pipeline point-to-point transfers, seconds (default 300).")


# ---------------------------------------------------------------------------- validation
def validate_args(args: argparse.Namespace, *, world_size: int) -> argparse.Namespace:
    """Check ``args`` for a job of ``world_size`` processes and fill in derived values.

    Call before any process group starts (it does no communication). Checks run in a fixed
    order and the first failure raises :class:`ArgumentError`; ``args`` is updated in place
    (see the module docstring for the derived attributes) and returned.
    """
    if world_size < 1:
        raise ArgumentError("world_size", f"must be >= 1, got {world_size}")
    args.world_size = world_size
    _check_required_and_positive(args)
    _check_model_and_parallel(args, world_size)
    spec = _resolve_schedule(args)
    _check_layers(args)
    _check_schedule_builds(args, spec)
    _check_zero_bubble_options(args, spec)
    _check_data(args)
    _resolve_tokenizer_vocab(args)
    _fill_derived(args)
    return args


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _check_required_and_positive(args: argparse.Namespace) -> None:
    for dest in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                 "train_iters", "lr"):
        if getattr(args, dest) is None:
            raise ArgumentError(_flag(dest), f"is required; add {_flag(dest)} VALUE to the command line")
    for dest in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                 "train_iters", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "global_batch_size", "ffn_hidden_size", "max_position_embeddings", "vocab_size",
                 "make_vocab_size_divisible_by", "num_virtual_stages_per_pipeline_rank", "log_interval",
                 "eval_interval", "save_interval", "distributed_timeout_minutes"):
        value = getattr(args, dest, None)
        if value is not None and value < 1:
            raise ArgumentError(_flag(dest), f"must be a positive integer, got {value}")
    for dest in ("eval_iters", "lr_warmup_iters", "num_workers"):
        if getattr(args, dest) < 0:
            raise ArgumentError(_flag(dest), f"must be >= 0, got {getattr(args, dest)}")
    for dest in ("hidden_dropout", "attention_dropout"):
        if not 0.0 <= getattr(args, dest) < 1.0:
            raise ArgumentError(_flag(dest), f"must be in [0, 1), got {getattr(args, dest)}")
    if args.min_lr > args.lr:
        raise ArgumentError("--min-lr", f"{args.min_lr} exceeds --lr {args.lr}; set --min-lr <= --lr")
    if args.pipeline_timeout_seconds <= 0:
        raise ArgumentError("--pipeline-timeout-seconds", f"must be > 0, got {args.pipeline_timeout_seconds}")


def _check_model_and_parallel(args: argparse.Namespace, world_size: int) -> None:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if world_size % (tp * pp):
        raise ArgumentError(
            "--tensor-model-parallel-size",
            f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp} = {tp * pp}; launch a multiple of {tp * pp} processes "
            f"or change the parallel sizes")
    args.data_parallel_size = world_size // (tp * pp)
    if args.hidden_size % args.num_attention_heads:
        raise ArgumentError("--num-attention-heads",
                            f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
                            f"{args.num_attention_heads}; pick a head count that divides the hidden size")
    if args.num_attention_heads % tp:
        raise ArgumentError("--tensor-model-parallel-size",
                            f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                            f"--tensor-model-parallel-size {tp}; pick a TP size that divides the head count")
    if args.sequence_parallel and tp == 1:
        raise ArgumentError("--sequence-parallel", "needs --tensor-model-parallel-size > 1; drop --sequence-parallel "
                                                   "or raise the tensor-parallel size")
    if args.fp16 and args.bf16:
        raise ArgumentError("--bf16", "--fp16 and --bf16 are mutually exclusive; keep one of them")
    mp = args.max_position_embeddings if args.max_position_embeddings is not None else args.seq_length
    if mp < args.seq_length:
        raise ArgumentError("--max-position-embeddings",
                            f"{mp} is smaller than --seq-length {args.seq_length}; raise it or omit it")
    mbs, dp = args.micro_batch_size, args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = mbs * dp
    if args.global_batch_size % (mbs * dp):
        raise ArgumentError("--global-batch-size",
                            f"{args.global_batch_size} is not divisible by --micro-batch-size {mbs} x data-parallel "
                            f"size {dp} = {mbs * dp}; use a multiple of {mbs * dp}")
    args.num_microbatches = args.global_batch_size // (mbs * dp)


def _resolve_schedule(args: argparse.Namespace) -> ScheduleSpec:
    """Set ``args.schedule`` (and the placement-derived sizes); return the schedule's spec."""
    pp = args.pipeline_model_parallel_size
    if args.zero_bubble_v_schedule_mem_setup is not None and not args.zero_bubble_v_schedule:
        raise ArgumentError("--zero-bubble-v-schedule-mem-setup",
                            "only applies to V schedules; add --zero-bubble-v-schedule or drop this flag")
    if args.zero_bubble_v_schedule:
        for dest, flag in (("enable_zero_bubble", "--enable-zero-bubble"), ("schedule_requested", "--schedule")):
            if getattr(args, dest):
                raise ArgumentError("--zero-bubble-v-schedule",
                                    f"cannot be combined with {flag}; keep --zero-bubble-v-schedule (with "
                                    f"--zero-bubble-v-schedule-mem-setup) or {flag}, not both")
        setup = args.zero_bubble_v_schedule_mem_setup or "zb"
        name, selected_by = V_MEM_SETUP_TO_SCHEDULE[setup], "--zero-bubble-v-schedule"
    elif args.schedule_requested is not None:
        name, selected_by = args.schedule_requested, "--schedule"
    elif args.enable_zero_bubble:
        name, selected_by = "zb", "--enable-zero-bubble"
    else:
        name, selected_by = "1f1b", "--schedule"
    try:
        spec = get_spec(name)
    except ScheduleError as e:
        raise ArgumentError(selected_by, f"schedule {name!r} is not available in this installation ({e}); "
                                         f"choose another schedule") from None
    if args.enable_zero_bubble and not spec.split_backward:
        raise ArgumentError("--schedule", f"{name!r} is not a zero-bubble schedule (it does not split the backward); "
                                          f"drop --enable-zero-bubble or choose a zero-bubble schedule")
    if spec.placement == "v" and pp == 1:
        raise ArgumentError(selected_by, f"the V schedule {name!r} needs --pipeline-model-parallel-size > 1 "
                                         f"(it places two model chunks per pipeline rank); raise PP or use "
                                         f"--enable-zero-bubble")
    chunks_flag = args.num_virtual_stages_per_pipeline_rank
    if spec.placement == "interleaved":
        chunks = chunks_flag if chunks_flag is not None else 2
        if chunks < 2:
            raise ArgumentError("--num-virtual-stages-per-pipeline-rank",
                                f"interleaved schedule {name!r} needs >= 2 chunks per rank, got {chunks}")
    else:
        chunks = spec.chunks_per_rank(2)
        if chunks_flag is not None and chunks_flag != chunks:
            raise ArgumentError("--num-virtual-stages-per-pipeline-rank",
                                f"schedule {name!r} uses {chunks} model chunk(s) per rank ({spec.placement} "
                                f"placement); drop the flag or choose an interleaved schedule")
    args.schedule = name
    args.schedule_selected_by = selected_by
    args.schedule_placement = spec.placement
    args.split_backward = spec.split_backward
    args.schedule_cost_aware = spec.cost_aware
    args.num_model_chunks = chunks
    args.virtual_pipeline_model_parallel_size = chunks if chunks > 1 else None
    args.num_pipeline_stages = pp * chunks
    return spec


def _check_layers(args: argparse.Namespace) -> None:
    stages = args.num_pipeline_stages
    try:
        args.num_layers_per_stage = split_layers(args.num_layers, stages, allow_padding=args.allow_padding_num_layers)
    except ValueError as e:
        what = (f"{stages} pipeline stages (PP {args.pipeline_model_parallel_size} x "
                f"{args.num_model_chunks} chunk(s) per rank for schedule {args.schedule!r})")
        if args.num_layers % stages and not args.allow_padding_num_layers:
            raise ArgumentError("--num-layers",
                                f"{args.num_layers} layers cannot be split evenly over {what}; use a multiple of "
                                f"{stages} or add --allow-padding-num-layers (first/last stage take fewer layers)"
                                ) from None
        raise ArgumentError("--num-layers", f"{args.num_layers} layers cannot be split over {what} even with "
                                            f"--allow-padding-num-layers ({e}); use more layers or fewer stages"
                            ) from None


def _check_schedule_builds(args: argparse.Namespace, spec: ScheduleSpec) -> None:
    """Resolve the memory limit and ask the schedule library whether the schedule exists."""
    pp, m, chunks = args.pipeline_model_parallel_size, args.num_microbatches, args.num_model_chunks
    n = args.zero_bubble_max_pending_backward
    explicit = n is not None
    if explicit and not spec.cost_aware:
        raise ArgumentError("--zero-bubble-max-pending-backward",
                            f"has no effect on schedule {args.schedule!r} (not memory-aware); drop it or use "
                            f"--enable-zero-bubble / --zero-bubble-v-schedule")
    if n is None and args.schedule == "zb":
        n = pp  # ZB-1p: 1F1B's peak activation memory
    args.zero_bubble_max_pending_backward = n
    args.schedule_memory_limit = float(n * chunks) if n is not None else None

    def build(limit: float | None) -> Schedule:
        return build_schedule(args.schedule, num_ranks=pp, num_microbatches=m, memory_limit=limit, num_chunks=chunks)

    try:
        _SCHEDULE_CACHE[_schedule_key(args)] = build(args.schedule_memory_limit)
    except ScheduleError as e:
        if explicit:
            try:
                build(None)
            except ScheduleError:
                pass
            else:
                raise ArgumentError(
                    "--zero-bubble-max-pending-backward",
                    f"{n} micro batches is below what schedule {args.schedule!r} needs for PP={pp}, "
                    f"{m} micro batches ({e}); raise --zero-bubble-max-pending-backward") from None
        raise ArgumentError(args.schedule_selected_by,
                            f"schedule {args.schedule!r} cannot be built for PP={pp}, {m} micro batches per "
                            f"iteration ({e}); change the schedule or the batch sizes") from None


def _schedule_key(args: argparse.Namespace) -> tuple:
    return (args.schedule, args.pipeline_model_parallel_size, args.num_microbatches, args.schedule_memory_limit,
            args.num_model_chunks)


def initial_schedule(args: argparse.Namespace) -> Schedule:
    """The schedule :func:`validate_args` built (unit costs; the runtime may rebuild it from profiled costs).

    Cached per process, so calling this after :func:`validate_args` costs nothing.
    """
    key = _schedule_key(args)
    if key not in _SCHEDULE_CACHE:
        _SCHEDULE_CACHE[key] = build_schedule(args.schedule, num_ranks=key[1], num_microbatches=key[2],
                                              memory_limit=key[3], num_chunks=key[4])
    return _SCHEDULE_CACHE[key]


def _check_zero_bubble_options(args: argparse.Namespace, spec: ScheduleSpec) -> None:
    if args.enable_optimizer_post_validation and not spec.split_backward:
        raise ArgumentError("--enable-optimizer-post-validation",
                            f"needs a zero-bubble schedule, but the schedule is {args.schedule!r}; add "
                            f"--enable-zero-bubble (or --zero-bubble-v-schedule) or drop the flag")
    if args.enable_exactly_numeric_match and not args.enable_optimizer_post_validation:
        raise ArgumentError("--enable-exactly-numeric-match",
                            "only applies with --enable-optimizer-post-validation; add that flag or drop this one")
    _check_post_validation_tuning(args)
    start, end = args.zero_bubble_pipeline_timers_start_iter, args.zero_bubble_pipeline_timers_end_iter
    if start < 1:
        raise ArgumentError("--zero-bubble-pipeline-timers-start-iter", f"must be >= 1, got {start}")
    if end <= start:
        raise ArgumentError("--zero-bubble-pipeline-timers-end-iter",
                            f"{end} must be greater than --zero-bubble-pipeline-timers-start-iter {start}")


def _check_post_validation_tuning(args: argparse.Namespace) -> None:
    """``--post-validation-warmup-iters`` / ``--post-validation-fallback-clean-iters``: >= 0, only
    with ``--enable-optimizer-post-validation``; then default to 10 each. Without post-validation
    they stay ``None`` (so that validating again still sees them as not given)."""
    for dest, _ in _POST_VALIDATION_TUNING:
        value = getattr(args, dest)
        if value is not None and value < 0:
            raise ArgumentError(_flag(dest), f"must be >= 0 iterations, got {value}")
    given = [_flag(dest) for dest, _ in _POST_VALIDATION_TUNING if getattr(args, dest) is not None]
    if given and not args.enable_optimizer_post_validation:
        raise ArgumentError(given[0], "only applies with --enable-optimizer-post-validation (it tunes when that "
                                      "optimizer steps synchronously); add --enable-optimizer-post-validation or "
                                      f"drop {' and '.join(given)}")
    if args.enable_optimizer_post_validation:
        for dest, default in _POST_VALIDATION_TUNING:
            if getattr(args, dest) is None:
                setattr(args, dest, default)


def parse_data_blend(values: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """``--data-path`` values -> ``(prefixes, weights)``; weights ``None`` means "by dataset size".

    Accepts ``PREFIX [PREFIX ...]`` or ``W1 PREFIX1 W2 PREFIX2 ...`` (weights > 0, any scale).
    """
    values = [v.strip() for v in values if v.strip()]
    if not values:
        raise ArgumentError("--data-path", "needs at least one dataset prefix")

    def number(s: str) -> float | None:
        try:
            return float(s)
        except ValueError:
            return None

    weights = [number(v) for v in values[0::2]]
    if len(values) % 2 == 0 and all(w is not None for w in weights):
        prefixes = values[1::2]
        if any(number(p) is not None for p in prefixes):
            raise ArgumentError("--data-path", f"blend {values} has a number where a prefix belongs; "
                                               f"write it as 'W1 PREFIX1 W2 PREFIX2 ...'")
        bad = [w for w in weights if not (w > 0 and math.isfinite(w))]
        if bad:
            raise ArgumentError("--data-path", f"blend weights must be positive, got {bad[0]}")
        return prefixes, [float(w) for w in weights]
    if any(number(v) is not None for v in values):
        raise ArgumentError("--data-path", f"{values} mixes weights and prefixes; give either PREFIX [PREFIX ...] "
                                           f"or 'W1 PREFIX1 W2 PREFIX2 ...' (a weight before every prefix)")
    return values, None


def _check_split(split: str) -> None:
    parts = [p.strip() for p in split.replace("/", ",").split(",")]
    try:
        vals = [float(p) for p in parts]
    except ValueError:
        raise ArgumentError("--split", f"{split!r} is not a list of numbers; write e.g. 949,50,1") from None
    if not 1 <= len(vals) <= 3 or any(v < 0 or not math.isfinite(v) for v in vals) or sum(vals) <= 0:
        raise ArgumentError("--split", f"{split!r} must be 1 to 3 non-negative weights (train,valid,test) with a "
                                       f"positive sum, e.g. 949,50,1")
    if vals[0] <= 0:
        raise ArgumentError("--split", f"{split!r} gives the training set no data; make the first weight positive")


def _check_data(args: argparse.Namespace) -> None:
    if args.mock_data and args.data_path:
        raise ArgumentError("--mock-data", "--mock-data and --data-path are mutually exclusive; keep one")
    if not args.mock_data and not args.data_path:
        raise ArgumentError("--data-path", "no training data: give --data-path PREFIX (files PREFIX.bin and PREFIX.idx "
                                           "from tools/preprocess_data.py) or --mock-data")
    _check_split(args.split)
    if args.mock_data:
        args.data_blend = None
        return
    prefixes, weights = parse_data_blend(args.data_path)
    for prefix in prefixes:
        missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
        if missing:
            raise ArgumentError("--data-path", f"dataset prefix {prefix!r}: missing {' and '.join(missing)}; pass the "
                                               f"prefix without extension, as written by tools/preprocess_data.py "
                                               f"--output-prefix")
    args.data_blend = (prefixes, weights)


def _resolve_tokenizer_vocab(args: argparse.Namespace) -> None:
    from megatron_zb.training import data  # lazy: data imports megatron-core's dataset stack

    if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        raise ArgumentError("--vocab-size", "is required with --tokenizer-type NullTokenizer")
    if args.tokenizer_type == "HuggingFaceTokenizer" and not args.tokenizer_model:
        raise ArgumentError("--tokenizer-model", "is required with --tokenizer-type HuggingFaceTokenizer: pass the "
                                                 "local directory holding the tokenizer files")
    try:
        tok = data.build_tokenizer(args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                                   vocab_size=args.vocab_size)
    except data.TokenizerError as e:
        flag = "--tokenizer-model" if args.tokenizer_type == "HuggingFaceTokenizer" else "--tokenizer-type"
        raise ArgumentError(flag, str(e)) from None
    args.tokenizer_vocab_size = tok.vocab_size
    if args.tokenizer_type == "NullTokenizer":
        vocab = tok.vocab_size  # --vocab-size ids plus the EOD id; args.vocab_size keeps the flag's value
    elif args.vocab_size is None:
        vocab = args.vocab_size = tok.vocab_size
    elif args.vocab_size < tok.vocab_size:
        raise ArgumentError("--vocab-size", f"{args.vocab_size} is smaller than the {args.tokenizer_type} tokenizer's "
                                            f"{tok.vocab_size} tokens; raise it or omit it")
    else:
        vocab = args.vocab_size
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    args.padded_vocab_size = -(-vocab // multiple) * multiple


def _fill_derived(args: argparse.Namespace) -> None:
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    args.kv_channels = args.hidden_size // args.num_attention_heads
    args.params_dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.distributed_backend == "auto":
        args.distributed_backend = "nccl" if torch.cuda.is_available() else "gloo"
    elif args.distributed_backend == "nccl" and not torch.cuda.is_available():
        raise ArgumentError("--distributed-backend", "nccl needs CUDA, which is not available here; use gloo or auto")

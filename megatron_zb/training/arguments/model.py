"""Model flags (Megatron's "network size" group): the GPT's shape, its checks and derived sizes."""

from __future__ import annotations

import argparse

from .common import ArgumentError

__all__ = ["add_network_args", "check_attention_heads", "check_position_embeddings", "fill_model_sizes"]


def add_network_args(parser: argparse.ArgumentParser) -> None:
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


def check_attention_heads(args: argparse.Namespace) -> None:
    """The heads divide the hidden size, and the tensor-parallel size divides the heads."""
    tp = args.tensor_model_parallel_size
    if args.hidden_size % args.num_attention_heads:
        raise ArgumentError("--num-attention-heads",
                            f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
                            f"{args.num_attention_heads}; pick a head count that divides the hidden size")
    if args.num_attention_heads % tp:
        raise ArgumentError("--tensor-model-parallel-size",
                            f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                            f"--tensor-model-parallel-size {tp}; pick a TP size that divides the head count")


def check_position_embeddings(args: argparse.Namespace) -> None:
    mp = args.max_position_embeddings if args.max_position_embeddings is not None else args.seq_length
    if mp < args.seq_length:
        raise ArgumentError("--max-position-embeddings",
                            f"{mp} is smaller than --seq-length {args.seq_length}; raise it or omit it")


def fill_model_sizes(args: argparse.Namespace) -> None:
    """``ffn_hidden_size``, ``max_position_embeddings`` (defaults) and ``kv_channels`` (derived)."""
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    args.kv_channels = args.hidden_size // args.num_attention_heads

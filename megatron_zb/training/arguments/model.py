"""Model flags (Megatron's "network size" group): the GPT's shape, its checks and derived sizes."""

from __future__ import annotations

import argparse
import importlib.util

from megatron_zb.planning.model import default_ffn_hidden_size

from .common import ArgumentError, notice

__all__ = ["add_network_args", "check_architecture", "check_zero_centered_gamma", "check_attention_heads", "check_model_kind",
           "check_position_embeddings", "fill_model_sizes"]


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
    _add_architecture_args(g)


def _add_architecture_args(g: argparse._ArgumentGroup) -> None:
    """Megatron-LM's architecture flags (names, defaults and meanings as in its ``arguments.py``)."""
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm",
                   help="Which normalization technique to use (default LayerNorm).")
    g.add_argument("--norm-epsilon", type=float, default=1e-5, help="Epsilon of the normalization (default 1e-5).")
    g.add_argument("--swiglu", action="store_true",
                   help="Use gated linear units and SiLU activation instead of the default GeLU; "
                        "--ffn-hidden-size then defaults to int(4 * hidden * 2 / 3 / 64) * 64.")
    g.add_argument("--position-embedding-type", choices=("learned_absolute", "rope", "none"),
                   default="learned_absolute", help="Position embedding type (default learned_absolute).")
    g.add_argument("--no-position-embedding", action="store_false", dest="add_position_embedding",
                   help="Megatron-LM's deprecated flag: accepted with --position-embedding-type rope (no learned "
                        "position table there), an error otherwise (as Megatron-LM); use --position-embedding-type.")
    g.add_argument("--rotary-base", type=int, default=10000, help="Base of the rotary embeddings (default 10000).")
    g.add_argument("--rotary-interleaved", action="store_true",
                   help="Rotate interleaved pairs of a head's channels instead of its two halves (rope).")
    g.add_argument("--rotary-percent", type=float, default=1.0,
                   help="Fraction of each head's channels that rotary embeddings rotate, in (0, 1] (default 1.0).")
    g.add_argument("--group-query-attention", action="store_true", help="Use grouped-query attention.")
    g.add_argument("--num-query-groups", type=int, default=1,
                   help="Number of key/value groups with --group-query-attention (default 1); must divide "
                        "--num-attention-heads.")
    g.add_argument("--kv-channels", type=int, default=None,
                   help="Projection dimension of each attention head. Default: hidden size / heads.")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear",
                   help="Disable the bias of the linear layers.")
    g.add_argument("--qk-layernorm", action="store_true", help="Normalize queries and keys (the --normalization type).")
    g.add_argument("--apply-layernorm-1p", action="store_true", dest="layernorm_zero_centered_gamma",
                   help="LayerNorm weights centred on 0 (the norm multiplies by 1 + weight): better numerical "
                        "stability. Needs apex or Transformer Engine.")
    g.add_argument("--init-method-std", type=float, default=0.02,
                   help="Standard deviation of the zero-mean normal weight initialisation (default 0.02).")
    g.add_argument("--use-cpu-initialization", action="store_true",
                   help="Initialise the weights on the CPU (megatron-core's use_cpu_initialization). Always on in "
                        "megatron-zb: the same weights for every placement of the layers; the flag changes nothing.")
    g.add_argument("--attention-softmax-in-fp32", action="store_true",
                   help="Compute the attention softmax in fp32 (with fp16/bf16).")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="Give the output layer its own weight instead of sharing the word embedding's.")
    g.add_argument("--use-mcore-models", action="store_true", dest="deprecated_use_mcore_models",
                   help="Megatron-LM's deprecated flag, ignored as there: megatron-core models are the default "
                        "(and the only ones here).")
    g.add_argument("--use-legacy-models", action="store_true",
                   help="Megatron-LM's legacy GPT: megatron-core has none, so megatron-core's GPTModel (the same "
                        "architecture) is built, with megatron-core's checkpoints; logged at start-up.")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="Normalise the loss by the number of non-padded tokens of the global batch instead of "
                        "averaging per micro batch (megatron-core's per-token loss).")


def check_model_kind(args: argparse.Namespace) -> None:
    """``--use-legacy-models``: say what is built instead (``--use-mcore-models`` is a no-op, as in Megatron-LM);
    ``--no-position-embedding`` only with RoPE (Megatron-LM's rule, its arguments.py 999-1000)."""
    if not args.add_position_embedding and args.position_embedding_type != "rope":
        raise ArgumentError("--no-position-embedding", "is deprecated and, as in Megatron-LM, accepted only with "
                                                       "--position-embedding-type rope; use --position-embedding-type "
                                                       "none (or rope) instead")
    if args.use_legacy_models:
        notice(args, "WARNING: --use-legacy-models: megatron-core has no legacy models; megatron-core's GPTModel (the "
                     "same architecture as Megatron-LM's legacy GPT) is built, and checkpoints are megatron-core's "
                     "(torch_dist), not the legacy format")


def check_attention_heads(args: argparse.Namespace) -> None:
    """The heads divide the hidden size, and the tensor-parallel size divides the heads."""
    tp = args.tensor_model_parallel_size
    if args.kv_channels is None and args.hidden_size % args.num_attention_heads:
        raise ArgumentError("--num-attention-heads",
                            f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
                            f"{args.num_attention_heads}; pick a head count that divides the hidden size or set --kv-channels")
    if args.num_attention_heads % tp:
        raise ArgumentError("--tensor-model-parallel-size",
                            f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                            f"--tensor-model-parallel-size {tp}; pick a TP size that divides the head count")


def check_position_embeddings(args: argparse.Namespace) -> None:
    mp = args.max_position_embeddings if args.max_position_embeddings is not None else args.seq_length
    if mp < args.seq_length:
        raise ArgumentError("--max-position-embeddings",
                            f"{mp} is smaller than --seq-length {args.seq_length}; raise it or omit it")


def check_zero_centered_gamma(args: argparse.Namespace) -> None:
    """``--apply-layernorm-1p`` only where the layer norm has a zero-centred gamma: Transformer Engine's,
    or apex's fused LayerNorm of megatron-core's local spec (torch's own norms have none)."""
    if not args.layernorm_zero_centered_gamma or args.transformer_impl == "transformer_engine":
        return
    if args.normalization != "LayerNorm":
        raise ArgumentError("--apply-layernorm-1p", f"megatron-core's local {args.normalization} has no zero-centred "
                                                    f"gamma; use --normalization LayerNorm with apex, or "
                                                    f"--transformer-impl transformer_engine")
    if importlib.util.find_spec("apex") is None:
        raise ArgumentError("--apply-layernorm-1p", "megatron-core's local layer spec normalises with torch's LayerNorm "
                                                    "here (apex is not installed), which has no zero-centred gamma; "
                                                    "install apex, or use --transformer-impl transformer_engine "
                                                    "(Transformer Engine and CUDA)")


def check_architecture(args: argparse.Namespace) -> None:
    """Grouped-query attention, rotary embeddings, the SwiGLU default width, positive sizes."""
    heads, tp = args.num_attention_heads, args.tensor_model_parallel_size
    if args.group_query_attention:
        groups = args.num_query_groups
        if groups < 1 or heads % groups:
            raise ArgumentError("--num-query-groups",
                                f"{groups} does not divide --num-attention-heads {heads}; pick a divisor of {heads}")
        if groups % tp:
            raise ArgumentError("--num-query-groups",
                                f"{groups} is not divisible by --tensor-model-parallel-size {tp}; use a multiple of "
                                f"the TP size")
    if args.position_embedding_type == "rope" and not 0.0 < args.rotary_percent <= 1.0:
        raise ArgumentError("--rotary-percent", f"must be in (0, 1] with --position-embedding-type rope, got "
                                                f"{args.rotary_percent}")
    for flag_, value in (("--kv-channels", args.kv_channels), ("--rotary-base", args.rotary_base)):
        if value is not None and value < 1:
            raise ArgumentError(flag_, f"must be a positive integer, got {value}")
    for flag_, value in (("--norm-epsilon", args.norm_epsilon), ("--init-method-std", args.init_method_std)):
        if not value > 0:
            raise ArgumentError(flag_, f"must be > 0, got {value}")
    if args.swiglu and args.ffn_hidden_size is None and default_ffn_hidden_size(args.hidden_size, swiglu=True) < 1:
        raise ArgumentError("--ffn-hidden-size", f"the SwiGLU default int(4 * {args.hidden_size} * 2 / 3 / 64) * 64 "
                                                 f"is 0 for this hidden size; set --ffn-hidden-size")


def fill_model_sizes(args: argparse.Namespace) -> None:
    """``ffn_hidden_size``, ``max_position_embeddings``, ``kv_channels`` (defaults, as Megatron-LM)."""
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = default_ffn_hidden_size(args.hidden_size, swiglu=args.swiglu)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.kv_channels is None:
        args.kv_channels = args.hidden_size // args.num_attention_heads

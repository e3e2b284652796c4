"""Data and tokenizer flags: datasets, blends, splits, the tokenizer; their checks and the
vocabulary sizes they imply."""

from __future__ import annotations

import argparse
import math
import os
from typing import Sequence

from megatron_zb.planning.model import padded_vocab_size
from megatron_zb.training.data_files import DataFileError, IndexFile, read_checked_index
from megatron_zb.training.data_splits import (SPLIT_NAMES, SplitShortage, split_num_samples, split_sequence_ranges,
                                              unbuildable_split)
from megatron_zb.training.tokenizers import (TOKENIZER_TYPES, TokenizerError, add_tokenizer_args,
                                             ignored_tokenizer_flags, tokenizer_from_args)

from .common import ArgumentError, notice

__all__ = ["TOKENIZER_TYPES", "add_data_args", "check_data", "check_data_files", "check_data_splits", "check_split", "parse_data_blend",
           "resolve_tokenizer_vocab"]


def add_data_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data and tokenizer")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="Dataset prefix(es) written by tools/preprocess_data.py (PREFIX.bin and PREFIX.idx). "
                        "One prefix, several prefixes (weighted by size), or a blend 'W1 PREFIX1 W2 PREFIX2 ...'.")
    g.add_argument("--train-data-path", nargs="*", default=None,
                   help="Training dataset prefix(es) or blend, used instead of --data-path and --split (as "
                        "Megatron); --valid-data-path and --test-data-path then give the other splits (optional).")
    g.add_argument("--valid-data-path", nargs="*", default=None,
                   help="Validation dataset prefix(es) or blend (with --train-data-path).")
    g.add_argument("--test-data-path", nargs="*", default=None,
                   help="Test dataset prefix(es) or blend (with --train-data-path).")
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
    g.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                   dest="create_attention_mask_in_dataloader",
                   help="If set, do not create attention_masks in dataloader: micro batches carry no attention "
                        "mask and megatron-core's causal attention builds its own (same result).")
    g.add_argument("--no-mmap-bin-files", action="store_false", dest="mmap_bin_files",
                   help="Disable mmap-ing of .bin files (read them with file reads instead).")
    add_tokenizer_args(g)


def parse_data_blend(values: Sequence[str], *, flag: str = "--data-path") -> tuple[list[str], list[float] | None]:
    """``--data-path`` values -> ``(prefixes, weights)``; weights ``None`` means "by dataset size".

    Accepts ``PREFIX [PREFIX ...]`` or ``W1 PREFIX1 W2 PREFIX2 ...`` (weights > 0, any scale);
    errors name ``flag`` (the per-split flags share the format).
    """
    values = [v.strip() for v in values if v.strip()]
    if not values:
        raise ArgumentError(flag, "needs at least one dataset prefix")

    def number(s: str) -> float | None:
        try:
            return float(s)
        except ValueError:
            return None

    weights = [number(v) for v in values[0::2]]
    if len(values) % 2 == 0 and all(w is not None for w in weights):
        prefixes = values[1::2]
        if any(number(p) is not None for p in prefixes):
            raise ArgumentError(flag, f"blend {values} has a number where a prefix belongs; "
                                               f"write it as 'W1 PREFIX1 W2 PREFIX2 ...'")
        bad = [w for w in weights if not (w > 0 and math.isfinite(w))]
        if bad:
            raise ArgumentError(flag, f"blend weights must be positive, got {bad[0]}")
        return prefixes, [float(w) for w in weights]
    if any(number(v) is not None for v in values):
        raise ArgumentError(flag, f"{values} mixes weights and prefixes; give either PREFIX [PREFIX ...] "
                                           f"or 'W1 PREFIX1 W2 PREFIX2 ...' (a weight before every prefix)")
    return values, None


def check_split(split: str) -> None:
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


PER_SPLIT_FLAGS: tuple[str, ...] = ("--train-data-path", "--valid-data-path", "--test-data-path")


def check_data(args: argparse.Namespace) -> None:
    """One data source: ``--mock-data``, ``--data-path`` (+ ``--split``) or the per-split paths (files
    present, as Megatron); sets ``data_blend`` and ``data_blend_per_split`` (``None`` when unused)."""
    per_split = [getattr(args, f[2:].replace("-", "_")) for f in PER_SPLIT_FLAGS]
    sources = [name for name, given in (("--mock-data", args.mock_data), ("--data-path", bool(args.data_path)),
                                        ("--train-data-path", any(v is not None for v in per_split))) if given]
    if len(sources) > 1:
        raise ArgumentError(sources[0], f"{' and '.join(sources)} are mutually exclusive (one data source, as "
                                        f"Megatron); keep one")
    if not sources:
        raise ArgumentError("--data-path", "no training data: give --data-path PREFIX (files PREFIX.bin and PREFIX.idx "
                                           "from tools/preprocess_data.py), --train-data-path PREFIX or --mock-data")
    check_split(args.split)
    if args.reset_attention_mask and not args.create_attention_mask_in_dataloader:
        raise ArgumentError("--no-create-attention-mask-in-dataloader", "with --reset-attention-mask: only the "
                            "dataloader builds the per-document attention mask, without it attention crosses "
                            "documents (Megatron-LM does that silently); drop one of the two")
    args.data_blend = args.data_blend_per_split = None
    if sources[0] == "--data-path":
        args.data_blend = _checked_blend(args.data_path, "--data-path")
    elif sources[0] == "--train-data-path":
        if not per_split[0]:
            raise ArgumentError("--train-data-path", "is required with --valid-data-path / --test-data-path")
        args.data_blend_per_split = [_checked_blend(v, f) if v else None for v, f in zip(per_split, PER_SPLIT_FLAGS)]


def _checked_blend(values: Sequence[str], flag: str) -> tuple[list[str], list[float] | None]:
    """:func:`parse_data_blend` whose every prefix has its ``.bin`` and ``.idx`` file."""
    prefixes, weights = parse_data_blend(values, flag=flag)
    for prefix in prefixes:
        missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
        if missing:
            raise ArgumentError(flag, f"dataset prefix {prefix!r}: missing {' and '.join(missing)}; pass the "
                                      f"prefix without extension, as written by tools/preprocess_data.py "
                                      f"--output-prefix")
    return prefixes, weights


def _blend_sources(args: argparse.Namespace) -> list[tuple[str, tuple[list[str], list[float] | None], int | None]]:
    """``(flag, blend, split index)`` of each data source :func:`check_data` set: ``--data-path`` (split index
    ``None``: ``--split`` divides it), else each per-split path given (its split's index)."""
    if args.data_blend is not None:
        return [("--data-path", args.data_blend, None)]
    return [(f, b, i) for i, (f, b) in enumerate(zip(PER_SPLIT_FLAGS, args.data_blend_per_split or ())) if b]


def check_data_files(args: argparse.Namespace) -> dict[str, IndexFile]:
    """Every dataset prefix's ``.idx`` read once and checked with its ``.bin``
    (:func:`~megatron_zb.training.data_files.read_checked_index`: header, sizes, document indices, the
    ``.bin``'s size -- never its contents); one problem per damaged prefix, naming the first flag that
    gives it. Returns the
    checked indices by prefix (mock data: none). Needs :func:`check_data`."""
    indices: dict[str, IndexFile] = {}
    errors: list[ArgumentError] = []
    seen: set[str] = set()
    for flag_name, (prefixes, _), _ in _blend_sources(args):
        for prefix in prefixes:
            if prefix in seen:
                continue
            seen.add(prefix)
            try:
                indices[prefix] = read_checked_index(prefix)
            except DataFileError as e:
                errors.append(ArgumentError(flag_name, str(e)))
    if errors:
        raise ArgumentError.combine(errors)
    return indices


def check_data_splits(args: argparse.Namespace, indices: dict[str, IndexFile]) -> None:
    """Refuse a split megatron-core cannot build from a prefix (the rule:
    :mod:`~megatron_zb.training.data_splits`): one that it builds -- a positive ``--split`` weight, or a
    per-split path -- whose sequences hold zero tokens (``GPTDataset`` loops forever, whatever the samples
    asked, 0 included), or, in a blend weighted by size, fewer than ``--seq-length + 1`` tokens
    (``BlendedDataset`` asserts). Too few tokens for the samples asked is fine (megatron-core runs more
    epochs). Needs :func:`check_data_files` and the filled training values."""
    samples = split_num_samples(train_iters=args.train_iters, train_samples=args.train_samples,
                                global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
                                data_parallel_size=args.data_parallel_size, eval_interval=args.eval_interval,
                                eval_iters=args.eval_iters, rampup_batch_size=args.rampup_batch_size)
    errors: list[ArgumentError] = []
    for flag_name, (prefixes, weights), only in _blend_sources(args):
        by_size = weights is None and len(prefixes) > 1
        for prefix in prefixes:
            index = indices[prefix]
            ranges = split_sequence_ranges(None if only is not None else args.split, index.num_sequences)
            for i, sequences in enumerate(ranges):
                if sequences is None or (only is not None and i != only):
                    continue
                short = unbuildable_split(index.sequence_lengths, sequences, by_size=by_size,
                                          seq_length=args.seq_length)
                if short is not None:
                    errors.append(_split_error(args, flag_name, prefix, i, short, samples[i]))
    if errors:
        raise ArgumentError.combine(errors)


def _split_error(args: argparse.Namespace, flag_name: str, prefix: str, split: int, short: SplitShortage,
                 samples: int) -> ArgumentError:
    """The one line for a split megatron-core cannot build (:func:`check_data_splits`)."""
    name = SPLIT_NAMES[split]
    why = f"it must serve {samples} {name} samples: {short.reason}"
    if flag_name != "--data-path":
        return ArgumentError(flag_name, f"{prefix} has {short.total_sequences} sequences ({short.tokens} tokens) and "
                                        f"{why}; pass a prefix with more data, or drop {flag_name}")
    return ArgumentError("--split", f"{args.split} gives the {name} split of --data-path {prefix} {short.sequences} "
                                    f"of its {short.total_sequences} sequences ({short.tokens} tokens), and {why}; "
                                    f"give the {name} split a larger share (e.g. --split 90,5,5), or weight 0 for no "
                                    f"{name} data (--eval-iters 0 does not help)")


def resolve_tokenizer_vocab(args: argparse.Namespace) -> None:
    """Build the tokenizer once to check it; sets ``vocab_size``, ``tokenizer_vocab_size``, ``padded_vocab_size``."""
    try:
        tok = tokenizer_from_args(args)
    except TokenizerError as e:  # names its flag: a missing or unused file flag, transformers not installed ...
        raise ArgumentError(e.flag, e.message) from None
    for line in ignored_tokenizer_flags(args):
        notice(args, line)
    args.tokenizer_vocab_size = tok.vocab_size
    if args.tokenizer_type == "NullTokenizer":
        vocab = tok.vocab_size  # --vocab-size ids plus the EOD id; args.vocab_size keeps the flag's value
    elif args.tokenizer_type == "TikTokenizer":  # --vocab-size is the tokenizer's whole vocabulary (default 2**17)
        vocab = args.vocab_size = tok.vocab_size
    elif args.vocab_size is None:
        vocab = args.vocab_size = tok.vocab_size
    elif args.vocab_size < tok.vocab_size:
        raise ArgumentError("--vocab-size", f"{args.vocab_size} is smaller than the {args.tokenizer_type} tokenizer's "
                                            f"{tok.vocab_size} tokens; raise it or omit it")
    else:
        vocab = args.vocab_size
    args.padded_vocab_size = padded_vocab_size(vocab, divisible_by=args.make_vocab_size_divisible_by,
                                               tp=args.tensor_model_parallel_size)

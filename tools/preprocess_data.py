#!/usr/bin/env python
"""Tokenize a JSONL or plain-text corpus into megatron-core's indexed dataset (.bin/.idx).

Output: for every JSON key K, ``OUTPUT_PREFIX_K_document.bin`` and ``.idx`` (Megatron's naming);
pass ``OUTPUT_PREFIX_K_document`` to ``pretrain_gpt_zb.py --data-path``. Each input document
becomes one document of the dataset, with the tokenizer's end-of-document id appended
(``--append-eod``, on by default; ``--no-append-eod`` turns it off).

Examples::

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus
    # -> data/corpus_text_document.bin / .idx  (byte-level tokenizer, nothing downloaded)

    python tools/preprocess_data.py --input book.txt --output-prefix data/book \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model /models/llama-tokenizer --workers 4

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type Llama2Tokenizer --tokenizer-model /models/llama2/tokenizer.model

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type TikTokenizer --tokenizer-model tokenizer.json --tiktoken-pattern v2 --vocab-size 131072

The tokenizer flags are ``pretrain_gpt_zb.py``'s (:func:`megatron_zb.training.tokenizer_flags.add_tokenizer_args`);
pass the same ones to both. ``--help`` does not import megatron-core (it is imported to tokenize).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from typing import Iterator, Sequence

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Tokenize JSONL (one JSON object per line) or plain text (one document per non-empty line) "
                    "into megatron-core .bin/.idx files for --data-path.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("input")
    g.add_argument("--input", required=True, help="Input file: .jsonl/.json (JSON lines) or any other text file.")
    g.add_argument("--input-format", choices=("auto", "jsonl", "text"), default="auto",
                   help="auto: jsonl for files ending in .jsonl or .json, else text (one document per non-empty line).")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="JSON keys to extract; one output dataset per key. For text input only the first key is "
                        "used (in the output name).")
    # the flags of pretrain_gpt_zb.py, from a module that does not import megatron-core (fast --help)
    from megatron_zb.training.tokenizer_flags import add_tokenizer_args

    g = p.add_argument_group("tokenizer (the flags of pretrain_gpt_zb.py)")
    add_tokenizer_args(g)
    g.add_argument("--vocab-size", type=int, default=None,
                   help="Number of ids for --tokenizer-type NullTokenizer; the whole vocabulary (special tokens "
                        "included, default 131072) for TikTokenizer. Pass pretrain_gpt_zb.py the same value.")
    g.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                   help="Append the end-of-document id to every document.")
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", required=True, help="Output path prefix (directories are created).")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1,
                   help="Tokenizer worker processes. Output order is the input order for any value.")
    g.add_argument("--chunk-size", type=int, default=64, help="Documents per task sent to a worker.")
    g.add_argument("--log-interval", type=int, default=10000, help="Print progress every this many documents.")
    return p


# ---------------------------------------------------------------------------- workers
_TOKENIZER = None
_KEYS: Sequence[str] = ()
_APPEND_EOD = True


def _init_worker(tokenizer_args: argparse.Namespace, keys: Sequence[str], append_eod: bool) -> None:
    global _TOKENIZER, _KEYS, _APPEND_EOD
    from megatron_zb.training.tokenizers import tokenizer_from_args
    _TOKENIZER = tokenizer_from_args(tokenizer_args)
    _KEYS, _APPEND_EOD = tuple(keys), append_eod


def _encode(item: tuple[int, dict[str, str]]) -> tuple[int, dict[str, list[int]], int]:
    """(line number, {key: text}) -> (line number, {key: ids}, bytes of text)."""
    lineno, doc = item
    out: dict[str, list[int]] = {}
    nbytes = 0
    for key in _KEYS:
        text = doc[key]
        nbytes += len(text.encode("utf-8"))
        ids = _TOKENIZER.tokenize(text)
        if _APPEND_EOD:
            ids = list(ids) + [_TOKENIZER.eod]
        out[key] = ids
    return lineno, out, nbytes


def _read_documents(path: str, fmt: str, keys: Sequence[str]) -> Iterator[tuple[int, dict[str, str]]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if fmt == "text":
                line = line.rstrip("\n")
                if line.strip():
                    yield lineno, {keys[0]: line}
                continue
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}:{lineno}: not valid JSON ({e})") from None
            missing = [k for k in keys if not isinstance(obj.get(k), str)]
            if missing:
                raise SystemExit(f"{path}:{lineno}: no string value for key {missing[0]!r} (see --json-keys)")
            yield lineno, {k: obj[k] for k in keys}


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron's naming: ``PREFIX_KEY_document``."""
    return f"{output_prefix}_{key}_document"


def main(argv: Sequence[str] | None = None) -> list[str]:
    """Run the tool; returns the dataset prefixes written (one per JSON key).

    Bad flags (including an unusable tokenizer: missing files, a missing package)
    exit with status 2 and one ``error:`` line naming the flag, before any input is read.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be >= 1")
    if args.vocab_size is not None and args.tokenizer_type not in ("NullTokenizer", "TikTokenizer"):
        parser.error(f"--vocab-size is only read by --tokenizer-type NullTokenizer / TikTokenizer, not "
                     f"{args.tokenizer_type}; drop it")
    fmt = args.input_format
    if fmt == "auto":
        fmt = "jsonl" if args.input.endswith((".jsonl", ".json")) else "text"
    keys = args.json_keys[:1] if fmt == "text" else args.json_keys
    if not os.path.isfile(args.input):
        parser.error(f"--input {args.input!r} does not exist")

    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from megatron_zb.training.tokenizer_flags import TIKTOKEN_FLAGS
    from megatron_zb.training.tokenizers import TokenizerError, ignored_tokenizer_flags, tokenizer_from_args

    tokenizer_args = argparse.Namespace(**{k: getattr(args, k) for k in (
        "tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "vocab_size", *TIKTOKEN_FLAGS)})
    try:
        tokenizer = tokenizer_from_args(tokenizer_args)
    except TokenizerError as e:
        parser.error(str(e))
    for line in ignored_tokenizer_flags(tokenizer_args):
        print(line, file=sys.stderr, flush=True)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    prefixes = {k: output_prefix_for(args.output_prefix, k) for k in keys}
    builders = {k: IndexedDatasetBuilder(prefixes[k] + ".bin", dtype=dtype) for k in keys}
    print(f"> tokenizing {args.input} ({fmt}) with {args.tokenizer_type} (vocab {tokenizer.vocab_size}, "
          f"eod {tokenizer.eod}, dtype {numpy.dtype(dtype).name}), {args.workers} worker(s)", file=sys.stderr, flush=True)

    init = (tokenizer_args, keys, args.append_eod)
    docs = _read_documents(args.input, fmt, keys)
    pool = None
    if args.workers == 1:
        _init_worker(*init)
        results: Iterator = map(_encode, docs)
    else:
        pool = multiprocessing.get_context("spawn").Pool(args.workers, initializer=_init_worker, initargs=init)
        results = pool.imap(_encode, docs, chunksize=args.chunk_size)
    t0 = time.time()
    n_docs = n_bytes = n_tokens = 0
    try:
        for _, encoded, nbytes in results:
            for key, ids in encoded.items():
                if not ids:  # empty text without --append-eod: nothing to store
                    continue
                builders[key].add_item(torch.tensor(ids, dtype=torch.int64))
                builders[key].end_document()
                n_tokens += len(ids)
            n_docs += 1
            n_bytes += nbytes
            if n_docs % args.log_interval == 0:
                dt = max(time.time() - t0, 1e-9)
                print(f"  processed {n_docs} documents ({n_docs / dt:.1f} docs/s, {n_bytes / dt / 2**20:.2f} MiB/s, "
                      f"{n_tokens} tokens)", file=sys.stderr, flush=True)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    for key in keys:
        builders[key].finalize(prefixes[key] + ".idx")
    dt = max(time.time() - t0, 1e-9)
    print(f"> done: {n_docs} documents, {n_tokens} tokens in {dt:.1f} s", file=sys.stderr, flush=True)
    for key in keys:
        print(f"> wrote {prefixes[key]}.bin and .idx  (use --data-path {prefixes[key]})", file=sys.stderr, flush=True)
    return [prefixes[k] for k in keys]


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()

"""SentencePiece and TikToken tokenizers, built by megatron-core's own libraries as Megatron-LM builds them.

Megatron-LM core_v0.16.1's ``pretrain_gpt.py`` and ``tools/preprocess_data.py`` build these types with
``megatron.core.tokenizers.MegatronTokenizer.from_pretrained`` (its default, non-legacy tokenizer
path): library ``sentencepiece`` for ``GPTSentencePieceTokenizer`` and ``Llama2Tokenizer`` (the
same tokenizer for both: ids of ``SentencePieceProcessor.encode_as_ids``, no BOS added, ``eod`` =
the model's EOS id, ``pad`` = its PAD id, -1 when it has none), library ``tiktoken`` for
``TikTokenizer``. The same call is made here with the same keyword arguments, so the ids, ``eod``,
``pad`` and ``vocab_size`` are Megatron-LM's by construction; what is added is checking the inputs
first, so that a wrong file or option is one line naming the flag (:class:`TokenizerError`)
instead of megatron-core's bare ``AssertionError``.

TikToken (megatron-core's ``TikTokenTokenizer``): ``--tokenizer-model`` is a ``.json`` list of
``{"rank", "token_bytes" (base64), "token_str"}`` entries, rank ``i`` at index ``i``, the first 256
the single bytes 0..255. The first ``--tiktoken-num-special-tokens`` ids (default 1000) are special
tokens: the ``--tokenizer-special-tokens`` list (default :data:`TIKTOKEN_SPECIAL_TOKENS`; it must
contain those seven), then fillers ``<SPECIAL_k>``; rank ``r`` of the file is id ``r + num_special``.
``--vocab-size`` (default 2**17) is the whole vocabulary; the file's first ``vocab_size -
num_special`` ranks are used (it must have that many). ``eod`` is the id of ``</s>``, ``pad`` of
``<pad>``. ``--tiktoken-pattern`` (``v1`` or ``v2``) is required, as Megatron-LM's legacy tokenizer
(which it builds for every run) asserts.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from typing import Any, Sequence

from megatron.core.tokenizers import MegatronTokenizer, MegatronTokenizerBase

from .tokenizers import TokenizerError, import_package

__all__ = ["SENTENCEPIECE_TYPES", "TIKTOKEN_DEFAULT_VOCAB_SIZE", "TIKTOKEN_PATTERNS", "TIKTOKEN_SPECIAL_TOKENS",
           "read_tiktoken_ranks", "sentencepiece_tokenizer", "tiktoken_tokenizer"]

SENTENCEPIECE_TYPES: tuple[str, ...] = ("GPTSentencePieceTokenizer", "Llama2Tokenizer")
"""``--tokenizer-type`` values read as a SentencePiece model."""
TIKTOKEN_PATTERNS: tuple[str, ...] = ("v1", "v2")
"""``--tiktoken-pattern`` values (megatron-core's pre-tokenization patterns)."""
TIKTOKEN_SPECIAL_TOKENS: tuple[str, ...] = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
"""megatron-core's default TikToken special tokens, ids 0-6; a custom list must contain them all."""
TIKTOKEN_DEFAULT_VOCAB_SIZE: int = 2**17
"""The vocabulary of a TikToken tokenizer without ``--vocab-size`` (megatron-core's and Megatron-LM's)."""

_MODEL = "--tokenizer-model"


def _require_file(path: str | None, tokenizer_type: str, what: str) -> str:
    if not path:
        raise TokenizerError(f"is required with --tokenizer-type {tokenizer_type}: pass the local {what} (never "
                             f"downloaded)", flag=_MODEL)
    if not os.path.isfile(path):
        raise TokenizerError(f"{path!r} is not a file; pass the local {what}", flag=_MODEL)
    return path


def sentencepiece_tokenizer(tokenizer_type: str, model_file: str | None) -> MegatronTokenizerBase:
    """``GPTSentencePieceTokenizer`` / ``Llama2Tokenizer`` from a SentencePiece model file (see the module docstring)."""
    _require_file(model_file, tokenizer_type, "SentencePiece model file (e.g. tokenizer.model)")
    import_package("sentencepiece", tokenizer_type)
    try:  # Megatron-LM passes legacy=--tokenizer-sentencepiece-legacy (not offered: False) and its special tokens
        tok = MegatronTokenizer.from_pretrained(tokenizer_path=model_file, metadata_path={"library": "sentencepiece"},
                                                legacy=False, special_tokens=None)
    except Exception as e:  # sentencepiece raises OSError / RuntimeError for a file that is not a model
        raise TokenizerError(f"cannot load {model_file!r} as a SentencePiece model: {e}", flag=_MODEL) from None
    if tok.eod < 0:
        raise TokenizerError(f"the SentencePiece model {model_file!r} has no EOS piece (eos_id -1), which Megatron "
                             f"uses as the end-of-document token; train it with an EOS piece", flag=_MODEL)
    return tok


def read_tiktoken_ranks(path: str) -> list[bytes]:
    """The token bytes of a tiktoken vocabulary JSON, by rank; ``ValueError`` saying what is wrong."""
    with open(path, encoding="utf-8") as f:
        entries = json.load(f)
    if not isinstance(entries, list):
        raise ValueError("not a tiktoken vocabulary (a JSON list of {rank, token_bytes, token_str} objects)")
    out: list[bytes] = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or set(entry) != {"rank", "token_bytes", "token_str"}:
            raise ValueError(f"entry {i} is not an object with exactly the keys rank, token_bytes, token_str")
        if entry["rank"] != i:
            raise ValueError(f"entry {i} has rank {entry['rank']!r}; ranks must be 0, 1, 2, ... in order")
        try:
            token = base64.b64decode(entry["token_bytes"], validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise ValueError(f"entry {i}: token_bytes is not base64") from None
        if i < 256 and token != bytes([i]):
            raise ValueError(f"entry {i} is {token!r}; the first 256 ranks must be the single bytes 0..255")
        out.append(token)
    if len(set(out)) != len(out):
        raise ValueError("a token appears twice")
    return out


def _tiktoken_options(pattern: str | None, vocab_size: int, num_special_tokens: int,
                      special_tokens: Sequence[str] | None) -> None:
    """The TikToken flags megatron-core would assert on, each refused naming its flag."""
    if pattern is None:
        raise TokenizerError(f"is required with --tokenizer-type TikTokenizer: {' or '.join(TIKTOKEN_PATTERNS)} (the "
                             f"pre-tokenization pattern; Megatron-LM asserts it is given)", flag="--tiktoken-pattern")
    if pattern not in TIKTOKEN_PATTERNS:
        raise TokenizerError(f"{pattern!r} is not one of {', '.join(TIKTOKEN_PATTERNS)}", flag="--tiktoken-pattern")
    special = list(special_tokens) if special_tokens else list(TIKTOKEN_SPECIAL_TOKENS)
    flag = "--tokenizer-special-tokens"
    if len(set(special)) != len(special):
        raise TokenizerError(f"lists a token twice: {special}", flag=flag)
    missing = [t for t in TIKTOKEN_SPECIAL_TOKENS if t not in special]
    if missing:
        raise TokenizerError(f"must contain megatron-core's {' '.join(TIKTOKEN_SPECIAL_TOKENS)}; missing "
                             f"{' '.join(missing)}", flag=flag)
    if not len(special) <= num_special_tokens < vocab_size:
        raise TokenizerError(f"{num_special_tokens} must be at least the {len(special)} special tokens and below "
                             f"the vocabulary size {vocab_size}", flag="--tiktoken-num-special-tokens")


def tiktoken_tokenizer(path: str | None, *, pattern: str | None, vocab_size: int | None, num_special_tokens: int,
                       special_tokens: Sequence[str] | None) -> MegatronTokenizerBase:
    """``TikTokenizer`` from a tiktoken vocabulary JSON (see the module docstring)."""
    _require_file(path, "TikTokenizer", "tiktoken vocabulary (.json)")
    if not str(path).endswith(".json"):
        raise TokenizerError(f"{path!r} does not end in .json; megatron-core reads a tiktoken vocabulary from a JSON "
                             f"file only", flag=_MODEL)
    size = TIKTOKEN_DEFAULT_VOCAB_SIZE if vocab_size is None else int(vocab_size)
    _tiktoken_options(pattern, size, num_special_tokens, special_tokens)
    import_package("tiktoken", "TikTokenizer")
    try:
        ranks = read_tiktoken_ranks(path)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"cannot use {path!r} as a tiktoken vocabulary: {e}", flag=_MODEL) from None
    if len(ranks) < size - num_special_tokens:
        raise TokenizerError(f"{size} needs {size - num_special_tokens} ranks after the {num_special_tokens} special "
                             f"tokens, but {path!r} has {len(ranks)}; pass --vocab-size "
                             f"{len(ranks) + num_special_tokens} (or less)", flag="--vocab-size")
    kwargs: dict[str, Any] = dict(pattern=pattern, vocab_size=size, num_special_tokens=num_special_tokens,
                                  special_tokens=list(special_tokens) if special_tokens else None)
    try:
        return MegatronTokenizer.from_pretrained(tokenizer_path=path, metadata_path={"library": "tiktoken"}, **kwargs)
    except Exception as e:  # what the checks above did not foresee: name the file
        raise TokenizerError(f"megatron-core cannot build a TikToken tokenizer from {path!r}: "
                             f"{type(e).__name__}: {e}", flag=_MODEL) from None

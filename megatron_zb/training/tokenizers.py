"""Tokenizers of ``--tokenizer-type``, read from local files only (nothing is ever downloaded).

Every tokenizer implements megatron-core's ``megatron.core.tokenizers.MegatronTokenizerBase`` as
far as ``GPTDatasetConfig`` and the datasets use it (``vocab_size``, ``eod``, ``pad`` when it has
one, ``unique_identifiers``), plus ``tokenize`` / ``detokenize`` for :mod:`tools.preprocess_data`:

* ``ByteLevel`` (:class:`ByteLevelTokenizer`, the default): UTF-8 bytes are ids 0-255,
  ``EOD = 256``, ``PAD = 257``; vocabulary 258.
* ``GPT2BPETokenizer`` (:class:`GPT2BPETokenizer`): Megatron-LM's GPT-2 byte-level BPE from
  ``--vocab-file`` (``vocab.json``) and ``--merge-file`` (``merges.txt``); ``eod`` is
  ``<|endoftext|>``, ``vocab_size`` the number of entries in the vocab file (as Megatron-LM).
  Needs ``regex`` (a dependency of megatron-zb), not ``transformers``.
* ``GPTSentencePieceTokenizer``, ``Llama2Tokenizer``: a SentencePiece model file
  (``--tokenizer-model``) through megatron-core's own ``SentencePieceTokenizer``, as Megatron-LM
  0.16.1 builds them (:mod:`megatron_zb.training.mcore_tokenizers`); ``eod`` is the model's EOS.
* ``TikTokenizer``: a tiktoken vocabulary JSON (``--tokenizer-model``) through megatron-core's
  ``TikTokenTokenizer``, with ``--tiktoken-pattern``, ``--tiktoken-num-special-tokens``,
  ``--tokenizer-special-tokens`` / ``--tiktoken-special-tokens`` and ``--vocab-size`` (the whole
  vocabulary, special tokens included) as Megatron-LM passes them.
* ``HuggingFaceTokenizer`` (:class:`HuggingFaceLocalTokenizer`): ``AutoTokenizer`` loaded from the
  local directory ``--tokenizer-model`` with ``local_files_only=True``; ``eod`` is its EOS.
  Needs the optional ``transformers``.
* ``NullTokenizer`` (:class:`NullTokenizer`): whitespace-separated integer ids ``0..N-1``;
  ``EOD = N``; vocabulary ``N + 1`` (Megatron's meaning of ``--vocab-size``).

:func:`build_tokenizer` raises :class:`TokenizerError` naming the flag to fix; a file flag the
chosen type does not read (e.g. ``--merge-file`` with ``ByteLevel``) is refused, not ignored.
:func:`add_tokenizer_args` (from :mod:`megatron_zb.training.tokenizer_flags`, re-exported here)
declares the tokenizer flags once for ``pretrain_gpt_zb.py`` and ``tools/preprocess_data.py``.
"""

from __future__ import annotations

import argparse
import importlib
import os
from collections import OrderedDict
from typing import Any, Sequence

from megatron.core.tokenizers import MegatronTokenizerBase

from .tokenizer_flags import TIKTOKEN_FLAGS, TOKENIZER_TYPES, add_tokenizer_args  # re-exported (declared without megatron-core)

__all__ = [
    "ByteLevelTokenizer",
    "GPT2BPETokenizer",
    "HuggingFaceLocalTokenizer",
    "NullTokenizer",
    "TOKENIZER_TYPES",
    "TokenizerError",
    "add_tokenizer_args",
    "build_tokenizer",
    "ignored_tokenizer_flags",
    "import_package",
    "tokenizer_from_args",
    "tokenizer_special_tokens",
]

_FILE_FLAGS: dict[str, tuple[str, ...]] = {
    "--tokenizer-model": ("HuggingFaceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer", "TikTokenizer"),
    "--vocab-file": ("GPT2BPETokenizer",),
    "--merge-file": ("GPT2BPETokenizer",),
}
"""Each tokenizer file flag and the tokenizer types that read it."""


class TokenizerError(ValueError):
    """A tokenizer cannot be built (missing local files, missing package, bad options).

    ``flag`` is the command-line flag to change (``--tokenizer-type`` unless another flag is at
    fault), ``message`` says how; ``str()`` is ``"FLAG: MESSAGE"`` (as the command line's ``ArgumentError``).
    """

    def __init__(self, message: str, *, flag: str = "--tokenizer-type") -> None:
        self.flag = flag
        self.message = message
        super().__init__(f"{flag}: {message}")


def import_package(module: str, tokenizer_type: str, *, optional: bool = False) -> Any:
    """``module`` imported, or a one-line :class:`TokenizerError` saying how to install it.

    ``optional``: not a dependency of megatron-zb (``transformers``); the others are in its default
    install (``sentencepiece``, ``tiktoken``, ``regex``), so their absence means a broken install.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        how = (f"pip install {module}, or use --tokenizer-type ByteLevel" if optional else
               f"pip install {module} (a dependency of megatron-zb: reinstall it with pip install -e .)")
        raise TokenizerError(f"--tokenizer-type {tokenizer_type} needs the '{module}' package, which is not "
                             f"importable ({e}); {how}") from None


def _identifiers(tokenizer: MegatronTokenizerBase, **fields: Any) -> OrderedDict:
    """Identifies a tokenizer in megatron-core's dataset cache keys."""
    return OrderedDict(self=f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}", **fields)


# ---------------------------------------------------------------------------- tokenizers
class ByteLevelTokenizer(MegatronTokenizerBase):
    """UTF-8 bytes as token ids 0-255, plus ``EOD = 256`` and ``PAD = 257`` (vocabulary 258).

    Unlike megatron-core's own byte-level tokenizer (EOS/EOD = 0, PAD = 1, i.e. colliding with
    the bytes 0 and 1), the special ids here never occur in tokenized text.
    """

    EOD: int = 256
    PAD: int = 257

    def __init__(self) -> None:
        super().__init__("", {"library": "megatron-zb-byte-level"})

    def tokenize(self, text: str) -> list[int]:
        """Text -> byte ids (no EOD appended)."""
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Sequence[int]) -> str:
        """Ids -> text; special ids are dropped, invalid UTF-8 is replaced."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, *_: Any, **__: Any) -> Any:
        raise NotImplementedError("the byte-level tokenizer has no chat template")

    @property
    def vocab(self) -> dict[str, int]:
        return {**{bytes([i]).decode("latin-1"): i for i in range(256)}, "<eod>": self.EOD, "<pad>": self.PAD}

    @property
    def vocab_size(self) -> int:
        return 258

    @property
    def eod(self) -> int:
        return self.EOD

    @property
    def eos(self) -> int:
        return self.EOD

    @property
    def pad(self) -> int:
        return self.PAD

    @property
    def unique_identifiers(self) -> OrderedDict:
        return _identifiers(self, vocab_size=258, eod=256, pad=257)


class NullTokenizer(MegatronTokenizerBase):
    """Whitespace-separated integer ids ``0..N-1`` (``N = vocab_size``); ``EOD = N``; vocabulary ``N + 1``."""

    def __init__(self, vocab_size: int | None) -> None:
        if vocab_size is None or int(vocab_size) < 1:
            raise TokenizerError(f"is required with --tokenizer-type NullTokenizer (the number of ids, >= 1), got "
                                 f"{vocab_size}", flag="--vocab-size")
        super().__init__("", {"library": "megatron-zb-null"})
        self._n = int(vocab_size)

    def tokenize(self, text: str) -> list[int]:
        ids = [int(t) for t in text.split()]
        bad = [i for i in ids if not 0 <= i < self._n]
        if bad:
            raise TokenizerError(f"NullTokenizer: id {bad[0]} is outside 0..{self._n - 1}", flag="--vocab-size")
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def apply_chat_template(self, *_: Any, **__: Any) -> Any:
        raise NotImplementedError("the null tokenizer has no chat template")

    @property
    def vocab(self) -> dict[str, int]:
        return {str(i): i for i in range(self._n + 1)}

    @property
    def vocab_size(self) -> int:
        return self._n + 1

    @property
    def eod(self) -> int:
        return self._n

    @property
    def eos(self) -> int:
        return self._n

    @property
    def unique_identifiers(self) -> OrderedDict:
        return _identifiers(self, vocab_size=self._n)


class HuggingFaceLocalTokenizer(MegatronTokenizerBase):
    """A HuggingFace tokenizer read from a local directory (``local_files_only=True``).

    ``eod`` is the tokenizer's EOS id; ``pad`` its PAD id when it has one (megatron-core masks
    the loss on padding). ``vocab_size`` is ``len(tokenizer)`` (base vocabulary plus added tokens).
    ``tokenize`` adds no special tokens (the EOD is appended by :mod:`tools.preprocess_data`);
    ``detokenize`` keeps special tokens and does not clean up spaces, so it inverts ``tokenize``.
    """

    def __init__(self, path: str) -> None:
        flag = "--tokenizer-model"
        if not path:
            raise TokenizerError("is required with --tokenizer-type HuggingFaceTokenizer: pass the local directory "
                                 "holding the tokenizer files (tokenizer.json / tokenizer_config.json ...)", flag=flag)
        if not os.path.exists(path):
            raise TokenizerError(f"tokenizer path {path!r} does not exist; pass --tokenizer-model with a local "
                                 f"directory holding the tokenizer files (models are never downloaded)", flag=flag)
        transformers = import_package("transformers", "HuggingFaceTokenizer", optional=True)
        try:
            tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e:  # transformers raises OSError/ValueError/... for unusable directories
            raise TokenizerError(f"cannot load a HuggingFace tokenizer from {path!r}: {e}", flag=flag) from None
        if tok.eos_token_id is None:
            raise TokenizerError(f"the tokenizer in {path!r} has no EOS token to use as the end-of-document token",
                                 flag=flag)
        super().__init__(path, {"library": "huggingface-local"})
        self._tok = tok

    def tokenize(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], clean_up_tokenization_spaces=False)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        return self._tok.apply_chat_template(*args, **kwargs)

    @property
    def vocab(self) -> dict[str, int]:
        return self._tok.get_vocab()

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def eod(self) -> int:
        return int(self._tok.eos_token_id)

    @property
    def eos(self) -> int:
        return int(self._tok.eos_token_id)

    @property
    def pad(self) -> int:
        if self._tok.pad_token_id is None:
            raise AttributeError("this tokenizer has no pad token")
        return int(self._tok.pad_token_id)

    @property
    def unique_identifiers(self) -> OrderedDict:
        return _identifiers(self, path=os.path.abspath(self.path), vocab_size=len(self._tok))


class GPT2BPETokenizer(MegatronTokenizerBase):
    """Megatron-LM's ``GPT2BPETokenizer`` from local ``vocab.json`` / ``merges.txt`` files.

    Byte-level BPE of :mod:`megatron_zb.training.gpt2_bpe` (no ``transformers``): the ids of
    Megatron-LM's own GPT-2 tokenizer (``megatron/training/tokenizer``), the one that reads these two
    files. ``eod`` = the id of ``<|endoftext|>``, ``vocab_size`` = entries of the vocab file, no PAD
    token (megatron-core's datasets then use their own pad id) -- as Megatron-LM's. A literal
    ``<|endoftext|>`` in the text is tokenized as text, as there.

    Megatron-LM 0.16.1's new tokenizer path for this type (megatron-core's ``MegatronHFTokenizer``)
    is not used: it loads the hub model ``gpt2`` (network) and passes the vocab file where the merges
    file belongs. Refused with :class:`TokenizerError`: a missing file, a vocab file that is not a
    JSON object with ids ``0..N-1``, lacks ``<|endoftext|>`` or one of the 256 byte-level symbols, a
    merges file without its ``#version`` header or final newline, with a malformed line or a merge
    whose symbols are not in the vocabulary (:func:`~megatron_zb.training.gpt2_bpe.read_merges`).
    """

    EOD_TOKEN: str = "<|endoftext|>"

    def __init__(self, vocab_file: str | None, merge_file: str | None) -> None:
        from megatron_zb.training import gpt2_bpe

        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path:
                raise TokenizerError(f"is required with --tokenizer-type GPT2BPETokenizer: pass the local GPT-2 "
                                     f"{'vocab.json' if flag == '--vocab-file' else 'merges.txt'} file "
                                     f"(never downloaded)", flag=flag)
            if not os.path.isfile(path):
                raise TokenizerError(f"{path!r} is not a file; pass the local GPT-2 BPE file", flag=flag)
        import_package("regex", "GPT2BPETokenizer")
        try:
            vocab = gpt2_bpe.read_vocab(vocab_file)
        except (OSError, ValueError) as e:
            raise TokenizerError(f"cannot use {vocab_file!r} as a GPT-2 vocab.json: {e}", flag="--vocab-file") from None
        if self.EOD_TOKEN not in vocab:
            raise TokenizerError(f"{vocab_file!r} has no {self.EOD_TOKEN!r} token, Megatron's GPT-2 end-of-document "
                                 f"token", flag="--vocab-file")
        try:
            merges = gpt2_bpe.read_merges(merge_file, vocab)
        except (OSError, ValueError) as e:
            raise TokenizerError(f"cannot use {merge_file!r} as the GPT-2 merges.txt of {vocab_file!r}: {e}",
                                 flag="--merge-file") from None
        super().__init__(vocab_file, {"library": "megatron-zb-gpt2-bpe"})
        self._bpe = gpt2_bpe.ByteLevelBPE(vocab, merges)
        self._eod = int(vocab[self.EOD_TOKEN])
        self.merge_file = merge_file

    def tokenize(self, text: str) -> list[int]:
        """Text -> ids (no EOD appended)."""
        return self._bpe.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._bpe.decode(ids)

    def apply_chat_template(self, *_: Any, **__: Any) -> Any:
        raise NotImplementedError("the GPT-2 BPE tokenizer has no chat template")

    @property
    def vocab(self) -> dict[str, int]:
        return self._bpe.vocab

    @property
    def vocab_size(self) -> int:
        return len(self._bpe.vocab)

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    @property
    def unique_identifiers(self) -> OrderedDict:
        return _identifiers(self, vocab_file=os.path.abspath(self.path), merge_file=os.path.abspath(self.merge_file),
                            vocab_size=self.vocab_size)


# ---------------------------------------------------------------------------- construction
def build_tokenizer(tokenizer_type: str, *, tokenizer_model: str | None = None, vocab_size: int | None = None,
                    vocab_file: str | None = None, merge_file: str | None = None,
                    tiktoken_pattern: str | None = None, tiktoken_num_special_tokens: int = 1000,
                    special_tokens: Sequence[str] | None = None) -> MegatronTokenizerBase:
    """The tokenizer named by ``--tokenizer-type`` (see the module docstring); :class:`TokenizerError` if unusable.

    ``vocab_size`` is read by ``NullTokenizer`` (ids before the EOD) and ``TikTokenizer`` (the whole
    vocabulary); the file arguments only by the types of :data:`_FILE_FLAGS` (given to another type
    they are refused, naming the flag); the ``tiktoken_*`` and ``special_tokens`` arguments only by
    ``TikTokenizer`` (ignored by the others).
    """
    from megatron_zb.training import mcore_tokenizers

    if tokenizer_type not in TOKENIZER_TYPES:
        raise TokenizerError(f"unknown tokenizer type {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}")
    given = {"--tokenizer-model": tokenizer_model, "--vocab-file": vocab_file, "--merge-file": merge_file}
    for flag, value in given.items():
        if value and tokenizer_type not in _FILE_FLAGS[flag]:
            raise TokenizerError(f"is only read by --tokenizer-type {' / '.join(_FILE_FLAGS[flag])}, not "
                                 f"{tokenizer_type}; drop it or change --tokenizer-type", flag=flag)
    if tokenizer_type == "ByteLevel":
        return ByteLevelTokenizer()
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceLocalTokenizer(tokenizer_model or "")
    if tokenizer_type in mcore_tokenizers.SENTENCEPIECE_TYPES:
        return mcore_tokenizers.sentencepiece_tokenizer(tokenizer_type, tokenizer_model)
    if tokenizer_type == "TikTokenizer":
        return mcore_tokenizers.tiktoken_tokenizer(tokenizer_model, pattern=tiktoken_pattern, vocab_size=vocab_size,
                                                   num_special_tokens=tiktoken_num_special_tokens,
                                                   special_tokens=special_tokens)
    return NullTokenizer(vocab_size)


def tokenizer_special_tokens(args: argparse.Namespace) -> list[str] | None:
    """``--tokenizer-special-tokens``, else the deprecated ``--tiktoken-special-tokens`` (Megatron-LM's rule)."""
    return getattr(args, "tokenizer_special_tokens", None) or getattr(args, "tiktoken_special_tokens", None)


def ignored_tokenizer_flags(args: argparse.Namespace) -> list[str]:
    """One ``WARNING:`` line per TikToken-only flag given (not at its default) with another
    ``--tokenizer-type``: ignored, as Megatron-LM ignores it (its LLaMA-3 scripts pass
    ``--tiktoken-pattern`` with any tokenizer). The special-token lists are refused instead
    (:func:`tokenizer_from_args`)."""
    if args.tokenizer_type == "TikTokenizer":
        return []
    return [f"WARNING: --{dest.replace('_', '-')} is only read by --tokenizer-type TikTokenizer; ignored with "
            f"{args.tokenizer_type}, as in Megatron-LM"
            for dest in ("tiktoken_pattern", "tiktoken_num_special_tokens")
            if getattr(args, dest, TIKTOKEN_FLAGS[dest]) != TIKTOKEN_FLAGS[dest]]


def tokenizer_from_args(args: Any) -> MegatronTokenizerBase:
    """:func:`build_tokenizer` from the flags of :func:`add_tokenizer_args` and ``--vocab-size``, read by
    their ``dest`` names from ``args``: the validated ``argparse.Namespace`` or the run's
    :class:`~megatron_zb.training.run_config.TokenizerConfig` (the same names).

    ``--tokenizer-special-tokens`` / ``--tiktoken-special-tokens`` with a type other than
    ``TikTokenizer`` are refused: Megatron-LM gives them meanings there (HuggingFace's additional
    special tokens, SentencePiece's legacy mode) that megatron-zb does not implement.
    """
    if args.tokenizer_type != "TikTokenizer":
        for dest in ("tokenizer_special_tokens", "tiktoken_special_tokens"):
            if getattr(args, dest, None):
                raise TokenizerError(f"is only read by --tokenizer-type TikTokenizer in megatron-zb, not "
                                     f"{args.tokenizer_type}; drop it", flag="--" + dest.replace("_", "-"))
    return build_tokenizer(args.tokenizer_type, tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size,
                           vocab_file=getattr(args, "vocab_file", None), merge_file=getattr(args, "merge_file", None),
                           tiktoken_pattern=getattr(args, "tiktoken_pattern", None),
                           tiktoken_num_special_tokens=getattr(args, "tiktoken_num_special_tokens", 1000),
                           special_tokens=tokenizer_special_tokens(args))

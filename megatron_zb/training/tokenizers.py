"""Tokenizers of ``--tokenizer-type``, read from local files only (nothing is ever downloaded).

Every tokenizer implements megatron-core's ``megatron.core.tokenizers.MegatronTokenizerBase`` as
far as ``GPTDatasetConfig`` and the datasets use it (``vocab_size``, ``eod``, ``pad`` when it has
one, ``unique_identifiers``), plus ``tokenize`` / ``detokenize`` for :mod:`tools.preprocess_data`:

* ``ByteLevel`` (:class:`ByteLevelTokenizer`, the default): UTF-8 bytes are ids 0-255,
  ``EOD = 256``, ``PAD = 257``; vocabulary 258.
* ``GPT2BPETokenizer`` (:class:`GPT2BPETokenizer`): Megatron-LM's GPT-2 byte-level BPE from
  ``--vocab-file`` (``vocab.json``) and ``--merge-file`` (``merges.txt``); ``eod`` is
  ``<|endoftext|>``, ``vocab_size`` the number of entries in the vocab file (as Megatron-LM).
  Needs ``transformers``.
* ``HuggingFaceTokenizer`` (:class:`HuggingFaceLocalTokenizer`): ``AutoTokenizer`` loaded from the
  local directory ``--tokenizer-model`` with ``local_files_only=True``; ``eod`` is its EOS.
  Needs ``transformers``.
* ``NullTokenizer`` (:class:`NullTokenizer`): whitespace-separated integer ids ``0..N-1``;
  ``EOD = N``; vocabulary ``N + 1`` (Megatron's meaning of ``--vocab-size``).

:func:`build_tokenizer` raises :class:`TokenizerError` naming the flag to fix; a file flag the
chosen type does not read (e.g. ``--merge-file`` with ``ByteLevel``) is refused, not ignored.
:func:`add_tokenizer_args` (from :mod:`megatron_zb.training.tokenizer_flags`, re-exported here)
declares the tokenizer flags once for ``pretrain_gpt_zb.py`` and ``tools/preprocess_data.py``.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import OrderedDict
from typing import Any, Sequence

from megatron.core.tokenizers import MegatronTokenizerBase

from .tokenizer_flags import TOKENIZER_TYPES, add_tokenizer_args  # re-exported (declared without megatron-core)

__all__ = [
    "ByteLevelTokenizer",
    "GPT2BPETokenizer",
    "HuggingFaceLocalTokenizer",
    "NullTokenizer",
    "TOKENIZER_TYPES",
    "TokenizerError",
    "add_tokenizer_args",
    "build_tokenizer",
    "tokenizer_from_args",
]

_FILE_FLAGS: dict[str, tuple[str, ...]] = {
    "--tokenizer-model": ("HuggingFaceTokenizer",),
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


def _import_transformers(tokenizer_type: str) -> Any:
    """The ``transformers`` module, or a one-line :class:`TokenizerError` saying how to install it."""
    try:
        import transformers
    except ImportError as e:
        raise TokenizerError(f"--tokenizer-type {tokenizer_type} needs the 'transformers' package, which is not "
                             f"importable ({e}); pip install transformers, or use --tokenizer-type ByteLevel"
                             ) from None
    return transformers


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


class _TransformersTokenizer(MegatronTokenizerBase):
    """What the two ``transformers``-backed tokenizers share: ``self._tok`` does the work.

    ``tokenize`` adds no special tokens (the EOD is appended by :mod:`tools.preprocess_data`);
    ``detokenize`` keeps special tokens and does not clean up spaces, so it inverts ``tokenize``.
    """

    _tok: Any

    def tokenize(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], clean_up_tokenization_spaces=False)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        return self._tok.apply_chat_template(*args, **kwargs)

    @property
    def vocab(self) -> dict[str, int]:
        return self._tok.get_vocab()


class HuggingFaceLocalTokenizer(_TransformersTokenizer):
    """A HuggingFace tokenizer read from a local directory (``local_files_only=True``).

    ``eod`` is the tokenizer's EOS id; ``pad`` its PAD id when it has one (megatron-core masks
    the loss on padding). ``vocab_size`` is ``len(tokenizer)`` (base vocabulary plus added tokens).
    """

    def __init__(self, path: str) -> None:
        flag = "--tokenizer-model"
        if not path:
            raise TokenizerError("is required with --tokenizer-type HuggingFaceTokenizer: pass the local directory "
                                 "holding the tokenizer files (tokenizer.json / tokenizer_config.json ...)", flag=flag)
        if not os.path.exists(path):
            raise TokenizerError(f"tokenizer path {path!r} does not exist; pass --tokenizer-model with a local "
                                 f"directory holding the tokenizer files (models are never downloaded)", flag=flag)
        transformers = _import_transformers("HuggingFaceTokenizer")
        try:
            tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e:  # transformers raises OSError/ValueError/... for unusable directories
            raise TokenizerError(f"cannot load a HuggingFace tokenizer from {path!r}: {e}", flag=flag) from None
        if tok.eos_token_id is None:
            raise TokenizerError(f"the tokenizer in {path!r} has no EOS token to use as the end-of-document token",
                                 flag=flag)
        super().__init__(path, {"library": "huggingface-local"})
        self._tok = tok

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


class GPT2BPETokenizer(_TransformersTokenizer):
    """Megatron-LM's ``GPT2BPETokenizer`` from local ``vocab.json`` / ``merges.txt`` files.

    ``eod`` = the id of ``<|endoftext|>``, ``vocab_size`` = entries of the vocab file, no PAD
    token (megatron-core's datasets then use their own pad id) -- as Megatron-LM's tokenizer.
    Encoding is ``transformers``' ``GPT2Tokenizer`` built from the two files, the HuggingFace
    GPT-2 tokenizer megatron-core 0.16.1's ``MegatronHFTokenizer`` wraps too. That class itself is
    not used: it loads the hub model ``gpt2`` (network) and passes the vocab file where the merges
    file belongs. Like it (and unlike Megatron-LM's legacy tokenizer), a literal
    ``<|endoftext|>`` in the text becomes the EOD id.

    Refused with :class:`TokenizerError`: a missing file, a vocab file that is not a JSON object,
    lacks ``<|endoftext|>`` or lacks one of the 256 byte-level symbols (text would silently lose
    characters), a merges file ``tokenizers`` rejects (a malformed line, a merge whose result is
    not in the vocabulary), and a tokenizer whose size differs from the vocab file's (a guard
    against a ``transformers`` API change silently ignoring the files; not triggered by the tests).
    """

    EOD_TOKEN: str = "<|endoftext|>"

    def __init__(self, vocab_file: str | None, merge_file: str | None) -> None:
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path:
                raise TokenizerError(f"is required with --tokenizer-type GPT2BPETokenizer: pass the local GPT-2 "
                                     f"{'vocab.json' if flag == '--vocab-file' else 'merges.txt'} file "
                                     f"(never downloaded)", flag=flag)
            if not os.path.isfile(path):
                raise TokenizerError(f"{path!r} is not a file; pass the local GPT-2 BPE file", flag=flag)
        transformers = _import_transformers("GPT2BPETokenizer")
        vocab = self._read_vocab(vocab_file)
        try:  # positional: (vocab_file, merges_file) in transformers 4, (vocab, merges) paths in 5
            tok = transformers.GPT2Tokenizer(vocab_file, merge_file)
        except Exception as e:  # a malformed merges file surfaces here
            raise TokenizerError(f"cannot build a GPT-2 BPE tokenizer from {vocab_file!r} and {merge_file!r}: {e}",
                                 flag="--merge-file") from None
        if len(tok) != len(vocab):
            raise TokenizerError(f"transformers {transformers.__version__} built a GPT-2 tokenizer of {len(tok)} "
                                 f"tokens from the {len(vocab)}-entry {vocab_file!r}", flag="--vocab-file")
        super().__init__(vocab_file, {"library": "megatron-zb-gpt2-bpe"})
        self._tok = tok
        self._size = len(vocab)
        self._eod = int(vocab[self.EOD_TOKEN])
        self.merge_file = merge_file

    @classmethod
    def _read_vocab(cls, vocab_file: str) -> dict[str, int]:
        from tokenizers.pre_tokenizers import ByteLevel  # a dependency of transformers

        try:
            with open(vocab_file, encoding="utf-8") as f:
                vocab = json.load(f)
        except (OSError, ValueError) as e:
            raise TokenizerError(f"cannot read {vocab_file!r} as a GPT-2 vocab.json: {e}",
                                 flag="--vocab-file") from None
        if not isinstance(vocab, dict):
            raise TokenizerError(f"{vocab_file!r} is not a GPT-2 vocab.json (a JSON object token -> id)",
                                 flag="--vocab-file")
        if cls.EOD_TOKEN not in vocab:
            raise TokenizerError(f"{vocab_file!r} has no {cls.EOD_TOKEN!r} token, Megatron's GPT-2 end-of-document "
                                 f"token", flag="--vocab-file")
        missing = sorted(set(ByteLevel.alphabet()) - set(vocab))
        if missing:
            raise TokenizerError(f"{vocab_file!r} lacks {len(missing)} of the 256 byte-level symbols (e.g. "
                                 f"{missing[0]!r}); it is not a GPT-2 byte-level BPE vocabulary", flag="--vocab-file")
        return vocab

    @property
    def vocab_size(self) -> int:
        return self._size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    @property
    def unique_identifiers(self) -> OrderedDict:
        return _identifiers(self, vocab_file=os.path.abspath(self.path), merge_file=os.path.abspath(self.merge_file),
                            vocab_size=self._size)


# ---------------------------------------------------------------------------- construction
def build_tokenizer(tokenizer_type: str, *, tokenizer_model: str | None = None, vocab_size: int | None = None,
                    vocab_file: str | None = None, merge_file: str | None = None) -> MegatronTokenizerBase:
    """The tokenizer named by ``--tokenizer-type`` (see the module docstring); :class:`TokenizerError` if unusable.

    ``vocab_size`` is only read by ``NullTokenizer``; the file arguments only by the types of
    :data:`_FILE_FLAGS` (given to another type they are refused, naming the flag).
    """
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
    return NullTokenizer(vocab_size)


def tokenizer_from_args(args: argparse.Namespace) -> MegatronTokenizerBase:
    """:func:`build_tokenizer` from the flags of :func:`add_tokenizer_args` and ``--vocab-size``."""
    return build_tokenizer(args.tokenizer_type, tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size,
                           vocab_file=getattr(args, "vocab_file", None), merge_file=getattr(args, "merge_file", None))

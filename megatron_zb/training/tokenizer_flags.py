"""The tokenizer flags (Megatron's names), declared once for ``pretrain_gpt_zb.py`` and
``tools/preprocess_data.py``.

Kept apart from :mod:`megatron_zb.training.tokenizers` (whose tokenizers subclass megatron-core's
``MegatronTokenizerBase``) so that building a parser -- e.g. ``tools/preprocess_data.py --help``
-- does not import megatron-core.
"""

from __future__ import annotations

import argparse

__all__ = ["TOKENIZER_TYPES", "add_tokenizer_args"]

TOKENIZER_TYPES: tuple[str, ...] = ("ByteLevel", "GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer")
"""The choices of ``--tokenizer-type``."""


def add_tokenizer_args(group: argparse._ArgumentGroup) -> None:
    """``--tokenizer-type``, ``--tokenizer-model``, ``--vocab-file``, ``--merge-file`` (Megatron's names)."""
    group.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default="ByteLevel",
                       help="ByteLevel (default): UTF-8 bytes 0-255 plus EOD and PAD, no files needed. "
                            "GPT2BPETokenizer: GPT-2 byte-level BPE from local --vocab-file and --merge-file "
                            "(needs transformers). HuggingFaceTokenizer: a tokenizer saved on local disk "
                            "(--tokenizer-model DIR; needs transformers). NullTokenizer: whitespace-separated "
                            "integer ids (needs --vocab-size). Nothing is ever downloaded.")
    group.add_argument("--tokenizer-model", type=str, default=None,
                       help="Local directory of a HuggingFace tokenizer (for --tokenizer-type HuggingFaceTokenizer).")
    group.add_argument("--vocab-file", type=str, default=None,
                       help="GPT-2 BPE vocabulary file, e.g. gpt2-vocab.json (for --tokenizer-type GPT2BPETokenizer).")
    group.add_argument("--merge-file", type=str, default=None,
                       help="GPT-2 BPE merges file, e.g. gpt2-merges.txt (for --tokenizer-type GPT2BPETokenizer).")

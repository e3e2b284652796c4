"""The tokenizer flags (Megatron's names), declared once for ``pretrain_gpt_zb.py`` and
``tools/preprocess_data.py``.

Kept apart from :mod:`megatron_zb.training.tokenizers` (whose tokenizers subclass megatron-core's
``MegatronTokenizerBase``) so that building a parser -- e.g. ``tools/preprocess_data.py --help``
-- does not import megatron-core.
"""

from __future__ import annotations

import argparse

__all__ = ["TIKTOKEN_FLAGS", "TOKENIZER_TYPES", "add_tokenizer_args"]

TOKENIZER_TYPES: tuple[str, ...] = ("ByteLevel", "GPT2BPETokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                                    "TikTokenizer", "HuggingFaceTokenizer", "NullTokenizer")
"""The choices of ``--tokenizer-type``."""

TIKTOKEN_FLAGS: dict[str, object] = {"tiktoken_pattern": None, "tiktoken_num_special_tokens": 1000,
                                     "tiktoken_special_tokens": None, "tokenizer_special_tokens": None}
"""The flags only ``--tokenizer-type TikTokenizer`` reads (dest -> default): other types ignore them,
as Megatron-LM does (its LLaMA-3 scripts pass ``--tiktoken-pattern`` with any tokenizer)."""


def add_tokenizer_args(group: argparse._ArgumentGroup) -> None:
    """``--tokenizer-type``, its file flags and the TikToken flags (Megatron's names and defaults)."""
    group.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default="ByteLevel",
                       help="ByteLevel (default): UTF-8 bytes 0-255 plus EOD and PAD, no files needed. "
                            "GPT2BPETokenizer: GPT-2 byte-level BPE from local --vocab-file and --merge-file. "
                            "GPTSentencePieceTokenizer, Llama2Tokenizer: a SentencePiece model file "
                            "(--tokenizer-model FILE). TikTokenizer: a tiktoken vocabulary JSON (--tokenizer-model "
                            "FILE, --tiktoken-pattern). HuggingFaceTokenizer: a tokenizer saved on local disk "
                            "(--tokenizer-model DIR; needs transformers). NullTokenizer: whitespace-separated "
                            "integer ids (needs --vocab-size). Nothing is ever downloaded.")
    group.add_argument("--tokenizer-model", type=str, default=None,
                       help="SentencePiece model file (GPTSentencePieceTokenizer, Llama2Tokenizer), tiktoken "
                            "vocabulary JSON (TikTokenizer) or local directory of a HuggingFace tokenizer "
                            "(HuggingFaceTokenizer).")
    group.add_argument("--vocab-file", type=str, default=None,
                       help="GPT-2 BPE vocabulary file, e.g. gpt2-vocab.json (for --tokenizer-type GPT2BPETokenizer).")
    group.add_argument("--merge-file", type=str, default=None,
                       help="GPT-2 BPE merges file, e.g. gpt2-merges.txt (for --tokenizer-type GPT2BPETokenizer).")
    group.add_argument("--tiktoken-pattern", type=str, default=None,
                       help="Which tiktoken pattern to use. Options: [v1, v2] (required by TikTokenizer; ignored, "
                            "with a start-up warning, by the other tokenizers).")
    group.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                       help="Number of special tokens in tiktoken tokenizer (ids 0..N-1; default 1000).")
    group.add_argument("--tiktoken-special-tokens", type=str, nargs="+", default=None,
                       help="Deprecated (Megatron-LM): used as --tokenizer-special-tokens when that is not given.")
    group.add_argument("--tokenizer-special-tokens", type=str, nargs="+", default=None,
                       help="List of special tokens. For TikTokenizer needs to have "
                            "[\"<unk>\", \"<s>\", \"</s>\", \"<mask>\", \"<pad>\", \"<cls>\", \"<sep>\"] "
                            "(read by TikTokenizer only).")

"""GPT-2's byte-level BPE from a local ``vocab.json`` and ``merges.txt``, without ``transformers``.

The algorithm of the GPT-2 paper's tokenizer, as Megatron-LM's ``GPT2BPETokenizer`` runs it
(``megatron/training/tokenizer/gpt2_tokenization.py`` at core_v0.16.1; written here from the
algorithm, not copied):

1. the text is split into pieces by :data:`GPT2_SPLIT_PATTERN` (contractions, letter runs, digit
   runs, other symbols, whitespace; each optionally led by one space) -- Unicode classes, hence
   the ``regex`` package;
2. each piece's UTF-8 bytes become printable stand-in characters (:func:`byte_symbols`), so a
   vocabulary entry is a string;
3. BPE: the adjacent pair of symbols with the lowest merge rank (its line in ``merges.txt``) is
   merged everywhere in the piece, left to right, until no adjacent pair has a rank;
4. each resulting symbol's id is its ``vocab.json`` entry.

Special tokens get no treatment: a literal ``<|endoftext|>`` in the text is tokenized as text, as
Megatron-LM's tokenizer does. :func:`read_vocab` and :func:`read_merges` refuse files that would
make tokenization lose text or fail midway (:class:`ValueError` with the reason).
"""

from __future__ import annotations

import json
from typing import Sequence

__all__ = ["GPT2_SPLIT_PATTERN", "ByteLevelBPE", "byte_symbols", "read_merges", "read_vocab"]

GPT2_SPLIT_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
"""GPT-2's pre-tokenization pattern (``regex`` syntax)."""

_CACHE_LIMIT = 1 << 17
"""Pieces whose merge result is kept (cleared when full; a corpus repeats most of its words)."""


def byte_symbols() -> list[str]:
    """GPT-2's stand-in character of each byte 0..255 (index = byte).

    Printable Latin-1 bytes (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) stand for themselves; the other
    68 (controls, space, soft hyphen ...) map, in byte order, to ``chr(256)``, ``chr(257)``, ...: a
    space is ``"Ġ"``.
    """
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    out, shifted = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + shifted))
            shifted += 1
    return out


def read_vocab(path: str) -> dict[str, int]:
    """``vocab.json``: a JSON object token -> id with ids ``0..N-1`` and every byte symbol present."""
    with open(path, encoding="utf-8") as f:
        vocab = json.load(f)
    if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
        raise ValueError("not a GPT-2 vocab.json (a JSON object token -> integer id)")
    missing = [s for s in byte_symbols() if s not in vocab]
    if missing:
        raise ValueError(f"lacks {len(missing)} of the 256 byte-level symbols (e.g. {missing[0]!r}); it is not a "
                         f"GPT-2 byte-level BPE vocabulary")
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise ValueError(f"its {len(vocab)} ids are not 0..{len(vocab) - 1}, each once")
    return vocab


def read_merges(path: str, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """``merges.txt``: a ``#version`` header line, then one merge ``A B`` per line, in rank order.

    Megatron-LM skips the first line and the last one (the empty string after the final newline)
    without looking at them; a file without the header or without the final newline would lose a
    merge there, so it is refused instead. Every symbol of a merge, and the merged symbol, must be
    in ``vocab``.
    """
    with open(path, encoding="utf-8") as f:
        text = f.read()
    lines = text.split("\n")
    if not lines[0].startswith("#version"):
        raise ValueError(f"its first line {lines[0][:40]!r} is not the '#version' header, which Megatron-LM skips "
                         f"unread (it would drop a merge); add the header line")
    if not text.endswith("\n"):
        raise ValueError("does not end with a newline: Megatron-LM drops its last line unread (a merge); add it")
    merges = []
    for lineno, line in enumerate(lines[1:-1], start=2):
        parts = line.split(" ")
        if len(parts) != 2 or not all(parts):
            raise ValueError(f"line {lineno} {line[:40]!r} is not a merge 'A B'")
        unknown = [s for s in (parts[0], parts[1], parts[0] + parts[1]) if s not in vocab]
        if unknown:
            raise ValueError(f"line {lineno}: {unknown[0]!r} is not in the vocab file")
        merges.append((parts[0], parts[1]))
    return merges


class ByteLevelBPE:
    """Encodes text to ids and back with a GPT-2 vocabulary and merges (see the module docstring)."""

    def __init__(self, vocab: dict[str, int], merges: Sequence[tuple[str, str]]) -> None:
        import regex  # Unicode property classes (\p{L}, \p{N}), which the standard re lacks

        self.vocab = vocab
        self._tokens = {i: t for t, i in vocab.items()}
        self._ranks = {pair: rank for rank, pair in enumerate(merges)}
        self._split = regex.compile(GPT2_SPLIT_PATTERN)
        self._symbol = byte_symbols()
        self._byte = {s: b for b, s in enumerate(self._symbol)}
        self._cache: dict[str, list[str]] = {}

    def _merge(self, word: str) -> list[str]:
        """BPE of one piece (in byte symbols) -> its vocabulary symbols."""
        done = self._cache.get(word)
        if done is not None:
            return done
        parts = list(word)
        none = len(self._ranks)
        while len(parts) > 1:
            ranks = [self._ranks.get((a, b), none) for a, b in zip(parts, parts[1:])]
            best = min(ranks)
            if best == none:
                break
            pair = parts[ranks.index(best)], parts[ranks.index(best) + 1]
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == pair:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        if len(self._cache) >= _CACHE_LIMIT:
            self._cache.clear()
        self._cache[word] = parts
        return parts

    def encode(self, text: str) -> list[int]:
        """Text -> ids (no special token added, none recognised)."""
        ids: list[int] = []
        for piece in self._split.findall(text):
            word = "".join(self._symbol[b] for b in piece.encode("utf-8"))
            ids.extend(self.vocab[s] for s in self._merge(word))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Ids -> text (bytes that are not valid UTF-8 become U+FFFD, as Megatron-LM's ``errors='replace'``).

        Raises ``KeyError`` for an id outside the vocabulary or a token with a character that is
        no byte symbol (none in a GPT-2 vocabulary).
        """
        symbols = "".join(self._tokens[int(i)] for i in ids)
        return bytes(self._byte[c] for c in symbols).decode("utf-8", errors="replace")

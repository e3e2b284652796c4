"""The ``PREFIX.idx`` / ``PREFIX.bin`` pair of one dataset prefix, checked before any process group starts.

megatron-core's ``IndexedDataset`` (``megatron/core/datasets/indexed_dataset.py``, the same layout in
0.16.1 and 0.19.x) reads an ``.idx`` of: the magic ``MMIDIDX\\x00\\x00`` (9 bytes), the version (``<Q``,
1), the token dtype code (``<B``, :class:`~megatron.core.datasets.indexed_dataset.DType`), the sequence
count ``S`` and the document count ``D`` (``<Q`` each) -- 34 bytes -- then ``S`` sequence lengths
(int32, tokens), ``S`` sequence pointers (int64, byte offsets into the ``.bin``), ``D`` document
indices (int64: ``0``, then the sequence index ending each document, the last one ``S``) and,
written only for multimodal data, ``S`` sequence modes (int8).

It trusts every number: a truncated file, a garbage header or a ``.bin`` of another corpus fails
later, on some ranks, as a raw ``ValueError: offset must be non-negative`` / ``AssertionError: bad
header``, or trains on the wrong bytes. :func:`read_checked_index` reads the ``.idx`` once (numpy
memmap: the arrays are not copied) and raises :class:`DataFileError` naming the file, what is wrong and
the fix; the ``.bin`` is checked by its size only (its contents are never read).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy

__all__ = ["HEADER_BYTES", "INDEX_MAGIC", "DataFileError", "IndexFile", "read_checked_index"]

INDEX_MAGIC = b"MMIDIDX\x00\x00"
"""The first 9 bytes of every megatron-core ``.idx`` file (``indexed_dataset._INDEX_HEADER``)."""
HEADER_BYTES = 34
"""Bytes before the arrays: magic 9 + version 8 + dtype code 1 + sequence count 8 + document count 8."""
DTYPE_ITEMSIZE: dict[int, int] = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}
"""megatron-core's ``DType`` codes -> token size [bytes] (uint8, int8, int16, int32, int64, float64,
float32, uint16)."""
REWRITE = "rewrite it with tools/preprocess_data.py"
BLOCK = 1 << 22
"""Sequences checked at a time (a few 32 MiB arrays)."""


class DataFileError(ValueError):
    """One thing wrong with a dataset prefix's files; ``str(e)`` names the file, the problem and the fix."""


@dataclass(frozen=True)
class IndexFile:
    """The checked ``.idx`` of one prefix: what the split check needs.

    Attributes:
        prefix: the dataset prefix (``prefix + ".idx"``, ``prefix + ".bin"``).
        sequence_lengths: tokens of each sequence, int32 ``[S]`` (a read-only memmap view).
        document_indices: int64 ``[D]``, ``0`` then the sequence index ending each document.
    """

    prefix: str
    sequence_lengths: numpy.ndarray
    document_indices: numpy.ndarray

    @property
    def num_sequences(self) -> int:
        """``S``: the sequences megatron-core's GPT split divides (one per document, unless the corpus was
        preprocessed with ``--split-sentences``)."""
        return int(self.sequence_lengths.shape[0])

    @property
    def num_documents(self) -> int:
        return max(int(self.document_indices.shape[0]) - 1, 0)


def read_checked_index(prefix: str) -> IndexFile:
    """Read and check ``prefix.idx`` against megatron-core's layout and ``prefix.bin``'s size.

    Checks, in order: the header's magic, version and dtype code; the file size equals what its sequence
    and document counts imply (``34 + 12 S + 8 D`` bytes, ``+ S`` with sequence modes); the document
    indices start at 0, never decrease and end at ``S``; no negative length; the pointers are the
    lengths laid end to end (``pointer[i] = sum(length[:i]) * itemsize``); ``.bin`` has exactly
    ``pointer[-1] + length[-1] * itemsize`` bytes. Raises :class:`DataFileError` at the first problem.
    """
    idx = prefix + ".idx"
    size = os.path.getsize(idx)
    with open(idx, "rb") as f:
        head = f.read(HEADER_BYTES)
    if not INDEX_MAGIC.startswith(head[:9]):  # a short file that starts like one is truncated, below
        raise DataFileError(f"{idx} is not a megatron-core index: it starts with {head[:9]!r}, not {INDEX_MAGIC!r} "
                            f"-- pass the prefix of a dataset written by tools/preprocess_data.py, or {REWRITE}")
    if len(head) < HEADER_BYTES:
        raise DataFileError(f"{idx} is truncated: {size} bytes, shorter than the {HEADER_BYTES}-byte header -- "
                            f"{REWRITE}")
    version, code, num_seq, num_doc = struct.unpack("<QBQQ", head[9:])
    if version != 1:
        raise DataFileError(f"{idx} has index version {version}; megatron-core reads version 1 -- {REWRITE}")
    if code not in DTYPE_ITEMSIZE:
        raise DataFileError(f"{idx} names token dtype code {code}, which megatron-core does not know "
                            f"(codes 1 to 8) -- {REWRITE}")
    _check_index_size(idx, size, num_seq, num_doc)
    mm = numpy.memmap(idx, mode="r", dtype=numpy.uint8)
    lengths = numpy.frombuffer(mm, dtype=numpy.int32, count=num_seq, offset=HEADER_BYTES)
    pointers = numpy.frombuffer(mm, dtype=numpy.int64, count=num_seq, offset=HEADER_BYTES + 4 * num_seq)
    documents = numpy.frombuffer(mm, dtype=numpy.int64, count=num_doc, offset=HEADER_BYTES + 12 * num_seq)
    _check_documents(idx, documents, num_seq)
    _check_pointers(prefix, lengths, pointers, DTYPE_ITEMSIZE[code])
    return IndexFile(prefix=prefix, sequence_lengths=lengths, document_indices=documents)


def _check_index_size(idx: str, size: int, num_seq: int, num_doc: int) -> None:
    """The ``.idx`` holds exactly its arrays (with or without the optional int8 sequence modes)."""
    need = HEADER_BYTES + 12 * num_seq + 8 * num_doc
    if size in (need, need + num_seq):
        return
    counts = f"its header counts {num_seq} sequences and {num_doc} document indices, which need {need} bytes"
    if size < need:
        raise DataFileError(f"{idx} is truncated: {counts}; the file has {size} -- {REWRITE}")
    raise DataFileError(f"{idx} is longer than its header says: {counts} ({need + num_seq} with sequence modes); "
                        f"the file has {size} -- {REWRITE}")


def _check_documents(idx: str, documents: numpy.ndarray, num_seq: int) -> None:
    """Document boundaries: ``0``, non-decreasing, ending at the sequence count."""
    if documents.shape[0] == 0:
        raise DataFileError(f"{idx} has no document indices (megatron-core's index always starts them with 0) "
                            f"-- {REWRITE}")
    if documents[0] != 0 or documents[-1] != num_seq or not numpy.all(documents[1:] >= documents[:-1]):
        raise DataFileError(f"{idx} has broken document indices: they must start at 0, never decrease and end at "
                            f"the sequence count {num_seq}; they start at {int(documents[0])} and end at "
                            f"{int(documents[-1])} -- {REWRITE}")


def _check_pointers(prefix: str, lengths: numpy.ndarray, pointers: numpy.ndarray, itemsize: int) -> None:
    """Sequence pointers are the lengths laid end to end, and the ``.bin`` ends where the last one does
    (read in blocks of :data:`BLOCK` sequences: bounded memory on every rank, whatever the corpus)."""
    idx, bin_path = prefix + ".idx", prefix + ".bin"
    start = 0  # [bytes] where the block's first sequence must start
    for lo in range(0, lengths.shape[0], BLOCK):
        block = lengths[lo:lo + BLOCK].astype(numpy.int64)
        if block.min() < 0:
            raise DataFileError(f"{idx} has a negative sequence length ({int(block.min())} tokens) -- {REWRITE}")
        starts = start + numpy.concatenate(([0], numpy.cumsum(block[:-1] * itemsize)))
        wrong = numpy.flatnonzero(pointers[lo:lo + BLOCK] != starts)
        if wrong.size:
            bad = int(wrong[0])
            raise DataFileError(f"{idx} has broken sequence pointers: sequence {lo + bad} starts at byte "
                                f"{int(pointers[lo + bad])}, its predecessors' lengths put it at {int(starts[bad])} "
                                f"-- {REWRITE}")
        start = int(starts[-1] + block[-1] * itemsize)
    have = os.path.getsize(bin_path)
    if have == start:
        return
    counts = (f"{idx} counts {lengths.shape[0]} sequences of {start // itemsize} tokens ({itemsize}-byte), which "
              f"end at byte {start}; {bin_path} has {have} bytes")
    if have < start:
        raise DataFileError(f"{bin_path} is truncated, or is not {idx}'s data: {counts} -- rewrite both with "
                            f"tools/preprocess_data.py")
    raise DataFileError(f"{bin_path} and {idx} are not one pair (two corpora?): {counts} -- rewrite both with "
                        f"tools/preprocess_data.py")

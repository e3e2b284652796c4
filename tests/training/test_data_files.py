"""Damaged dataset files and splits megatron-core cannot build: one line each, exit 2, before any process group.

Corpora are written with megatron-core's own ``IndexedDatasetBuilder``; every expected number below is
computed from what the test wrote (documents x tokens x 4-byte int32 tokens, megatron-core's 34-byte
header), not by the checker.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import numpy
import pytest
import torch

from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron_zb.training import pretrain
from megatron_zb.training.arguments import ArgumentError

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--global-batch-size 8 --train-iters 10 --lr 1e-4 --num-workers 0 --eval-interval 5 --eval-iters 2 "
        "--tokenizer-type NullTokenizer --vocab-size 100")
TOKENS = 5
"""Tokens per document of every corpus here (int32: 4 bytes each)."""


def write_corpus(prefix: Path, documents: int, tokens: int = TOKENS) -> str:
    """``documents`` documents of ``tokens`` int32 tokens at ``prefix`` (.bin and .idx); returns the prefix."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=numpy.int32)
    for _ in range(documents):
        builder.add_document(numpy.arange(tokens, dtype=numpy.int32), [tokens])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def idx_bytes(documents: int) -> int:
    """megatron-core's .idx size for one sequence per document: header, lengths, pointers, document indices."""
    return 34 + documents * (4 + 8) + (documents + 1) * 8


def refusal(extra: str) -> ArgumentError:
    with pytest.raises(ArgumentError) as e:
        pretrain.parse_command_line(shlex.split(f"{BASE} {extra}"), world_size=1)
    return e.value


def exits_with_one_line(extra: str, capsys) -> str:
    """``pretrain.main`` exits 2 with one stderr line and no process group; returns the line."""
    capsys.readouterr()
    assert pretrain.main(shlex.split(f"{BASE} {extra}")) == 2
    assert not torch.distributed.is_initialized()
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


@pytest.fixture(scope="module")
def corpus400(tmp_path_factory) -> str:
    return write_corpus(tmp_path_factory.mktemp("c400") / "corpus", 400)


def test_intact_corpus_passes_with_a_split_that_gives_every_split_documents(corpus400):
    args = pretrain.parse_command_line(shlex.split(f"{BASE} --data-path {corpus400} --split 90,5,5"),
                                       world_size=1).args
    assert args.data_blend == ([corpus400], None)


def test_default_split_of_400_documents_is_refused_before_any_process_group(corpus400, capsys):
    # 969,30,1 of 400: the test split is sequences round(0.999 * 400) = 400 .. 400, none; it must serve
    # eval_iters * global_batch_size = 2 * 8 test samples
    e = refusal(f"--data-path {corpus400}")
    assert [p.flag for p in e.problems] == ["--split"]
    text = e.problems[0].text
    assert text.startswith(f"--split: 969,30,1 gives the test split of --data-path {corpus400} 0 of its 400 "
                           f"sequences (0 tokens), and it must serve {2 * 8} test samples: ")
    assert "loop forever" in text and "--split 90,5,5" in text and "\n" not in text
    err = exits_with_one_line(f"--data-path {corpus400}", capsys)
    assert err.endswith(text + "\n")


def _truncate(path: str, keep: int) -> None:
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[:keep])


def _damage(kind: str, tmp_path: Path) -> tuple[str, list[str]]:
    """A damaged 400-document prefix and the phrases (with its numbers) its line must hold."""
    prefix = write_corpus(tmp_path / "corpus", 400)
    bin_bytes, idx_size = 400 * TOKENS * 4, idx_bytes(400)
    if kind == "truncated .bin":
        _truncate(prefix + ".bin", bin_bytes - 10)
        return prefix, [f"{prefix}.bin is truncated", f"end at byte {bin_bytes}", f"has {bin_bytes - 10} bytes"]
    if kind == "truncated .idx":
        _truncate(prefix + ".idx", idx_size - 100)
        return prefix, [f"{prefix}.idx is truncated", "400 sequences and 401 document indices",
                        f"need {idx_size} bytes", f"the file has {idx_size - 100}"]
    if kind == "garbage header":
        data = bytearray(Path(prefix + ".idx").read_bytes())
        data[:9] = b"GARBAGE!!"
        Path(prefix + ".idx").write_bytes(bytes(data))
        return prefix, [f"{prefix}.idx is not a megatron-core index", "b'GARBAGE!!'"]
    # a mismatched pair: this corpus's .idx (300 documents) with the 400-document corpus's .bin
    other = write_corpus(tmp_path / "other", 300)
    Path(prefix + ".idx").write_bytes(Path(other + ".idx").read_bytes())
    return prefix, [f"{prefix}.bin and {prefix}.idx are not one pair", f"end at byte {300 * TOKENS * 4}",
                    f"has {bin_bytes} bytes"]


@pytest.mark.parametrize("kind", ["truncated .bin", "truncated .idx", "garbage header", "mismatched pair"])
def test_damaged_files_are_one_line_each_before_any_process_group(kind, tmp_path, capsys):
    prefix, phrases = _damage(kind, tmp_path)
    err = exits_with_one_line(f"--data-path {prefix} --split 90,5,5", capsys)
    assert err.startswith(f"{pretrain.PROG}: error: --data-path: ")
    for phrase in phrases:
        assert phrase in err, (phrase, err)
    assert "tools/preprocess_data.py" in err


def test_document_indices_that_do_not_end_at_the_sequence_count(tmp_path):
    prefix = write_corpus(tmp_path / "corpus", 400)
    data = bytearray(Path(prefix + ".idx").read_bytes())
    data[-8:] = (399).to_bytes(8, "little")  # the last document index: 399, not the 400 sequences
    Path(prefix + ".idx").write_bytes(bytes(data))
    e = refusal(f"--data-path {prefix} --split 90,5,5")
    assert str(e).startswith(f"--data-path: {prefix}.idx has broken document indices")
    assert "sequence count 400; they start at 0 and end at 399" in str(e)


def test_every_damaged_prefix_is_named_with_its_flag(corpus400, tmp_path):
    bad, phrases = _damage("truncated .idx", tmp_path)
    e = refusal(f"--train-data-path {corpus400} --valid-data-path {bad} --test-data-path {bad}")
    assert [p.flag for p in e.problems] == ["--valid-data-path"]  # one prefix, read once
    assert all(p in e.problems[0].text for p in phrases)
    e = refusal(f"--data-path {bad} {corpus400} --split 90,5,5")
    assert [p.flag for p in e.problems] == ["--data-path"] and bad + ".idx" in str(e)


def test_blend_by_size_needs_a_sample_in_every_member_split(corpus400, tmp_path):
    # 97,1,2 of 400 documents: validation gets round(0.98 * 400) - round(0.97 * 400) = 4 documents of 5 tokens,
    # 20 < seq_length + 1 = 33 tokens; a weighted blend only needs tokens (megatron-core runs more epochs)
    other = write_corpus(tmp_path / "other", 400)
    e = refusal(f"--data-path {corpus400} {other} --split 97,1,2")
    assert [p.flag for p in e.problems] == ["--split", "--split"]
    assert "validation split of --data-path" in e.problems[0].text and "4 of its 400 sequences (20 tokens)" in str(e)
    assert f"{(10 // 5 + 1) * 2 * 8} validation samples" in str(e)
    pretrain.parse_command_line(shlex.split(f"{BASE} --data-path 1 {corpus400} 1 {other} --split 97,1,2"),
                                world_size=1)


def test_per_split_path_without_tokens_is_refused(corpus400, tmp_path):
    empty = write_corpus(tmp_path / "empty", 3, tokens=0)
    e = refusal(f"--train-data-path {corpus400} --valid-data-path {empty}")
    assert [p.flag for p in e.problems] == ["--valid-data-path"]
    assert e.problems[0].text.startswith(f"--valid-data-path: {empty} has 3 sequences (0 tokens) and it must serve "
                                         f"{(10 // 5 + 1) * 2 * 8} validation samples")

"""Tokenizers, tools/preprocess_data.py, datasets and micro-batch iterators (megatron-core 0.16.1)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shlex
import tempfile
from pathlib import Path

import numpy
import pytest
import torch

from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.tokenizers import MegatronTokenizerBase
from megatron_zb.testing import run_distributed
from megatron_zb.training import data
from megatron_zb.training.arguments import ArgumentError
from megatron_zb.training.pretrain import parse_command_line
from megatron_zb.training.run_config import run_config

REPO = Path(__file__).resolve().parents[2]
BASE = ("--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--global-batch-size 8 --train-iters 10 --lr 1e-4 --num-workers 0 --eval-interval 5 --eval-iters 2")
TEXTS = [f"document {i}: " + "héllo wörld, zero bubbles! " * (i % 5 + 1) for i in range(40)]


def resolve(extra: str, *, world_size: int = 1):
    """``pretrain_gpt_zb.py``'s validated args of ``BASE + extra`` (what :func:`run_config` reads)."""
    return parse_command_line(shlex.split(BASE + " " + extra), world_size=world_size).args


def load_preprocess():
    spec = importlib.util.spec_from_file_location("preprocess_data", REPO / "tools" / "preprocess_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """A small JSONL corpus preprocessed to .bin/.idx; returns the dataset prefix."""
    d = tmp_path_factory.mktemp("corpus")
    jsonl = d / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(TEXTS)))
    [prefix] = load_preprocess().main(["--input", str(jsonl), "--output-prefix", str(d / "out" / "corpus"),
                                       "--log-interval", "16"])
    return prefix


# ---------------------------------------------------------------------------- tokenizers
def test_byte_level_tokenizer():
    tok = data.build_tokenizer("ByteLevel")
    assert isinstance(tok, MegatronTokenizerBase)
    assert (tok.vocab_size, tok.eod, tok.pad) == (258, 256, 257)
    ids = tok.tokenize("héllo")
    assert ids == list("héllo".encode("utf-8")) and max(ids) < 256
    assert tok.detokenize(ids + [tok.eod, tok.pad]) == "héllo"
    assert tok.unique_identifiers["vocab_size"] == 258


def test_null_tokenizer():
    tok = data.build_tokenizer("NullTokenizer", vocab_size=100)
    assert (tok.vocab_size, tok.eod) == (101, 100)
    assert tok.tokenize("3 1 4") == [3, 1, 4] and tok.detokenize([3, 1, 4]) == "3 1 4"
    with pytest.raises(data.TokenizerError, match="outside 0..99"):
        tok.tokenize("100")
    with pytest.raises(data.TokenizerError, match="--vocab-size"):
        data.build_tokenizer("NullTokenizer")


def test_hf_tokenizer_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(data.TokenizerError, match="does not exist.*--tokenizer-model.*never downloaded"):
        data.build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "missing"))
    with pytest.raises(data.TokenizerError, match="^--tokenizer-model: is required with --tokenizer-type "
                                                  "HuggingFaceTokenizer"):
        data.build_tokenizer("HuggingFaceTokenizer")
    with pytest.raises(ArgumentError, match="^--tokenizer-model: tokenizer path .* does not exist"):
        resolve(f"--mock-data --tokenizer-type HuggingFaceTokenizer --tokenizer-model {tmp_path / 'missing'}")


# transformers missing, GPT2BPETokenizer, a saved HuggingFace tokenizer: tests/training/test_tokenizers.py


# ---------------------------------------------------------------------------- preprocessing
def test_preprocessed_corpus_reads_back_through_indexed_dataset(corpus):
    tok = data.ByteLevelTokenizer()
    ds = IndexedDataset(corpus)
    assert len(ds) == len(TEXTS)
    assert ds.index.dtype == numpy.uint16
    for i in (0, 7, len(TEXTS) - 1):
        assert ds[i].tolist() == tok.tokenize(TEXTS[i]) + [tok.eod]


def test_preprocess_plain_text_without_eod(tmp_path):
    src = tmp_path / "book.txt"
    src.write_text("first line\n\nsecond line\n")
    [prefix] = load_preprocess().main(["--input", str(src), "--output-prefix", str(tmp_path / "book"),
                                       "--no-append-eod"])
    assert prefix == str(tmp_path / "book_text_document")
    ds = IndexedDataset(prefix)
    assert [bytes(ds[i].tolist()).decode() for i in range(len(ds))] == ["first line", "second line"]


def test_preprocess_errors(tmp_path, capsys):
    pre = load_preprocess()
    src = tmp_path / "c.jsonl"
    src.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(SystemExit, match="no string value for key 'text'"):
        pre.main(["--input", str(src), "--output-prefix", str(tmp_path / "o")])
    with pytest.raises(SystemExit) as info:  # a bad tokenizer flag: argparse's exit status 2, one error line
        pre.main(["--input", str(src), "--output-prefix", str(tmp_path / "o"), "--json-keys", "body",
                  "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path / "nope")])
    assert info.value.code == 2
    assert "error: --tokenizer-model: tokenizer path" in capsys.readouterr().err


def test_preprocess_help_does_not_import_megatron_core():
    """``tools/preprocess_data.py --help`` lists the tokenizer flags and exits 0 without importing
    megatron-core (a fresh interpreter: this one has imported it)."""
    import subprocess
    import sys

    code = ("import runpy, sys\n"
            "sys.argv = ['preprocess_data.py', '--help']\n"
            "try:\n"
            f"    runpy.run_path({str(REPO / 'tools' / 'preprocess_data.py')!r}, run_name='__main__')\n"
            "except SystemExit as e:\n"
            "    assert e.code == 0, e.code\n"
            "print('MEGATRON_CORE_IMPORTED' if 'megatron.core' in sys.modules else 'MEGATRON_CORE_NOT_IMPORTED')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--tokenizer-type" in proc.stdout and "--output-prefix" in proc.stdout
    assert proc.stdout.strip().endswith("MEGATRON_CORE_NOT_IMPORTED"), proc.stdout[-500:]


# ---------------------------------------------------------------------------- datasets
def test_gpt_dataset_from_preprocessed_corpus(corpus, tmp_path):
    args = resolve(f"--data-path {corpus} --split 8,1,1 --data-cache-path {tmp_path / 'cache'}")
    train, valid, test = data.build_datasets(run_config(args))
    assert all(isinstance(d, GPTDataset) for d in (train, valid, test))
    n_train, n_valid, n_test = data.train_valid_test_num_samples(run_config(args))
    assert (n_train, n_valid, n_test) == (80, 48, 16)
    assert len(train) >= n_train and len(valid) >= n_valid and len(test) >= n_test
    assert any(p.name.endswith("GPTDataset-train-shuffle_index.npy") for p in (tmp_path / "cache").iterdir())
    sample = train[0]
    assert sample["tokens"].shape == (32,) and torch.equal(sample["tokens"][1:], sample["labels"][:-1])
    text = bytes(t for t in sample["tokens"].tolist() if t < 256).decode("utf-8", errors="ignore")
    assert "llo w" in text or "document" in text or "bubbles" in text


def test_blend_builds_without_a_process_group(corpus, tmp_path):
    args = resolve(f"--data-path 0.3 {corpus} 0.7 {corpus} --split 8,1,1 --data-cache-path {tmp_path / 'cache'}")
    train, _, _ = data.build_datasets(run_config(args))
    assert isinstance(train, BlendedDataset) and len(train) >= 80
    assert not torch.distributed.is_initialized()  # the temporary one-process group is gone again


def test_mock_data_iterator_shapes():
    args = resolve("--mock-data")
    assert all(isinstance(d, MockGPTDataset) for d in data.build_datasets(run_config(args)))
    train, valid, test = data.build_data_iterators(run_config(args))
    for it in (train, valid, test):
        batch = next(it)
        assert set(batch) == set(data.BATCH_KEYS)
        assert batch["tokens"].shape == (2, 32) and batch["tokens"].dtype == torch.int64
        assert batch["labels"].shape == (2, 32) and batch["labels"].dtype == torch.int64
        assert batch["position_ids"].shape == (2, 32) and torch.equal(batch["position_ids"][0], torch.arange(32))
        assert batch["loss_mask"].shape == (2, 32) and batch["loss_mask"].dtype == torch.float32
        assert batch["attention_mask"].shape == (2, 1, 32, 32) and batch["attention_mask"].dtype == torch.bool
        assert torch.equal(batch["attention_mask"][0, 0], ~torch.ones(32, 32, dtype=torch.bool).tril())
        assert torch.equal(batch["labels"][:, :-1], batch["tokens"][:, 1:])
    assert data.get_batch(None) is None
    assert data.get_batch(train, device="cpu")["tokens"].device.type == "cpu"


def _first_batches(args, n: int = 4) -> list[dict[str, torch.Tensor]]:
    train, _, _ = data.build_data_iterators(run_config(args), pipeline_rank=0)
    return [next(train) for _ in range(n)]


def test_datasets_identical_across_schedules():
    ref = _first_batches(resolve("--mock-data --pipeline-model-parallel-size 2", world_size=2))
    for extra in ("--pipeline-model-parallel-size 2 --enable-zero-bubble",
                  "--pipeline-model-parallel-size 2 --zero-bubble-v-schedule --zero-bubble-v-schedule-mem-setup min",
                  "--pipeline-model-parallel-size 2 --schedule zb-h1"):
        got = _first_batches(resolve("--mock-data " + extra, world_size=2))
        assert all(torch.equal(a[k], b[k]) for a, b in zip(ref, got) for k in data.BATCH_KEYS), extra


def test_data_parallel_ranks_take_disjoint_slices_and_resume():
    args = resolve("--mock-data", world_size=2)  # DP 2: global batch 8 = 2 micro batches x 2 samples x 2 ranks
    assert args.data_parallel_size == 2
    s0 = list(data.MicroBatchSampler(total_samples=20, consumed_samples=0, micro_batch_size=2, data_parallel_rank=0,
                                     data_parallel_size=2))
    s1 = list(data.MicroBatchSampler(total_samples=20, consumed_samples=0, micro_batch_size=2, data_parallel_rank=1,
                                     data_parallel_size=2))
    assert s0 == [[0, 1], [4, 5], [8, 9], [12, 13], [16, 17]] and s1 == [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19]]
    resumed = data.MicroBatchSampler(total_samples=20, consumed_samples=8, micro_batch_size=2, data_parallel_rank=1,
                                     data_parallel_size=2)
    assert list(resumed) == s1[2:] and len(resumed) == 3
    train_ds, _, _ = data.build_datasets(run_config(args))
    it0, _, _ = data.build_data_iterators(run_config(args), datasets=(train_ds, None, None), data_parallel_rank=0)
    it1, _, _ = data.build_data_iterators(run_config(args), datasets=(train_ds, None, None), data_parallel_rank=1)
    b0, b1 = next(it0), next(it1)
    assert torch.equal(b0["tokens"], torch.stack([train_ds[0]["tokens"], train_ds[1]["tokens"]]))
    assert torch.equal(b1["tokens"], torch.stack([train_ds[2]["tokens"], train_ds[3]["tokens"]]))
    late, _, _ = data.build_data_iterators(run_config(args), datasets=(train_ds, None, None), consumed_train_samples=8,
                                           data_parallel_rank=0)
    assert torch.equal(next(late)["tokens"], torch.stack([train_ds[8]["tokens"], train_ds[9]["tokens"]]))


def test_only_first_and_last_stage_ranks_consume_data():
    consumes = data.pipeline_rank_consumes_data
    assert [consumes(r, pipeline_size=4, placement="plain") for r in range(4)] == [True, False, False, True]
    assert [consumes(r, pipeline_size=4, placement="interleaved") for r in range(4)] == [True, False, False, True]
    assert [consumes(r, pipeline_size=4, placement="v") for r in range(4)] == [True, False, False, False]
    args = resolve("--mock-data --pipeline-model-parallel-size 4", world_size=4)
    assert data.build_data_iterators(run_config(args), pipeline_rank=1) == (None, None, None)


def test_cache_dir_resolution(tmp_path):
    a = run_config(resolve("--mock-data")).data
    assert data.resolve_data_cache_dir(a) is None
    a = dataclasses.replace(a, mock_data=False, save=str(tmp_path / "ckpt"))
    assert data.resolve_data_cache_dir(a) == str(tmp_path / "ckpt" / "data_cache")
    a = dataclasses.replace(a, data_cache_path=str(tmp_path / "c"))
    assert data.resolve_data_cache_dir(a) == str(tmp_path / "c")
    a = dataclasses.replace(a, data_cache_path=None, save=None)
    assert data.resolve_data_cache_dir(a) == os.path.join(tempfile.gettempdir(), "megatron_zb_data_cache")


def _two_rank_build(prefix: str, cache: str) -> dict[str, object]:
    rank = torch.distributed.get_rank()
    out: dict[str, object] = {}
    for name, extra in (("1f1b", ""), ("zbv", "--zero-bubble-v-schedule")):
        args = resolve(f"--data-path {prefix} --split 8,1,1 --data-cache-path {cache} "
                       f"--pipeline-model-parallel-size 2 {extra}", world_size=2)
        train, _, _ = data.build_data_iterators(run_config(args), pipeline_rank=rank, data_parallel_rank=0)
        out[name] = None if train is None else next(train)["tokens"]
    return out


def test_two_ranks_build_on_rank_0_then_share_the_cache(corpus, tmp_path):
    r0, r1 = run_distributed(_two_rank_build, world_size=2, args=(corpus, str(tmp_path / "cache")), timeout=120)
    # 1F1B, PP=2: both ranks read data (first and last stage); rank 1 loads rank 0's cache
    assert r0["1f1b"] is not None and torch.equal(r0["1f1b"], r1["1f1b"])
    # V, PP=2: rank 0 holds the first and the last stage, rank 1 reads nothing; same samples
    assert torch.equal(r0["zbv"], r0["1f1b"]) and r1["zbv"] is None
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".megatron_zb_visible")]


# ---------------------------------------------------------------------------- per-split paths
@pytest.fixture(scope="module")
def second_corpus(tmp_path_factory) -> str:
    """Another corpus (different documents) for the validation split."""
    d = tmp_path_factory.mktemp("corpus2")
    jsonl = d / "valid.jsonl"
    jsonl.write_text("".join(json.dumps({"text": f"validation text {i} " * 9}) + "\n" for i in range(30)))
    [prefix] = load_preprocess().main(["--input", str(jsonl), "--output-prefix", str(d / "out" / "valid")])
    return prefix


def test_train_valid_test_data_paths_build_one_dataset_per_split(corpus, second_corpus, tmp_path):
    args = resolve(f"--train-data-path 0.3 {corpus} 0.7 {corpus} --valid-data-path {second_corpus} "
                   f"--data-cache-path {tmp_path / 'cache'}")
    assert args.data_blend is None
    assert args.data_blend_per_split == [([corpus, corpus], [0.3, 0.7]), ([second_corpus], None), None]
    train, valid, test = data.build_datasets(run_config(args))
    assert isinstance(train, BlendedDataset) and isinstance(valid, GPTDataset) and test is None
    text = bytes(t for t in valid[0]["tokens"].tolist() if t < 256).decode("utf-8", errors="ignore")
    assert "validation text" in text  # the validation split reads its own corpus, not a slice of the train one
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("extra,flag", [
    ("--mock-data --train-data-path {c}", "--mock-data"),
    ("--data-path {c} --train-data-path {c}", "--data-path"),
    ("--valid-data-path {c}", "--train-data-path"),
    ("--train-data-path {c} --test-data-path {c}_missing", "--test-data-path"),
    ("--train-data-path 0.5 {c} 0.5", "--train-data-path"),
])
def test_per_split_data_path_errors_name_the_flag(corpus, extra, flag):
    with pytest.raises(ArgumentError) as e:
        resolve(extra.format(c=corpus))
    assert e.value.flag == flag


# ---------------------------------------------------------------------------- --no-mmap-bin-files, attention mask
def _batches(args, n: int = 6) -> list[dict[str, torch.Tensor]]:
    datasets = data.build_datasets(run_config(args))
    train, _, _ = data.build_data_iterators(run_config(args), datasets=datasets, data_parallel_rank=0)
    return datasets[0], [next(train) for _ in range(n)]


def test_no_mmap_bin_files_reads_the_same_batches(corpus, tmp_path):
    """GPTDatasetConfig.mmap_bin_files=False: megatron-core reads the .bin with file reads, same batches."""
    base = f"--data-path {corpus} --split 8,1,1 --data-cache-path {tmp_path / 'cache'}"
    mmap_ds, mmap_batches = _batches(resolve(base))
    file_ds, file_batches = _batches(resolve(base + " --no-mmap-bin-files"))
    assert mmap_ds.config.mmap_bin_files and not file_ds.config.mmap_bin_files
    assert type(mmap_ds.dataset.bin_reader).__name__ == "_MMapBinReader"
    assert type(file_ds.dataset.bin_reader).__name__ == "_FileBinReader"
    for a, b in zip(mmap_batches, file_batches):
        assert set(a) == set(b) == set(data.BATCH_KEYS) and all(torch.equal(a[k], b[k]) for k in a)


def test_no_attention_mask_in_dataloader_leaves_the_rest_of_the_batch(corpus, tmp_path):
    """GPTDatasetConfig.create_attention_mask=False: the batch has no attention_mask, the rest is the same."""
    for source in (f"--data-path {corpus} --split 8,1,1 --data-cache-path {tmp_path / 'cache'}", "--mock-data"):
        _, with_mask = _batches(resolve(source))
        _, without = _batches(resolve(source + " --no-create-attention-mask-in-dataloader"))
        for a, b in zip(with_mask, without):
            assert set(b) == set(data.BATCH_KEYS) - {"attention_mask"} and "attention_mask" in a
            assert all(torch.equal(a[k], b[k]) for k in b)
            assert "attention_mask" not in data.get_batch(iter([b]), device="cpu")


def test_no_attention_mask_with_reset_attention_mask_is_refused():
    """Megatron-LM then drops the per-document mask silently (its dataset builds none)."""
    with pytest.raises(ArgumentError, match="^--no-create-attention-mask-in-dataloader: with --reset-attention-mask"):
        resolve("--mock-data --reset-attention-mask --no-create-attention-mask-in-dataloader")


def test_loss_curve_without_the_dataloader_mask_and_mmap_is_bitwise_the_same(corpus, tmp_path):
    """pretrain_gpt_zb.py's trainer (in-process, 2 ranks, PP=2, greedy zero bubble, dropout on, real
    data): without the dataloader's attention mask the first stage's attention builds megatron-core's
    causal mask itself -- every iteration's lm loss and grad norm bitwise equal (with --no-mmap-bin-files
    too, which reads the same tokens)."""
    from harness.pretrain_harness import in_process

    argv = shlex.split(f"--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
                       f"--global-batch-size 8 --train-iters 4 --lr 2e-3 --num-workers 0 --eval-iters 0 "
                       f"--log-interval 1 --data-path {corpus} --split 8,1,1 --data-cache-path {tmp_path / 'cache'} "
                       f"--pipeline-model-parallel-size 2 --enable-zero-bubble --distributed-backend gloo "
                       f"--pipeline-timeout-seconds 60 --distributed-timeout-minutes 2")
    ref = in_process(tmp_path, "mask", 2, argv)["values"]["train"]
    got = in_process(tmp_path, "no_mask", 2, argv + ["--no-create-attention-mask-in-dataloader",
                                                      "--no-mmap-bin-files"])["values"]["train"]
    assert [r["iteration"] for r in ref] == [1, 2, 3, 4]
    for a, b in zip(ref, got):
        assert (a["lm loss"], a["grad norm"]) == (b["lm loss"], b["grad norm"]), (a, b)

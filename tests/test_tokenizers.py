"""GPT2BPETokenizer (--vocab-file / --merge-file) and HuggingFaceTokenizer (--tokenizer-model) from
files each test writes itself (nothing downloaded); expected ids are worked out by hand below.

The tiny GPT-2 vocabulary: ids 0-255 are the 256 byte-level symbols in byte order (GPT-2's
``bytes_to_unicode``: printable bytes map to themselves, the others -- space included -- to
``chr(256 + n)``, so space is ``"Ġ"`` = id 32), then one token per merge, then ``<|endoftext|>``:

=====  ===========  ====    BPE applies the lowest-ranked merge present, repeatedly:
rank   merge        id      "hello"  -> h e l l o -> he l l o -> he ll o -> hell o -> hello = [259]
=====  ===========  ====    " world" -> Ġ w o r l d -> Ġw o r l d -> Ġw or l d = [260, 261, 108, 100]
1      h e          256     "held"   -> h e l d -> he l d                      = [256, 108, 100]
2      l l          257     " hello" -> Ġ hello (no merge "Ġ hello")           = [32, 259]
3      he ll        258     "héllo"  -> h Ã © l l o (é = bytes C3 A9, both printable)
4      hell o       259                -> h Ã © ll o                           = [104, 195, 169, 257, 111]
5      Ġ w          260
6      o r          261     ``<|endoftext|>`` = 262 (EOD), vocabulary 263.
=====  ===========  ====
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import sys
from pathlib import Path

import numpy
import pytest
import torch

from megatron.core.datasets.gpt_dataset import GPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.tokenizers import MegatronTokenizerBase
from megatron_zb.training import data, tokenizers
from megatron_zb.training.arguments import ArgumentError, parse_args, validate_args

needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="transformers is not installed (it is in the test extra: pip install "
                                               "-e .[test])")

REPO = Path(__file__).resolve().parents[1]
BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 8 --micro-batch-size 1 "
        "--global-batch-size 2 --train-iters 4 --lr 1e-4 --num-workers 0 --eval-interval 2 --eval-iters 1")
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r"]
EOD = 262
HELLO_WORLD = [259, 260, 261, 108, 100]


def byte_symbols() -> list[str]:
    """GPT-2's byte -> symbol table (``bytes_to_unicode`` of the GPT-2 paper's encoder.py), by byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, n = [], 0
    for b in range(256):
        if b in printable:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + n))
            n += 1
    return symbols


def write_gpt2_files(d: Path, *, vocab_edit=None) -> tuple[str, str]:
    tokens = byte_symbols() + [m.replace(" ", "") for m in MERGES] + ["<|endoftext|>"]
    vocab = {t: i for i, t in enumerate(tokens)}
    if vocab_edit:
        vocab_edit(vocab)
    (d / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (d / "merges.txt").write_text("#version: 0.2\n" + "\n".join(MERGES) + "\n", encoding="utf-8")
    return str(d / "vocab.json"), str(d / "merges.txt")


@pytest.fixture
def gpt2_files(tmp_path) -> tuple[str, str]:
    return write_gpt2_files(tmp_path)


def resolve(extra: str):
    return validate_args(parse_args(shlex.split(BASE + " " + extra)), world_size=1)


def gpt2_flags(files: tuple[str, str]) -> str:
    return f"--tokenizer-type GPT2BPETokenizer --vocab-file {files[0]} --merge-file {files[1]}"


# ---------------------------------------------------------------------------- GPT2BPETokenizer
@needs_transformers
def test_the_test_vocabulary_is_gpt2_byte_level():
    """The hand-written table agrees with the byte-level alphabet of the ``tokenizers`` library."""
    from tokenizers.pre_tokenizers import ByteLevel
    symbols = byte_symbols()
    assert sorted(symbols) == sorted(ByteLevel.alphabet())
    assert (symbols[32], symbols[ord("h")], symbols[0xC3], symbols[0xA9]) == ("Ġ", "h", "Ã", "©")


@needs_transformers
def test_gpt2_bpe_ids_by_hand(gpt2_files):
    tok = data.build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files[0], merge_file=gpt2_files[1])
    assert isinstance(tok, MegatronTokenizerBase) and isinstance(tok, tokenizers.GPT2BPETokenizer)
    assert (tok.vocab_size, tok.eod, tok.eos) == (263, EOD, EOD)
    assert not hasattr(tok, "pad")  # as Megatron-LM's: megatron-core's datasets use their own pad id
    assert tok.tokenize("hello world") == HELLO_WORLD
    assert tok.tokenize("held") == [256, 108, 100]
    assert tok.tokenize("hello hello") == [259, 32, 259]
    assert tok.tokenize("héllo") == [104, 195, 169, 257, 111]
    assert tok.tokenize("hello, world!") == [259, ord(","), *HELLO_WORLD[1:], ord("!")]
    assert tok.tokenize("hello<|endoftext|>") == [259, EOD]  # the docstring's claim (HuggingFace's behaviour)
    assert tok.detokenize(HELLO_WORLD + [EOD]) == "hello world<|endoftext|>"
    assert tok.vocab["Ġw"] == 260 and tok.unique_identifiers["vocab_size"] == 263


@needs_transformers
def test_gpt2_bpe_round_trip(gpt2_files):
    tok = data.build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files[0], merge_file=gpt2_files[1])
    text = "hello world. It's 3 héllo  wörld\tzero bubble ,  spaces \n\nnew line 😀"
    ids = tok.tokenize(text)
    assert tok.detokenize(ids) == text
    assert all(0 <= i < 262 for i in ids) and 259 in ids  # no EOD, the merges applied


@needs_transformers
def test_gpt2_bpe_through_validate_args(gpt2_files):
    args = resolve(f"--mock-data {gpt2_flags(gpt2_files)}")
    assert (args.vocab_size, args.tokenizer_vocab_size, args.padded_vocab_size) == (263, 263, 384)  # 3 * 128
    assert data.tokenizer_from_args(args).tokenize("hello world") == HELLO_WORLD


@needs_transformers
@pytest.mark.parametrize("extra, flag, also", [
    ("--tokenizer-type GPT2BPETokenizer --merge-file {m}", "--vocab-file", "is required with --tokenizer-type "
                                                                           "GPT2BPETokenizer"),
    ("--tokenizer-type GPT2BPETokenizer --vocab-file {v}", "--merge-file", "merges.txt"),
    ("--tokenizer-type GPT2BPETokenizer --vocab-file {v} --merge-file {v}.missing", "--merge-file", "is not a file"),
    ("--vocab-file {v} --merge-file {m}", "--vocab-file", "only read by --tokenizer-type GPT2BPETokenizer"),
    ("--tokenizer-type HuggingFaceTokenizer --tokenizer-model {d} --merge-file {m}", "--merge-file",
     "not HuggingFaceTokenizer"),
    ("--tokenizer-type GPT2BPETokenizer --vocab-file {v} --merge-file {m} --tokenizer-model {d}",
     "--tokenizer-model", "only read by --tokenizer-type HuggingFaceTokenizer"),
    ("--tokenizer-type GPT2BPETokenizer --vocab-file {v} --merge-file {m} --vocab-size 100", "--vocab-size",
     "smaller than the GPT2BPETokenizer tokenizer's 263 tokens"),
])
def test_gpt2_bpe_bad_flags_name_the_flag(gpt2_files, extra, flag, also):
    v, m = gpt2_files
    with pytest.raises(ArgumentError) as info:
        resolve("--mock-data " + extra.format(v=v, m=m, d=Path(v).parent))
    assert info.value.flag == flag and str(info.value).startswith(flag + ": ") and also in str(info.value)


@needs_transformers
@pytest.mark.parametrize("edit, also", [
    (lambda v: v.pop("<|endoftext|>"), "has no '<|endoftext|>' token"),
    (lambda v: v.pop("Ġ"), "lacks 1 of the 256 byte-level symbols"),
])
def test_gpt2_bpe_refuses_an_unusable_vocabulary(tmp_path, edit, also):
    v, m = write_gpt2_files(tmp_path, vocab_edit=edit)
    with pytest.raises(tokenizers.TokenizerError, match="^--vocab-file: .*" + also):
        tokenizers.build_tokenizer("GPT2BPETokenizer", vocab_file=v, merge_file=m)


@needs_transformers
@pytest.mark.parametrize("merges, also", [("h e\nabc\n", "invalid at line 2"), ("x q\n", "`xq` out of vocabulary")])
def test_gpt2_bpe_refuses_a_malformed_merges_file(gpt2_files, merges, also):
    Path(gpt2_files[1]).write_text("#version: 0.2\n" + merges, encoding="utf-8")
    with pytest.raises(tokenizers.TokenizerError, match="^--merge-file: cannot build a GPT-2 BPE tokenizer .*" + also):
        tokenizers.build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files[0], merge_file=gpt2_files[1])


@pytest.mark.parametrize("tokenizer_flags", ["gpt2", "hf"])
def test_missing_transformers_exits_2_naming_the_flag(gpt2_files, tmp_path, monkeypatch, capsys, tokenizer_flags):
    """pretrain_gpt_zb.py's ``main`` in-process: exit status 2, one error line, no process group."""
    from megatron_zb.training import pretrain
    flags = (gpt2_flags(gpt2_files) if tokenizer_flags == "gpt2"
             else f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {tmp_path}")
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` raise ImportError
    assert pretrain.main(shlex.split(f"{BASE} --mock-data {flags}")) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    name = "GPT2BPETokenizer" if tokenizer_flags == "gpt2" else "HuggingFaceTokenizer"
    assert len(lines) == 1 and lines[0].startswith(f"pretrain_gpt_zb.py: error: --tokenizer-type: --tokenizer-type "
                                                   f"{name} needs the 'transformers' package")
    assert "pip install transformers" in lines[0]
    assert not torch.distributed.is_initialized()


# ---------------------------------------------------------------------------- HuggingFaceTokenizer
HF_VOCAB = {"<unk>": 0, "<eos>": 1, "<pad>": 2, "zero": 3, "bubble": 4, "pipeline": 5, "schedule": 6}


@pytest.fixture
def hf_dir(tmp_path) -> Path:
    """A WordLevel tokenizer built with ``tokenizers``, saved with ``save_pretrained`` (tokenizer.json + config)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    t = Tokenizer(models.WordLevel(HF_VOCAB, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t.decoder = decoders.WordPiece()  # joins words with a space
    PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
                            ).save_pretrained(str(tmp_path / "tok"))
    return tmp_path / "tok"


@needs_transformers
def test_hf_tokenizer_from_a_local_directory(hf_dir):
    args = resolve(f"--mock-data --tokenizer-type HuggingFaceTokenizer --tokenizer-model {hf_dir}")
    assert (args.tokenizer_vocab_size, args.padded_vocab_size) == (7, 128)
    tok = data.tokenizer_from_args(args)
    assert isinstance(tok, tokenizers.HuggingFaceLocalTokenizer)
    assert (tok.vocab_size, tok.eod, tok.pad) == (7, 1, 2)
    assert tok.tokenize("zero bubble pipeline schedule zero") == [3, 4, 5, 6, 3]
    assert tok.tokenize("zero nothing") == [3, 0]  # unknown word -> <unk>
    assert tok.detokenize([3, 4, 5, 6]) == "zero bubble pipeline schedule"
    assert tok.unique_identifiers["path"] == str(hf_dir)


# ---------------------------------------------------------------------------- end to end
@needs_transformers
def test_preprocess_with_gpt2_bpe_then_train_data(gpt2_files, tmp_path):
    """tools/preprocess_data.py -> .bin/.idx with the hand-worked ids -> the GPTDataset pretraining reads."""
    from test_data import load_preprocess  # the tool loaded as a module
    docs = ["hello world", "held hello", "héllo"]
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs * 4), encoding="utf-8")
    [prefix] = load_preprocess().main(["--input", str(src), "--output-prefix", str(tmp_path / "out" / "c"),
                                       *shlex.split(gpt2_flags(gpt2_files))])
    ds = IndexedDataset(prefix)
    assert len(ds) == 12 and ds.index.dtype == numpy.uint16
    expected = [HELLO_WORLD + [EOD], [256, 108, 100, 32, 259, EOD], [104, 195, 169, 257, 111, EOD]]
    assert [ds[i].tolist() for i in range(3)] == expected

    args = resolve(f"--data-path {prefix} --split 1,1,1 --data-cache-path {tmp_path / 'cache'} "
                   f"{gpt2_flags(gpt2_files)}")
    train, _, _ = data.build_datasets(args)
    assert isinstance(train, GPTDataset)
    corpus_ids = {i for doc in expected for i in doc}
    sample = train[0]["tokens"].tolist()
    assert len(sample) == 8 and set(sample) <= corpus_ids and EOD in sample  # 8 tokens span a document end


def test_preprocess_tokenizer_errors_exit_2(gpt2_files, tmp_path, capsys):
    from test_data import load_preprocess
    src = tmp_path / "c.jsonl"
    src.write_text(json.dumps({"text": "hello"}) + "\n")
    pre = load_preprocess()
    for extra, line in ((f"--tokenizer-type GPT2BPETokenizer --vocab-file {gpt2_files[0]}", "error: --merge-file: is "
                         "required with --tokenizer-type GPT2BPETokenizer"),
                        ("--vocab-size 10", "error: --vocab-size is only read by --tokenizer-type NullTokenizer")):
        with pytest.raises(SystemExit) as info:
            pre.main(["--input", str(src), "--output-prefix", str(tmp_path / "o"), *shlex.split(extra)])
        assert info.value.code == 2 and line in capsys.readouterr().err
    assert not list(tmp_path.glob("o*"))

"""GPT2BPETokenizer (--vocab-file / --merge-file), GPTSentencePieceTokenizer / Llama2Tokenizer and
TikTokenizer (--tokenizer-model FILE) and HuggingFaceTokenizer (--tokenizer-model DIR) from files each
test writes itself (nothing downloaded): the GPT-2 and TikToken ids are worked out by hand below, the
SentencePiece ids come from the ``sentencepiece`` library itself on a model the test trains.
tests/training/test_tokenizers_vs_megatron_lm.py compares all of them with Megatron-LM's own tokenizers.

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
import re
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
from megatron_zb.training.run_config import run_config

needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="transformers is not installed (it is in the test extra: pip install "
                                               "-e .[test])")

REPO = Path(__file__).resolve().parents[2]
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


def run_config_of(extra: str):
    """The run configuration ``pretrain_gpt_zb.py`` builds from ``BASE + extra`` (what the datasets take)."""
    from megatron_zb.training.pretrain import parse_command_line

    return run_config(parse_command_line(shlex.split(BASE + " " + extra), world_size=1).args)


def gpt2_flags(files: tuple[str, str]) -> str:
    return f"--tokenizer-type GPT2BPETokenizer --vocab-file {files[0]} --merge-file {files[1]}"


# ---------------------------------------------------------------------------- GPT2BPETokenizer
def test_the_test_vocabulary_is_gpt2_byte_level():
    """The hand-written table is the byte-level one megatron-zb uses (and, where installed, the
    alphabet of HuggingFace's ``tokenizers`` library)."""
    from megatron_zb.training.gpt2_bpe import byte_symbols as used
    symbols = byte_symbols()
    assert symbols == used() and len(set(symbols)) == 256
    assert (symbols[32], symbols[ord("h")], symbols[0xC3], symbols[0xA9]) == ("Ġ", "h", "Ã", "©")
    if importlib.util.find_spec("tokenizers") is not None:
        from tokenizers.pre_tokenizers import ByteLevel
        assert sorted(symbols) == sorted(ByteLevel.alphabet())


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
    # a literal <|endoftext|> is text, as in Megatron-LM's tokenizer: "<|" "endoftext" "|>", bytes (no merge applies)
    assert tok.tokenize("hello<|endoftext|>") == [259, *b"<|endoftext|>"]
    assert tok.detokenize(HELLO_WORLD + [EOD]) == "hello world<|endoftext|>"
    assert tok.vocab["Ġw"] == 260 and tok.unique_identifiers["vocab_size"] == 263


def test_gpt2_bpe_round_trip(gpt2_files):
    tok = data.build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files[0], merge_file=gpt2_files[1])
    text = "hello world. It's 3 héllo  wörld\tzero bubble ,  spaces \n\nnew line 😀"
    ids = tok.tokenize(text)
    assert tok.detokenize(ids) == text
    assert all(0 <= i < 262 for i in ids) and 259 in ids  # no EOD, the merges applied


def test_gpt2_bpe_through_validate_args(gpt2_files):
    args = resolve(f"--mock-data {gpt2_flags(gpt2_files)}")
    assert (args.vocab_size, args.tokenizer_vocab_size, args.padded_vocab_size) == (263, 263, 384)  # 3 * 128
    assert data.tokenizer_from_args(args).tokenize("hello world") == HELLO_WORLD


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


@pytest.mark.parametrize("edit, also", [
    (lambda v: v.pop("<|endoftext|>"), "has no '<|endoftext|>' token"),
    (lambda v: v.pop("Ġ"), "lacks 1 of the 256 byte-level symbols"),
    (lambda v: v.update({"<|endoftext|>": 999}), r"ids are not 0\.\.262"),
])
def test_gpt2_bpe_refuses_an_unusable_vocabulary(tmp_path, edit, also):
    v, m = write_gpt2_files(tmp_path, vocab_edit=edit)
    with pytest.raises(tokenizers.TokenizerError, match="^--vocab-file: .*" + also):
        tokenizers.build_tokenizer("GPT2BPETokenizer", vocab_file=v, merge_file=m)


@pytest.mark.parametrize("text, also", [
    ("#version: 0.2\nh e\nabc\n", "line 3 'abc' is not a merge 'A B'"),
    ("#version: 0.2\nx q\n", "line 2: 'xq' is not in the vocab file"),
    ("h e\nl l\n", "first line 'h e' is not the '#version' header"),  # Megatron-LM would skip the merge 'h e'
    ("#version: 0.2\nh e\nl l", "does not end with a newline"),  # ... and drop 'l l'
])
def test_gpt2_bpe_refuses_a_malformed_merges_file(gpt2_files, text, also):
    Path(gpt2_files[1]).write_text(text, encoding="utf-8")
    with pytest.raises(tokenizers.TokenizerError, match="^--merge-file: cannot use .* as the GPT-2 merges.txt .*" + also):
        tokenizers.build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files[0], merge_file=gpt2_files[1])


def test_gpt2_bpe_needs_no_transformers(gpt2_files, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` raise ImportError
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    tok = data.build_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files[0], merge_file=gpt2_files[1])
    assert tok.tokenize("hello world") == HELLO_WORLD


@pytest.mark.parametrize("tokenizer, module", [("hf", "transformers"), ("sp", "sentencepiece"),
                                               ("tik", "tiktoken"), ("gpt2", "regex")])
def test_missing_package_exits_2_naming_it(gpt2_files, tmp_path, monkeypatch, capsys, tokenizer, module):
    """pretrain_gpt_zb.py's ``main`` in-process: exit status 2, one error line, no process group."""
    from megatron_zb.training import pretrain
    model = tmp_path / "tok.model"
    model.write_bytes(b"never read")
    (tmp_path / "tok.json").write_text("[]")
    flags, name = {"hf": (f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {tmp_path}", "HuggingFaceTokenizer"),
                   "sp": (f"--tokenizer-type Llama2Tokenizer --tokenizer-model {model}", "Llama2Tokenizer"),
                   "tik": (f"--tokenizer-type TikTokenizer --tokenizer-model {tmp_path / 'tok.json'} "
                           f"--tiktoken-pattern v2", "TikTokenizer"),
                   "gpt2": (gpt2_flags(gpt2_files), "GPT2BPETokenizer")}[tokenizer]
    monkeypatch.setitem(sys.modules, module, None)  # makes `import MODULE` raise ImportError
    assert pretrain.main(shlex.split(f"{BASE} --mock-data {flags}")) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pretrain_gpt_zb.py: error: --tokenizer-type: --tokenizer-type "
                                                   f"{name} needs the '{module}' package"), lines
    assert f"pip install {module}" in lines[0]
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


# ---------------------------------------------------------------------------- SentencePiece
SP_CORPUS = ["hello world, zero bubble pipeline schedules", "the quick brown fox jumps over the lazy dog",
             "pipeline parallelism splits the model into stages", "héllo wörld: ünïcode text and numbers 12345"]
SP_TEXT = "the zero bubble pipeline splits héllo wörld into 42 stages"
"""A text of the corpus's characters only (SentencePiece maps unseen characters to <unk>)."""


def train_sentencepiece(path: Path, **options) -> str:
    """A 100-piece BPE SentencePiece model of :data:`SP_CORPUS` (unk 0, bos 1, eos 2 unless ``options``)."""
    import io

    import sentencepiece
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(SP_CORPUS * 20), model_writer=model, vocab_size=100,
                                             model_type="bpe", character_coverage=1.0, minloglevel=2, **options)
    path.write_bytes(model.getvalue())
    return str(path)


@pytest.fixture(scope="module")
def sp_models(tmp_path_factory) -> dict[str, str]:
    """SentencePiece models: ``pad`` has a PAD piece (id 3), ``plain`` none (pad_id -1, as Llama 2's)."""
    d = tmp_path_factory.mktemp("sp")
    return {"pad": train_sentencepiece(d / "pad.model", pad_id=3), "plain": train_sentencepiece(d / "plain.model")}


@pytest.mark.parametrize("tokenizer_type", ["GPTSentencePieceTokenizer", "Llama2Tokenizer"])
@pytest.mark.parametrize("model, pad", [("pad", 3), ("plain", -1)])
def test_sentencepiece_ids_eod_pad(sp_models, tokenizer_type, model, pad):
    """The ids are the sentencepiece library's own (no BOS added, as Megatron-LM 0.16.1's default
    tokenizer path); EOD is the model's EOS, PAD its PAD (-1: none, megatron-core's own pad id)."""
    import sentencepiece
    ref = sentencepiece.SentencePieceProcessor(model_file=sp_models[model])
    args = resolve(f"--mock-data --tokenizer-type {tokenizer_type} --tokenizer-model {sp_models[model]}")
    assert (args.vocab_size, args.tokenizer_vocab_size, args.padded_vocab_size) == (100, 100, 128)
    tok = data.tokenizer_from_args(args)
    assert isinstance(tok, MegatronTokenizerBase)
    assert (tok.vocab_size, tok.eod, tok.pad) == (100, ref.eos_id(), pad) == (100, 2, pad)
    for text in [SP_TEXT, *SP_CORPUS]:
        ids = tok.tokenize(text)
        assert ids == ref.encode_as_ids(text) and ids[0] != ref.bos_id()
        assert tok.detokenize(ids) == text
    assert ref.unk_id() in tok.tokenize("QZX")  # characters the model never saw: <unk>, as SentencePiece


def test_sentencepiece_errors_name_the_flag(tmp_path):
    no_eos = train_sentencepiece(tmp_path / "no_eos.model", eos_id=-1)
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"not a model")
    for extra, also in (("", "is required with --tokenizer-type Llama2Tokenizer: pass the local SentencePiece model"),
                        (f"--tokenizer-model {tmp_path}", ".* is not a file"),
                        (f"--tokenizer-model {junk}", "cannot load .* as a SentencePiece model"),
                        (f"--tokenizer-model {no_eos}", "the SentencePiece model .* has no EOS piece")):
        with pytest.raises(ArgumentError, match="^--tokenizer-model: " + also):
            resolve(f"--mock-data --tokenizer-type Llama2Tokenizer {extra}")


# ---------------------------------------------------------------------------- TikToken
TIK_MERGES = [b"he", b"ll", b"hell", b"hello", b" w", b"or", b"oW"]
"""Ranks 256.. of the tiny tiktoken vocabulary (ranks 0-255: the bytes). With 10 special tokens
(--tiktoken-num-special-tokens 10) rank r is id r + 10; vocabulary 10 + 263 = 273.

tiktoken merges the adjacent pair whose concatenation has the lowest rank, until none has one:
  "hello world" -> "hello" | " world" (both patterns): hello = 259; " w" 260, "or" 261, l, d
                -> [269, 270, 271, 118, 110]
  "HelloWorld"  v1: one piece: ll(257) -> or(261) -> oW(262): H e ll oW or l d
                -> [82, 111, 267, 272, 271, 118, 110]
                v2: "Hello" | "World" (split at the capital): H e ll o, W or l d
                -> [82, 111, 267, 121, 97, 271, 118, 110]
"""
TIK_FLAGS = "--tiktoken-num-special-tokens 10 --vocab-size 273"


def write_tiktoken_vocab(path: Path, ranks: list[bytes] | None = None) -> str:
    """The tiktoken vocabulary JSON megatron-core reads: ``[{rank, token_bytes (base64), token_str}]``."""
    import base64
    ranks = [bytes([i]) for i in range(256)] + TIK_MERGES if ranks is None else ranks
    path.write_text(json.dumps([{"rank": i, "token_bytes": base64.b64encode(t).decode(),
                                 "token_str": t.decode("utf-8", errors="replace")} for i, t in enumerate(ranks)]))
    return str(path)


@pytest.fixture(scope="module")
def tik_vocab(tmp_path_factory) -> str:
    return write_tiktoken_vocab(tmp_path_factory.mktemp("tik") / "tokenizer.json")


@pytest.mark.parametrize("pattern, hello_world", [
    ("v1", [82, 111, 267, 272, 271, 118, 110]), ("v2", [82, 111, 267, 121, 97, 271, 118, 110])])
def test_tiktoken_ids_by_hand(tik_vocab, pattern, hello_world):
    args = resolve(f"--mock-data --tokenizer-type TikTokenizer --tokenizer-model {tik_vocab} "
                   f"--tiktoken-pattern {pattern} {TIK_FLAGS}")
    assert (args.vocab_size, args.tokenizer_vocab_size, args.padded_vocab_size) == (273, 273, 384)
    tok = data.tokenizer_from_args(args)
    assert (tok.vocab_size, tok.eod, tok.pad) == (273, 2, 4)  # ids of "</s>" and "<pad>" among the defaults
    assert tok.tokenize("hello world") == [269, 270, 271, 118, 110]
    assert tok.tokenize("HelloWorld") == hello_world
    assert tok.tokenize("hello</s>") == [269, 2]  # megatron-core encodes special tokens in the text
    text = "hello world, HelloWorld 12"
    assert tok.detokenize(tok.tokenize(text)) == text


def test_tiktoken_special_tokens(tik_vocab):
    """--tiktoken-special-tokens (deprecated in Megatron-LM) is used when --tokenizer-special-tokens is
    not given; EOD and PAD are the positions of </s> and <pad> in the list; fillers to 10 ids."""
    special = "<s> </s> <unk> <pad> <mask> <cls> <sep> <tool>"
    base = f"--mock-data --tokenizer-type TikTokenizer --tokenizer-model {tik_vocab} --tiktoken-pattern v2 {TIK_FLAGS}"
    tok = data.tokenizer_from_args(resolve(f"{base} --tiktoken-special-tokens {special}"))
    assert (tok.eod, tok.pad) == (1, 3) and tok.tokenize("<tool>hello") == [7, 269]
    tok = data.tokenizer_from_args(resolve(f"{base} --tiktoken-special-tokens {special} "
                                           f"--tokenizer-special-tokens </s> <unk> <s> <mask> <pad> <cls> <sep>"))
    assert (tok.eod, tok.pad) == (0, 4) and min(tok.tokenize("<tool>")) >= 10  # <tool> is text now


@pytest.mark.parametrize("extra, flag, also", [
    ("--tokenizer-type TikTokenizer --tokenizer-model {v} " + TIK_FLAGS, "--tiktoken-pattern",
     "is required with --tokenizer-type TikTokenizer: v1 or v2"),
    ("--tokenizer-type TikTokenizer --tokenizer-model {v} --tiktoken-pattern v3 " + TIK_FLAGS, "--tiktoken-pattern",
     "'v3' is not one of v1, v2"),
    ("--tokenizer-type TikTokenizer --tokenizer-model {v} --tiktoken-pattern v2", "--vocab-size",
     "131072 needs 130072 ranks after the 1000 special tokens, but .* has 263; pass --vocab-size 1263"),
    ("--tokenizer-type TikTokenizer --tokenizer-model {v} --tiktoken-pattern v2 --tokenizer-special-tokens <s> </s> "
     "<unk> " + TIK_FLAGS, "--tokenizer-special-tokens", "missing <mask> <pad> <cls> <sep>"),
    ("--tokenizer-type TikTokenizer --tokenizer-model {v} --tiktoken-pattern v2 --tiktoken-num-special-tokens 5 "
     "--vocab-size 268", "--tiktoken-num-special-tokens", "5 must be at least the 7 special tokens"),
    ("--tokenizer-type TikTokenizer --tokenizer-model {v}.txt --tiktoken-pattern v2", "--tokenizer-model",
     "is not a file"),
    ("--tokenizer-type TikTokenizer --tokenizer-model {m} --tiktoken-pattern v2", "--tokenizer-model",
     "does not end in .json"),
    ("--tokenizer-type Llama2Tokenizer --tokenizer-model {m} --tokenizer-special-tokens <s>",
     "--tokenizer-special-tokens", "only read by --tokenizer-type TikTokenizer in megatron-zb, not Llama2Tokenizer"),
    ("--tiktoken-special-tokens <s>", "--tiktoken-special-tokens", "only read by --tokenizer-type TikTokenizer"),
])
def test_tiktoken_bad_flags_name_the_flag(tik_vocab, sp_models, extra, flag, also):
    with pytest.raises(ArgumentError) as info:
        resolve("--mock-data " + extra.format(v=tik_vocab, m=sp_models["pad"]))
    assert info.value.flag == flag and str(info.value).startswith(flag + ": ")
    assert re.search(also, str(info.value)), str(info.value)


@pytest.mark.parametrize("ranks, also", [
    ([bytes([i]) for i in range(255)] + [b"\xff\x00"], "entry 255 is .*; the first 256 ranks must be the single bytes"),
    ([bytes([i]) for i in range(256)] + [b"he", b"he"], "a token appears twice"),
])
def test_tiktoken_refuses_a_malformed_vocabulary(tmp_path, ranks, also):
    path = write_tiktoken_vocab(tmp_path / "bad.json", ranks)
    with pytest.raises(ArgumentError, match="^--tokenizer-model: cannot use .* as a tiktoken vocabulary: " + also):
        resolve(f"--mock-data --tokenizer-type TikTokenizer --tokenizer-model {path} --tiktoken-pattern v2 "
                f"--tiktoken-num-special-tokens 10 --vocab-size {10 + len(ranks)}")


def test_tiktoken_flags_with_another_tokenizer_are_ignored_with_a_warning():
    """NVIDIA's LLaMA-3 scripts pass --tiktoken-pattern with any tokenizer; Megatron-LM ignores it."""
    from megatron_zb.training.arguments import validate_args_and_schedule
    args = parse_args(shlex.split(BASE + " --mock-data --tokenizer-type NullTokenizer --vocab-size 100 "
                                         "--tiktoken-pattern v2 --tiktoken-num-special-tokens 5"))
    notices = validate_args_and_schedule(args, world_size=1).notices
    assert [n for n in notices if "tiktoken" in n] == [
        f"WARNING: --tiktoken-{f} is only read by --tokenizer-type TikTokenizer; ignored with NullTokenizer, as in "
        f"Megatron-LM" for f in ("pattern", "num-special-tokens")]
    assert args.padded_vocab_size == 128


# ---------------------------------------------------------------------------- end to end
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

    config = run_config_of(f"--data-path {prefix} --split 1,1,1 --data-cache-path {tmp_path / 'cache'} "
                           f"{gpt2_flags(gpt2_files)}")
    train, _, _ = data.build_datasets(config)
    assert isinstance(train, GPTDataset)
    corpus_ids = {i for doc in expected for i in doc}
    sample = train[0]["tokens"].tolist()
    assert len(sample) == 8 and set(sample) <= corpus_ids and EOD in sample  # 8 tokens span a document end


@pytest.mark.parametrize("kind", ["Llama2Tokenizer", "TikTokenizer"])
def test_preprocess_with_a_tokenizer_model_file_then_train_data(kind, sp_models, tik_vocab, tmp_path):
    """tools/preprocess_data.py with --tokenizer-model (and the TikToken flags) -> .bin/.idx holding the
    tokenizer's ids and EOD per document -> the GPTDataset pretraining reads with the same flags."""
    from test_data import load_preprocess
    flags = (f"--tokenizer-type Llama2Tokenizer --tokenizer-model {sp_models['plain']}" if kind == "Llama2Tokenizer"
             else f"--tokenizer-type TikTokenizer --tokenizer-model {tik_vocab} --tiktoken-pattern v2 {TIK_FLAGS}")
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in SP_CORPUS * 3), encoding="utf-8")
    [prefix] = load_preprocess().main(["--input", str(src), "--output-prefix", str(tmp_path / "out" / "c"),
                                       *shlex.split(flags)])
    args = resolve(f"--data-path {prefix} --split 1,1,1 --data-cache-path {tmp_path / 'cache'} {flags}")
    tok = data.tokenizer_from_args(args)
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(4)] == [tok.tokenize(t) + [tok.eod] for t in SP_CORPUS]
    assert tok.eod == 2 and all(doc.tolist().count(2) == 1 for doc in (ds[i] for i in range(len(ds))))
    train, _, _ = data.build_datasets(run_config_of(f"--data-path {prefix} --split 1,1,1 "
                                                    f"--data-cache-path {tmp_path / 'cache'} {flags}"))
    corpus_ids = {i for t in SP_CORPUS for i in tok.tokenize(t)} | {tok.eod}
    assert set(train[0]["tokens"].tolist()) <= corpus_ids


def test_preprocess_tokenizer_errors_exit_2(gpt2_files, tmp_path, capsys):
    from test_data import load_preprocess
    src = tmp_path / "c.jsonl"
    src.write_text(json.dumps({"text": "hello"}) + "\n")
    pre = load_preprocess()
    for extra, line in ((f"--tokenizer-type GPT2BPETokenizer --vocab-file {gpt2_files[0]}", "error: --merge-file: is "
                         "required with --tokenizer-type GPT2BPETokenizer"),
                        ("--vocab-size 10", "error: --vocab-size is only read by --tokenizer-type NullTokenizer / "
                                            "TikTokenizer, not ByteLevel")):
        with pytest.raises(SystemExit) as info:
            pre.main(["--input", str(src), "--output-prefix", str(tmp_path / "o"), *shlex.split(extra)])
        assert info.value.code == 2 and line in capsys.readouterr().err
    assert not list(tmp_path.glob("o*"))


def test_preprocess_warns_about_ignored_tiktoken_flags(tmp_path, capsys):
    """As pretrain_gpt_zb.py: --tiktoken-pattern with another tokenizer is ignored, with a warning line."""
    from test_data import load_preprocess
    src = tmp_path / "c.txt"
    src.write_text("hello\n")
    [prefix] = load_preprocess().main(["--input", str(src), "--output-prefix", str(tmp_path / "o"),
                                       "--tiktoken-pattern", "v2"])
    assert ("WARNING: --tiktoken-pattern is only read by --tokenizer-type TikTokenizer; ignored with ByteLevel, as in "
            "Megatron-LM") in capsys.readouterr().err
    ds = IndexedDataset(prefix)  # kept alive: its items are views of its memory map
    assert ds[0].tolist() == [*b"hello", 256]

"""megatron-zb's tokenizers against Megatron-LM core_v0.16.1's own, on the same tiny files and texts
(with megatron-core 0.19: against core_v0.19.0's, which has only megatron-core's path -- the ``new``
one below, which pads the vocabulary there -- and no offline GPT-2: that case is skipped).

One subprocess (:func:`harness.megatron_lm_tokenizers.megatron_lm_tokenizer_results`,
~15-25 s on the shared 2-core machine, mostly importing Megatron-LM's training package) builds
Megatron-LM's two tokenizer paths for every configuration below: ``legacy`` (``megatron.training.tokenizer``,
which every Megatron-LM run builds and pads the vocabulary from) and ``new`` (megatron-core's
``MegatronTokenizer``, what its ``pretrain_gpt.py`` and ``tools/preprocess_data.py`` use by default;
not for GPT-2, whose new path needs the network). megatron-zb must give the same ids, EOD, PAD,
vocabulary and padded vocabulary. Where Megatron-LM's two paths differ, megatron-zb follows the
default (new) one, and the test pins each difference:

* ``Llama2Tokenizer``: the legacy ``tokenize`` prepends BOS, the new one (and megatron-zb) not;
* TikToken: a literal special token in the text (``</s>``) is that token's id in the new path (and
  megatron-zb), text in the legacy one; the legacy classes of Llama2 and TikToken have no usable
  ``pad`` (their property raises), the new ones give the model's PAD id / the ``<pad>`` position.

GPT-2 has only the legacy path (the only one reading local files): a literal ``<|endoftext|>`` is
text there and here.
"""

from __future__ import annotations

import importlib.util
import shlex

import pytest

from test_tokenizers import BASE, TIK_FLAGS, train_sentencepiece, write_gpt2_files, write_tiktoken_vocab

from harness.megatron_lm import SKIP_REASON, find_megatron_lm
from megatron_zb.training import data
from megatron_zb.training.arguments import parse_args, validate_args

_MISSING = [m for m in ("yaml", "regex", "pydantic") if importlib.util.find_spec(m) is None]
pytestmark = [
    pytest.mark.skipif(find_megatron_lm() is None, reason=SKIP_REASON),
    pytest.mark.skipif(bool(_MISSING), reason=f"Megatron-LM's training package imports {_MISSING}: "
                                              "pip install -e '.[test]'"),
]

PLAIN_TEXTS = ["hello world", "hello world, HelloWorld 12", "the zero bubble pipeline splits héllo wörld into 42 stages",
               "It's 3 héllo  wörld\tzero bubble ,  spaces \n\nnew line 😀 QZX"]
"""Texts without special tokens (unknown characters, double spaces, tabs, emoji included)."""
SPECIAL_TEXTS = ["hello<|endoftext|> world", "hello</s> <s>world"]
"""Texts holding special tokens literally."""
TEXTS = PLAIN_TEXTS + SPECIAL_TEXTS
TIK_SPECIAL = ["<s>", "</s>", "<unk>", "<pad>", "<mask>", "<cls>", "<sep>", "<tool>"]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("tokenizer_files")
    vocab, merges = write_gpt2_files(d)
    return {"vocab": vocab, "merges": merges, "sp_pad": train_sentencepiece(d / "pad.model", pad_id=3),
            "sp_plain": train_sentencepiece(d / "plain.model"), "tik": write_tiktoken_vocab(d / "tokenizer.json")}


def configs(files: dict[str, str]) -> dict[str, tuple[str, dict]]:
    """name -> (megatron-zb flags, the same as Megatron-LM's tokenizer arguments by dest)."""
    tik = dict(tokenizer_type="TikTokenizer", tokenizer_model=files["tik"], tiktoken_num_special_tokens=10,
               vocab_size=273)
    return {
        "gpt2": (f"--tokenizer-type GPT2BPETokenizer --vocab-file {files['vocab']} --merge-file {files['merges']}",
                 dict(tokenizer_type="GPT2BPETokenizer", vocab_file=files["vocab"], merge_file=files["merges"])),
        "gpt_sp": (f"--tokenizer-type GPTSentencePieceTokenizer --tokenizer-model {files['sp_pad']}",
                   dict(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=files["sp_pad"])),
        "llama2": (f"--tokenizer-type Llama2Tokenizer --tokenizer-model {files['sp_plain']}",
                   dict(tokenizer_type="Llama2Tokenizer", tokenizer_model=files["sp_plain"])),
        "llama2_pad": (f"--tokenizer-type Llama2Tokenizer --tokenizer-model {files['sp_pad']}",
                       dict(tokenizer_type="Llama2Tokenizer", tokenizer_model=files["sp_pad"])),
        # the legacy tokenizer's default special tokens are 3, megatron-core's 7: pass the 7 to compare both
        "tik_v1": (f"--tokenizer-type TikTokenizer --tokenizer-model {files['tik']} --tiktoken-pattern v1 {TIK_FLAGS} "
                   f"--tokenizer-special-tokens {' '.join(TIK_SPECIAL[:7])}",
                   dict(tik, tiktoken_pattern="v1", tokenizer_special_tokens=TIK_SPECIAL[:7])),
        "tik_v2": (f"--tokenizer-type TikTokenizer --tokenizer-model {files['tik']} --tiktoken-pattern v2 {TIK_FLAGS} "
                   f"--tiktoken-special-tokens {' '.join(TIK_SPECIAL)}",
                   dict(tik, tiktoken_pattern="v2", tokenizer_special_tokens=TIK_SPECIAL)),
    }


@pytest.fixture(scope="module")
def reference(files) -> dict:
    from harness.megatron_lm_tokenizers import megatron_lm_tokenizer_results
    return megatron_lm_tokenizer_results(find_megatron_lm(), {k: v[1] for k, v in configs(files).items()}, TEXTS)


def ours(files: dict[str, str], name: str):
    args = validate_args(parse_args(shlex.split(f"{BASE} --mock-data {configs(files)[name][0]}")), world_size=1)
    return args, data.tokenizer_from_args(args)


@pytest.mark.parametrize("name", ["gpt2", "gpt_sp", "llama2", "llama2_pad", "tik_v1", "tik_v2"])
def test_same_ids_eod_pad_vocabulary_as_megatron_lm(files, reference, name):
    ref = reference[name]
    legacy, new = ref.get("legacy"), ref.get("new")
    if legacy is None and new is None:  # core_v0.19.0: no legacy path, and GPT-2's new one needs the network
        pytest.skip(f"{name}: Megatron-LM core_v0.19.0 has no offline path for it (its GPT2BPETokenizer loads the "
                    "hub model gpt2)")
    args, tok = ours(files, name)
    default = new or legacy  # what Megatron-LM's pretrain_gpt.py / preprocess_data.py use
    got = [tok.tokenize(t) for t in TEXTS]
    # ids: Megatron-LM's default path on every text; the legacy one on the texts where the two agree
    assert got == default["ids"]
    assert [tok.detokenize(i) for i in got] == default["text"]
    assert (tok.vocab_size, tok.eod) == (default["vocab_size"], default["eod"])
    assert getattr(tok, "pad", None) == default["pad"]
    assert args.padded_vocab_size == (legacy or new)["padded_vocab_size"]  # the path that pads
    if legacy is None:  # core_v0.19.0: megatron-core's path is Megatron-LM's only one
        return
    for i, text in enumerate(TEXTS):
        legacy_ids = legacy["ids"][i]
        if name.startswith("llama2"):  # the legacy tokenize adds BOS
            assert legacy_ids[0] == 1 and got[i] == legacy_ids[1:], text
        elif name.startswith("tik") and "</s>" in text:  # legacy: special tokens are text
            assert got[i] != legacy_ids and 1 in got[i] and 1 not in legacy_ids, text  # "</s>" is id 1 here
        else:
            assert got[i] == legacy_ids, text
    assert (tok.vocab_size, tok.eod) == (legacy["vocab_size"], legacy["eod"])
    if name in ("llama2", "llama2_pad", "tik_v1", "tik_v2"):
        assert legacy["pad"] is None  # the legacy classes' pad property raises
    else:
        assert legacy["pad"] == default["pad"]


def test_the_comparison_covers_what_it_claims(files, reference):
    """The texts exercise merges, unknown pieces and both TikToken patterns (else equality proves little)."""
    if "legacy" in reference["gpt2"]:  # core_v0.16.1 (core_v0.19.0 has no offline GPT-2 path)
        gpt2 = reference["gpt2"]["legacy"]["ids"]
        assert 259 in gpt2[0] and gpt2[0] != [*b"hello world"]  # merges applied
    v1, v2 = reference["tik_v1"]["new"]["ids"][1], reference["tik_v2"]["new"]["ids"][1]
    assert v1 != v2  # "HelloWorld": one piece in v1, two in v2
    assert 0 in reference["llama2"]["new"]["ids"][3]  # <unk> for characters the model never saw
    assert reference["gpt_sp"]["new"]["pad"] == 3 and reference["llama2"]["new"]["pad"] == -1
    assert reference["tik_v2"]["new"]["eod"] == 1 and reference["tik_v2"]["new"]["pad"] == 3

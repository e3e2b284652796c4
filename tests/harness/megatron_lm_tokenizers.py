"""Megatron-LM's own tokenizers on given files and texts: the reference of ``tests/training/test_tokenizers_vs_megatron_lm.py``.

Test code, not the product's run path. :func:`megatron_lm_tokenizer_results` runs this module in a
fresh interpreter with the Megatron-LM release of the installed megatron-core (``MEGATRON_LM_DIR``:
core_v0.16.1 or core_v0.19.0) first on ``sys.path`` and returns, per configuration, what its
tokenizer paths give:

* ``legacy`` (core_v0.16.1 only; core_v0.19.0 has no ``megatron/training/tokenizer``):
  ``megatron.training.tokenizer.build_tokenizer(args)`` -- the tokenizer core_v0.16.1 builds in every
  run (``set_global_variables``) and pads the vocabulary from (``args.padded_vocab_size``), and its
  data tokenizer with ``--legacy-tokenizer``;
* ``new``: megatron-core's ``build_tokenizer(args)`` (:data:`_RELEASES`: ``tokenizers.text.utils``
  with 0.16.1, ``tokenizers.utils`` with 0.19) -- what ``pretrain_gpt.py`` and
  ``tools/preprocess_data.py`` build by default, and with core_v0.19.0 the only path (it pads the
  vocabulary there); skipped for ``GPT2BPETokenizer``: it loads the hub model ``gpt2``, which needs
  the network (so with core_v0.19.0 GPT-2 has no reference here).

For each: ``ids`` of every text (``tokenize``), ``text`` back (``detokenize``), ``eod``, ``pad``
(``None`` when the property raises), ``vocab_size``; ``padded_vocab_size`` for the path that pads.
Megatron-LM's ``megatron.training`` package is imported after the CPU harness's workarounds
(:func:`~harness.megatron_lm_workarounds.apply_workarounds`: no triton here).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple, Sequence

__all__ = ["megatron_lm_tokenizer_results"]

_COMMON_DEFAULTS: dict[str, Any] = dict(
    rank=0, make_vocab_size_divisible_by=128, tensor_model_parallel_size=1, vocab_extra_ids=0, vocab_size=None,
    vocab_file=None, merge_file=None, tokenizer_model=None, tiktoken_pattern=None, tiktoken_num_special_tokens=1000,
    tokenizer_sentencepiece_legacy=False, trust_remote_code=False, padded_vocab_size=None)


class _Release(NamedTuple):
    """One Megatron-LM release's tokenizer paths: megatron-core's ``build_tokenizer`` module, whether
    ``megatron.training.tokenizer`` (the legacy path) exists, the defaults of the flags they read (by
    dest) and the dests it renamed from core_v0.16.1's (the configurations are given in those)."""

    new_builder: str
    legacy: bool
    defaults: dict[str, Any]
    renamed: dict[str, str]


_RELEASES: dict[str, _Release] = {
    "core_v0.16.1": _Release("megatron.core.tokenizers.text.utils.build_tokenizer", True, dict(
        _COMMON_DEFAULTS, tokenizer_special_tokens=None, tokenizer_metadata=None, tokenizer_hf_use_fast=False,
        tokenizer_hf_include_special_tokens=False), {}),
    # megatron/training/config/training_config.py TokenizerConfig (core_v0.19.0)
    "core_v0.19.0": _Release("megatron.core.tokenizers.utils.build_tokenizer", False, dict(
        _COMMON_DEFAULTS, special_tokens=None, metadata_path=None, pad_vocab_size=True,
        tokenizer_sentencepiece_ignore_extra_whitespaces=True, tokenizer_hf_no_use_fast=False,
        tokenizer_hf_no_include_special_tokens=False, chat_template=None),
        {"tokenizer_special_tokens": "special_tokens"}),
}
"""Per Megatron-LM release (``megatron_compat.megatron_lm_tag()``): its tokenizer paths."""


def _pad(tok: Any) -> int | None:
    try:
        return int(tok.pad)
    except Exception:  # Megatron-LM's tokenizers raise AttributeError / NotImplementedError without a PAD
        return None


def _describe(tok: Any, texts: Sequence[str]) -> dict[str, Any]:
    ids = [[int(i) for i in tok.tokenize(t)] for t in texts]
    return {"ids": ids, "text": [tok.detokenize(i) for i in ids], "eod": int(tok.eod), "pad": _pad(tok),
            "vocab_size": int(tok.vocab_size)}


def _run(request: dict[str, Any]) -> dict[str, Any]:
    from megatron_zb.megatron_compat import megatron_lm_tag
    from harness.megatron_lm_workarounds import apply_workarounds

    apply_workarounds(os.environ["MEGATRON_LM_DIR"])
    release = _RELEASES[megatron_lm_tag()]
    build_new = importlib.import_module(release.new_builder).build_tokenizer
    out: dict[str, Any] = {}
    for name, given in request["configs"].items():
        flags = {release.renamed.get(k, k): v for k, v in given.items()}
        args = argparse.Namespace(**{**release.defaults, **flags})
        out[name] = {}
        if release.legacy:
            from megatron.training.tokenizer import build_tokenizer as build_legacy

            legacy = build_legacy(args)
            out[name]["legacy"] = {**_describe(legacy, request["texts"]), "padded_vocab_size": args.padded_vocab_size}
        if flags["tokenizer_type"] != "GPT2BPETokenizer":
            out[name]["new"] = _describe(build_new(args), request["texts"])
            if not release.legacy:  # core_v0.19.0's build_tokenizer pads the vocabulary (pad_vocab_size)
                out[name]["new"]["padded_vocab_size"] = args.padded_vocab_size
    return out


def megatron_lm_tokenizer_results(megatron_lm_dir: str | Path, configs: dict[str, dict[str, Any]],
                                  texts: Sequence[str], *, timeout: float = 300) -> dict[str, Any]:
    """Run :func:`_run` in a fresh interpreter (``configs``: name -> Megatron-LM tokenizer flags by dest)."""
    project = Path(__file__).resolve().parents[2]
    env = dict(os.environ, MEGATRON_LM_DIR=str(megatron_lm_dir),
               PYTHONPATH=os.pathsep.join([str(megatron_lm_dir), str(project), str(project / "tests")]))
    request = json.dumps({"configs": configs, "texts": list(texts)})
    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", __name__], input=request, capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=project)
    if proc.returncode != 0:
        raise RuntimeError(f"Megatron-LM's tokenizers failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    result = _run(json.loads(sys.stdin.read()))
    print("\n" + json.dumps(result))

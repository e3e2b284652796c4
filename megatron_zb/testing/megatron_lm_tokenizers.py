"""Megatron-LM's own tokenizers on given files and texts: the reference of ``tests/training/test_tokenizers_vs_megatron_lm.py``.

Test code, not the product's run path. :func:`megatron_lm_tokenizer_results` runs this module in a
fresh interpreter with Megatron-LM core_v0.16.1 (``MEGATRON_LM_DIR``) first on ``sys.path`` and
returns, per configuration, what Megatron-LM's two tokenizer paths give:

* ``legacy``: ``megatron.training.tokenizer.build_tokenizer(args)`` -- the tokenizer Megatron-LM
  builds in every run (``set_global_variables``) and pads the vocabulary from
  (``args.padded_vocab_size``), and its data tokenizer with ``--legacy-tokenizer``;
* ``new``: ``megatron.core.tokenizers.text.utils.build_tokenizer.build_tokenizer(args)`` -- what its
  ``pretrain_gpt.py`` and ``tools/preprocess_data.py`` build by default (skipped for
  ``GPT2BPETokenizer``: it loads the hub model ``gpt2``, which needs the network).

For each: ``ids`` of every text (``tokenize``), ``text`` back (``detokenize``), ``eod``, ``pad``
(``None`` when the property raises), ``vocab_size``; ``padded_vocab_size`` for the legacy one.
Megatron-LM's ``megatron.training`` package is imported after the CPU harness's workarounds
(:func:`~megatron_zb.testing.megatron_lm_workarounds.apply_workarounds`: no triton here).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

__all__ = ["megatron_lm_tokenizer_results"]

_ARG_DEFAULTS: dict[str, Any] = dict(
    rank=0, make_vocab_size_divisible_by=128, tensor_model_parallel_size=1, vocab_extra_ids=0, vocab_size=None,
    vocab_file=None, merge_file=None, tokenizer_model=None, tiktoken_pattern=None, tiktoken_num_special_tokens=1000,
    tokenizer_special_tokens=None, tokenizer_sentencepiece_legacy=False, tokenizer_metadata=None,
    tokenizer_hf_use_fast=False, tokenizer_hf_include_special_tokens=False, trust_remote_code=False,
    padded_vocab_size=None)
"""Megatron-LM's defaults of the tokenizer flags its two ``build_tokenizer`` functions read."""


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
    from megatron_zb.testing.megatron_lm_workarounds import apply_workarounds

    apply_workarounds(os.environ["MEGATRON_LM_DIR"])
    from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer as build_new
    from megatron.training.tokenizer import build_tokenizer as build_legacy

    out: dict[str, Any] = {}
    for name, flags in request["configs"].items():
        args = argparse.Namespace(**{**_ARG_DEFAULTS, **flags})
        legacy = build_legacy(args)
        out[name] = {"legacy": {**_describe(legacy, request["texts"]), "padded_vocab_size": args.padded_vocab_size}}
        if flags["tokenizer_type"] != "GPT2BPETokenizer":
            out[name]["new"] = _describe(build_new(args), request["texts"])
    return out


def megatron_lm_tokenizer_results(megatron_lm_dir: str | Path, configs: dict[str, dict[str, Any]],
                                  texts: Sequence[str], *, timeout: float = 300) -> dict[str, Any]:
    """Run :func:`_run` in a fresh interpreter (``configs``: name -> Megatron-LM tokenizer flags by dest)."""
    project = Path(__file__).resolve().parents[2]
    env = dict(os.environ, MEGATRON_LM_DIR=str(megatron_lm_dir),
               PYTHONPATH=os.pathsep.join([str(megatron_lm_dir), str(project)]))
    request = json.dumps({"configs": configs, "texts": list(texts)})
    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", __name__], input=request, capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=project)
    if proc.returncode != 0:
        raise RuntimeError(f"Megatron-LM's tokenizers failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    result = _run(json.loads(sys.stdin.read()))
    print("\n" + json.dumps(result))

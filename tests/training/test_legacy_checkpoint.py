"""A checkpoint megatron-zb cannot read, given to ``--load``: Megatron-LM's torch format -- a legacy
model's (``--use-legacy-models``) or a megatron-core model's (``--ckpt-format torch``) -- is refused in
one line naming the directory and the conversion, by validation, before any process group starts.

The checkpoints here are **fabricated**: Megatron-LM's legacy models cannot be built with megatron-core
(this project runs megatron-core's GPT only), so each directory is written by hand in the layout
Megatron-LM core_v0.16.1 saves (``megatron/training/checkpointing.py``: ``get_checkpoint_name`` --
``ROOT/iter_NNNNNNN/mp_rank_XX[_YYY]/model_optim_rng.pt``, or ``ROOT/release/...`` with ``release`` in
the tracker; ``generate_state_dict`` -- ``args``, ``checkpoint_version`` 3.0, ``iteration``, ``model``
or ``model0``/``model1`` per virtual stage; the legacy ``GPTModel.state_dict_for_save_checkpoint``
puts the weights under ``language_model`` -> ``embedding`` / ``encoder``), with tiny tensors.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

import pytest
import torch

from megatron_zb.training import pretrain
from megatron_zb.training.arguments import ArgumentError
from megatron_zb.training.checkpoint_check import CheckpointError, checkpoint_to_load, torch_format
from megatron_zb.training.run_config import CheckpointConfig

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--train-iters 2 --lr 1e-4 --mock-data")


def _legacy_model_state() -> dict:
    """A legacy GPT's ``state_dict_for_save_checkpoint`` (2 layers, hidden 8, vocabulary 16)."""
    w = torch.zeros
    encoder = {f"layers.{i}.{k}": w(8) for i in range(2) for k in ("input_norm.weight", "post_attention_norm.weight")}
    encoder["final_norm.weight"] = w(8)
    return {"language_model": {"embedding": {"word_embeddings": {"weight": w(16, 8)},
                                             "position_embeddings": {"weight": w(32, 8)}},
                               "encoder": encoder}}


def _write(root: Path, directory: str, rank_dir: str, models: dict, tracker: str) -> Path:
    """``root/directory/rank_dir/model_optim_rng.pt`` holding ``models`` as Megatron-LM saves them, and the tracker."""
    path = root / directory / rank_dir
    path.mkdir(parents=True)
    state = {"args": argparse.Namespace(num_layers=2, hidden_size=8, use_legacy_models=True),
             "checkpoint_version": 3.0, "iteration": 100, **models,
             "rng_state": [{"random_rng_state": None}]}
    torch.save(state, path / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text(tracker)
    return root / directory


def _refusal(root: Path, extra: str = "") -> ArgumentError:
    with pytest.raises(ArgumentError) as e:
        pretrain.parse_command_line(shlex.split(f"{BASE} --load {root} {extra}"), world_size=1)
    return e.value


def test_legacy_model_checkpoint_is_refused_in_one_line_naming_the_directory(tmp_path, capsys):
    ckpt = _write(tmp_path, "iter_0000100", "mp_rank_00", {"model": _legacy_model_state()}, "100")
    e = _refusal(tmp_path, "--use-legacy-models")
    assert [p.flag for p in e.problems] == ["--load"]
    text = e.problems[0].text
    assert "\n" not in text
    assert text.startswith(f"--load: checkpoint {ckpt} is a legacy-model checkpoint (Megatron-LM's --use-legacy-models: "
                           f"{ckpt / 'mp_rank_00' / 'model_optim_rng.pt'} holds 'language_model' weights)")
    assert (f"tools/checkpoint/convert.py --model-type GPT --loader legacy --saver core --load-dir {tmp_path} "
            f"--save-dir DIR") in text
    assert "--ckpt-convert-format torch_dist" in text and text.endswith("or train without --load")
    # the entry point: exit 2, the one line on stderr, before any process group
    assert pretrain.main(shlex.split(f"{BASE} --load {tmp_path}")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(ckpt) in err and "legacy-model checkpoint" in err
    # the load itself says the same (a caller of load_checkpoint without validation)
    with pytest.raises(CheckpointError) as c:
        checkpoint_to_load(str(tmp_path), CheckpointConfig())
    assert "--load: " + str(c.value) == text


def test_released_legacy_checkpoint_with_virtual_stages_and_ckpt_step(tmp_path):
    """``release`` in the tracker (Megatron-LM's released checkpoints): ``ROOT/release``; a pipeline
    rank's directory ``mp_rank_00_000`` and one model per virtual stage (``model0``, ``model1``)."""
    ckpt = _write(tmp_path, "release", "mp_rank_00_000",
                  {"model0": _legacy_model_state(), "model1": _legacy_model_state()}, "release")
    assert _refusal(tmp_path).problems[0].text.startswith(f"--load: checkpoint {ckpt} is a legacy-model checkpoint")
    other = _write(tmp_path / "other", "iter_0000007", "mp_rank_01", {"model": _legacy_model_state()}, "9")
    assert f"checkpoint {other} is a legacy-model" in _refusal(tmp_path / "other", "--ckpt-step 7").problems[0].text


def test_megatron_core_torch_format_checkpoint_is_refused_with_its_conversion(tmp_path):
    """``--ckpt-format torch`` of a megatron-core GPT: the weights under their megatron-core names."""
    model = {"embedding.word_embeddings.weight": torch.zeros(16, 8), "decoder.final_layernorm.weight": torch.zeros(8)}
    ckpt = _write(tmp_path, "iter_0000003", "mp_rank_00", {"model": model}, "3")
    text = _refusal(tmp_path).problems[0].text
    assert text.startswith(f"--load: checkpoint {ckpt} is in Megatron-LM's torch format (--ckpt-format torch, "
                           f"mp_rank_00/model_optim_rng.pt per model-parallel rank; a megatron-core model's)")
    assert f"--ckpt-convert-save OUT, then --load OUT/torch_dist with DIR = {tmp_path}" in text


def test_unreadable_torch_format_file_is_still_named_and_torch_dist_passes(tmp_path):
    """A ``model_optim_rng.pt`` this process cannot unpickle: the torch format is still named, both
    conversions given, and the line names the file and the load's error (not dropped). A directory
    without ``mp_rank_*`` entries (torch_dist) is not this check's."""
    path = tmp_path / "iter_0000001" / "mp_rank_00"
    path.mkdir(parents=True)
    (path / "model_optim_rng.pt").write_bytes(b"not a torch file")
    try:
        torch.load(str(path / "model_optim_rng.pt"), map_location="cpu", weights_only=False, mmap=True)
    except Exception as e:  # noqa: BLE001 -- the error the line must name, whatever torch raises
        error = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
    else:
        raise AssertionError("torch read a file that is not a torch file")
    text = torch_format(str(tmp_path / "iter_0000001"))
    assert text is not None and "--loader legacy --saver core" in text
    assert f"{path / 'model_optim_rng.pt'} cannot be read here to tell whose: {error})" in text
    assert "\n" not in text
    (tmp_path / "iter_0000002").mkdir()
    (tmp_path / "iter_0000002" / ".metadata").write_bytes(b"")
    assert torch_format(str(tmp_path / "iter_0000002")) is None
    assert torch_format(str(tmp_path / "absent")) is None

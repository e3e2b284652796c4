"""Is a checkpoint whole, and does it fit this run? Checked before megatron-core reads it.

A ``torch_dist`` checkpoint directory (``ROOT/iter_0000100``) holds ``metadata.json``,
``common.pt`` (the common state), ``.metadata`` (torch's distributed-checkpoint index: every
tensor's global shape and, for every stored item, the file, offset and length that hold it) and
the shard files ``__<rank>_<n>.distcp``. :func:`damage` checks that every file the index names
is there and long enough -- the failures a full disk, a lost node or an interrupted copy leave
behind -- so that a load fails with one line naming the file instead of an ``EOFError`` inside
torch on every rank. :func:`earlier_checkpoint_hint` names the latest intact checkpoint before a
damaged one and the ``--ckpt-step`` that loads it (intact: complete, and the sizes its manifest lists,
:mod:`.checkpoint_manifest`; the checksums are verified by the load).

:func:`shape_mismatches` compares this rank's sharded model tensors with the index (a checkpoint
of another model shape); :func:`scheduler_mismatches` compares the LR scheduler with the saved one
(another ``--train-iters``, ``--lr``, ...), which megatron-core's scheduler would refuse with an
``AssertionError``.

:func:`torch_format` recognises a checkpoint in Megatron-LM's ``torch`` format
(``mp_rank_XX[_YYY]/model_optim_rng.pt`` per model-parallel rank), and among them one of a legacy
model (``--use-legacy-models``: its weights under ``language_model``): megatron-zb cannot read
either (it builds megatron-core's GPT and reads ``torch_dist``), so validation refuses such a
``--load`` before any process group starts, in one line naming the directory and the conversion.

Nothing here but :func:`raise_on_every_rank` needs a process group: every rank reads the same files
and reaches the same verdict. The directory layout (:func:`checkpoint_dir`, the tracker) is here too.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable

__all__ = ["CheckpointError", "REQUIRED_FILES", "SCHEDULER_FIELDS", "TRACKER_FILENAME", "check_scheduler",
           "checkpoint_dir", "checkpoint_iterations", "checkpoint_to_load", "damage", "earlier_checkpoint_hint",
           "first_line", "intact_problem", "latest_intact", "load_directory", "raise_on_every_rank", "read_tracker", "scheduler_mismatches",
           "shape_mismatches", "torch_format"]

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
"""Under ``--save``: the iteration of the last complete checkpoint, written after all its files."""
REQUIRED_FILES = ("metadata.json", ".metadata")
"""Files of every ``torch_dist`` checkpoint directory besides the shards."""

SCHEDULER_FIELDS: tuple[tuple[str, str], ...] = (
    ("max_lr", "--lr"), ("min_lr", "--min-lr"),
    ("lr_warmup_steps", "--lr-warmup-iters / --lr-warmup-samples / --lr-warmup-fraction [samples]"),
    ("lr_decay_steps", "--lr-decay-iters / --lr-decay-samples, default the training length [samples]"),
    ("lr_decay_style", "--lr-decay-style"), ("start_wd", "--weight-decay"), ("end_wd", "--weight-decay"),
    ("wd_incr_steps", "weight decay's increment length, --train-iters / --train-samples [samples]"),
    ("wd_incr_style", "weight decay's increment style"))
"""megatron-core ``OptimizerParamScheduler`` state fields checked on load, and the flags that set them."""

_ITER_DIR = re.compile(r"^iter_(\d{7})$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be loaded into this run (missing, damaged, another model or LR schedule).

    Raised on every rank alike, its message one line: the checkpoint, the problem, the fix.
    """


class OneRankSaveError(CheckpointError):
    """A save failed in a step megatron-core runs on this rank alone (rank 0's ``common.pt``, its check of
    the gathered sharding): the other ranks wait inside the save's next collective, so no collective can
    tell them. Raised on this rank only, its message one line naming the rank; the process must exit
    without a collective (:func:`megatron_zb.training.pretrain.main`), which ends the others.
    ``peer_lost``: this rank's save failed only because another rank's process ended (a consequence,
    said as a notice: the cause is that rank's error line)."""

    def __init__(self, message: str, *, peer_lost: bool = False) -> None:
        super().__init__(message)
        self.peer_lost = peer_lost


PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
"""How gloo (torch 2.13's ``RuntimeError`` from ``pair.cc``) says that another rank's process ended."""


def checkpoint_dir(root: str, iteration: int) -> str:
    """``ROOT/iter_0000123`` (Megatron's naming)."""
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> int | None:
    """The iteration in ``ROOT/latest_checkpointed_iteration.txt``; ``None`` when there is none."""
    path = os.path.join(root, TRACKER_FILENAME)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if text == "release":
        return 0
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{path} should hold an iteration number, found {text!r}") from None


def load_directory(root: str, ckpt_step: int | None = None) -> str | None:
    """The directory ``--load ROOT`` (and ``--ckpt-step``) names: ``ROOT/iter_NNNNNNN``, or
    ``ROOT/release`` when the tracker says ``release`` (Megatron-LM's released checkpoints);
    ``None`` when neither names one."""
    if ckpt_step is not None:
        return checkpoint_dir(root, ckpt_step)
    path = os.path.join(root, TRACKER_FILENAME)
    if os.path.isfile(path) and open(path).read().strip() == "release":
        return os.path.join(root, "release")
    iteration = read_tracker(root)
    return None if iteration is None else checkpoint_dir(root, iteration)


def _holds_legacy_model(file: str) -> bool | str:
    """Whether the torch-format state ``file`` holds a legacy model (``model`` / ``model0`` with a
    ``language_model`` entry); when it cannot be read (or was pickled with classes not installed
    here), why not (:func:`first_line` of the error): undecided. Memory-mapped: tensors are not read."""
    import torch

    try:
        state = torch.load(file, map_location="cpu", weights_only=False, mmap=True)
    except Exception as e:  # noqa: BLE001 -- any unpickling error: the refusal names it (torch_format)
        return first_line(e)
    models = [v for k, v in state.items() if re.fullmatch(r"model\d*", str(k))] if isinstance(state, dict) else []
    return any(isinstance(m, dict) and "language_model" in m for m in models)


def torch_format(path: str, *, load: str = "--load") -> str | None:
    """Why the checkpoint directory ``path`` cannot be loaded when it is in Megatron-LM's ``torch``
    format (one line: the directory, the format, what to do); ``None`` when it is not.

    Megatron-LM's test (``_get_checkpoint_format``): an entry starting ``mp_rank_0``. A legacy
    model's checkpoint (``--use-legacy-models``; Megatron-LM writes those in this format only) is
    told apart by its ``language_model`` weights."""
    if not os.path.isdir(path):
        return None
    ranks = sorted(n for n in os.listdir(path) if n.startswith("mp_rank_0"))
    if not ranks:
        return None
    file = os.path.join(path, ranks[0], "model_optim_rng.pt")
    root = os.path.dirname(os.path.normpath(path))
    legacy = _holds_legacy_model(file)
    to_dist = (f"Megatron-LM with --load DIR --ckpt-format torch --ckpt-convert-format torch_dist "
               f"--ckpt-convert-save OUT, then {load} OUT/torch_dist")
    if legacy is True:
        return (f"checkpoint {path} is a legacy-model checkpoint (Megatron-LM's --use-legacy-models: {file} holds "
                f"'language_model' weights): megatron-zb builds megatron-core's GPT and reads its torch_dist "
                f"checkpoints only; convert it with Megatron-LM's tools/checkpoint/convert.py --model-type GPT "
                f"--loader legacy --saver core --load-dir {root} --save-dir DIR, then to torch_dist ({to_dist}), "
                f"or train without {load}")
    what = "a megatron-core model's" if legacy is False else f"{file} cannot be read here to tell whose: {legacy}"
    return (f"checkpoint {path} is in Megatron-LM's torch format (--ckpt-format torch, {ranks[0]}/model_optim_rng.pt "
            f"per model-parallel rank; {what}): megatron-zb reads torch_dist checkpoints only; convert it ({to_dist} "
            f"with DIR = {root}; a legacy model's first with tools/checkpoint/convert.py --loader legacy --saver "
            f"core), or train without {load}")


def first_line(error: BaseException) -> str:
    """``Type: first line of the message`` of ``error``."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def damage(path: str, *, read_common: bool = True) -> str | None:
    """Why the checkpoint directory ``path`` cannot be read (``"FILE ...: problem"``); ``None`` when whole.

    Checks that the directory and :data:`REQUIRED_FILES` exist, that ``.metadata`` and the common
    state can be read (``common.pt``; with megatron-core 0.19 the ``"common_state"`` entry inside the
    torch_dist checkpoint, or an older checkpoint's ``common.pt``:
    :func:`~megatron_zb.megatron_compat.common_state_in_file`), and that every shard file
    ``.metadata`` names exists and holds at
    least the bytes (offset + length) of every item stored in it (``read_common=False``: ``common.pt``
    is not read, only found). Bytes changed in place
    (same length) are not detected here: the manifest's checksums find them
    (:mod:`.checkpoint_manifest`, verified first by :func:`checkpoint_to_load`).
    """
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_zb.megatron_compat import common_state_in_file

    if not os.path.isdir(path):
        return f"{path} does not exist"
    for name in REQUIRED_FILES:
        if not os.path.isfile(os.path.join(path, name)):
            return f"{os.path.join(path, name)} is missing"
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 -- any failure to read it is the damage reported
        return f"{os.path.join(path, '.metadata')} cannot be read ({first_line(e)})"
    common = os.path.join(path, "common.pt")
    if os.path.isfile(common):
        try:
            if read_common:
                torch.load(common, map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001
            return f"{common} cannot be read ({first_line(e)})"
    elif common_state_in_file():
        return f"{common} is missing"
    elif not any(key.startswith("common_state") for key in metadata.state_dict_metadata):
        return f"{os.path.join(path, '.metadata')} names no common state (common_state) and {common} is missing"
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{file} is missing (the checkpoint's .metadata names it)"
        have = os.path.getsize(file)
        if have < size:
            return f"{file} is truncated: {have} bytes, the checkpoint's .metadata needs {size}"
    return None


def checkpoint_iterations(root: str) -> list[int]:
    """Iterations of the ``iter_NNNNNNN`` directories under ``root``, ascending (whole or not)."""
    if not os.path.isdir(root):
        return []
    found = (_ITER_DIR.match(name) for name in os.listdir(root))
    return sorted(int(m.group(1)) for m in found if m and os.path.isdir(os.path.join(root, m.group(0))))


def intact_problem(path: str) -> str | None:
    """Why the checkpoint directory ``path`` is not intact; ``None`` when it is: its files are complete
    (:func:`damage`) and have the sizes its manifest lists (a ``stat`` per file; the checksums are
    verified when it is loaded, :mod:`.checkpoint_manifest`)."""
    from megatron_zb.training.checkpoint_manifest import manifest_size_problem

    return damage(path) or manifest_size_problem(path)


def latest_intact(root: str, before: int | None = None) -> int | None:
    """The latest intact checkpoint's iteration under ``root`` (:func:`intact_problem`), before
    ``before`` when given; ``None`` when there is none."""
    for it in reversed([i for i in checkpoint_iterations(root) if before is None or i < before]):
        if intact_problem(checkpoint_dir(root, it)) is None:
            return it
    return None


def earlier_checkpoint_hint(root: str, iteration: int) -> str:
    """The fix for a checkpoint of ``iteration`` under ``root`` that cannot be loaded.

    Names the latest intact checkpoint (:func:`intact_problem`) before ``iteration`` and
    the ``--ckpt-step`` that loads it, or says there is none.
    """
    it = latest_intact(root, before=iteration)
    if it is not None:
        return (f"the previous intact checkpoint is iteration {it} ({checkpoint_dir(root, it)}): "
                f"add --ckpt-step {it} to load it")
    return f"no intact checkpoint before iteration {iteration} under {root}: repair it or train without --load"


def shape_mismatches(sharded_state_dict: dict[str, Any], path: str) -> list[str]:
    """This rank's model tensors whose key is absent from the checkpoint ``path`` or whose global shape differs.

    ``sharded_state_dict``: megatron-core sharded state dicts of the model chunks (values nested
    in dicts and lists); tensors that allow a shape mismatch (vocabulary padding) are skipped.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    out: list[str] = []
    for t in nested_values(sharded_state_dict):
        if not isinstance(t, ShardedTensor) or getattr(t, "allow_shape_mismatch", False):
            continue
        if t.key not in saved:
            out.append(f"tensor {t.key} of this run's model (shape {tuple(t.global_shape)}) is not in the checkpoint")
        elif tuple(saved[t.key].size) != tuple(t.global_shape):
            out.append(f"tensor {t.key} has shape {tuple(saved[t.key].size)} in the checkpoint and "
                       f"{tuple(t.global_shape)} in this run's model")
    return out


def scheduler_mismatches(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The :data:`SCHEDULER_FIELDS` on which a saved LR-scheduler state and this run's differ, one phrase each."""
    out: list[str] = []
    seen: set[str] = set()
    for field, flag in SCHEDULER_FIELDS:
        if field in saved and field in current and saved[field] != current[field] and flag not in seen:
            seen.add(flag)
            out.append(f"{flag}: checkpoint {saved[field]}, this run {current[field]}")
    return out


def check_scheduler(common: dict[str, Any], scheduler: Any, *, optim: Any, path: str) -> tuple[str, ...]:
    """The LR-schedule settings on which the checkpoint and this run differ; refused without Megatron's flags.

    ``optim``: the run's :class:`~megatron_zb.training.run_config.OptimConfig` (its two flags below).

    megatron-core's ``OptimizerParamScheduler.load_state_dict`` asserts that they agree unless
    ``--override-opt_param-scheduler`` (this command line's values) or
    ``--use-checkpoint-opt_param-scheduler`` (the checkpoint's) is given; this says so in one line.
    """
    if scheduler is None or "opt_param_scheduler" not in common:
        return ()
    diffs = tuple(scheduler_mismatches(common["opt_param_scheduler"], scheduler.state_dict()))
    if diffs and not (optim.override_opt_param_scheduler or optim.use_checkpoint_opt_param_scheduler):
        raise CheckpointError(f"checkpoint {path} was saved with another learning-rate schedule ({'; '.join(diffs)}): "
                              f"add --use-checkpoint-opt_param-scheduler to continue the checkpoint's schedule or "
                              f"--override-opt_param-scheduler to take this command line's, or resume with the "
                              f"checkpoint's values")
    return diffs


def checkpoint_to_load(root: str, checkpoint: Any,
                       verify: Callable[[str], str | None] | None = None) -> tuple[int, str] | None:
    """(iteration, directory) ``--load`` / ``--ckpt-step`` name, checked whole; ``None``: no tracker, no ``--ckpt-step``.

    ``checkpoint``: the run's :class:`~megatron_zb.training.run_config.CheckpointConfig` (its ``ckpt_step``).
    ``verify``: called with the directory on every rank, returns this rank's problem with it (its share
    of the manifest's checksums, :func:`~.checkpoint_manifest.verify_share`); then collective: every rank
    raises the lowest failing rank's :class:`CheckpointError`. Checked after :func:`damage`'s ``stat``
    checks (no process group; they name a missing or short file more exactly) and before it reads the
    common state (a changed byte there is named as a checksum mismatch)."""
    step = checkpoint.ckpt_step
    iteration = step if step is not None else read_tracker(root)
    if iteration is None:
        return None
    path = checkpoint_dir(root, iteration)
    wrong_format = torch_format(load_directory(root, step) or path)
    if wrong_format is not None:
        raise CheckpointError(wrong_format)
    named_by = f"--ckpt-step {step}" if step is not None else \
        f"{os.path.join(root, TRACKER_FILENAME)} names iteration {iteration}"

    def refusal(problem: str) -> str:
        return f"cannot load checkpoint {path} ({named_by}): {problem}; {earlier_checkpoint_hint(root, iteration)}"

    problem = damage(path, read_common=verify is None)
    if problem is None and verify is not None:
        found = verify(path)
        raise_on_every_rank(None if found is None else refusal(found))
        problem = damage(path)  # the common state readable (checkpoints without a manifest)
    if problem is not None:
        raise CheckpointError(refusal(problem))
    return iteration, path


def raise_on_every_rank(message: str | None) -> None:
    """Collective: when any rank has a ``message``, raise :class:`CheckpointError` with the lowest such rank's on every rank."""
    import torch.distributed as dist

    messages: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    failed = [m for m in messages if m]
    if failed:
        raise CheckpointError(failed[0])

"""Checkpoints of ``pretrain_gpt_zb.py`` with megatron-core's ``dist_checkpointing`` (Megatron's layout).

Directory layout, as Megatron-LM's ``torch_dist`` checkpoints::

    SAVE/latest_checkpointed_iteration.txt     # the last complete checkpoint's iteration
    SAVE/iter_0000100/                         # one dist_checkpointing directory per save

What one checkpoint holds:

* ``model`` (``model0``, ``model1``, ... with several chunks per rank): each chunk's
  ``GPTModel.sharded_state_dict()``, built from the *unwrapped* ``GPTModel``. Layer numbers
  in the keys are global (``decoder.layers.{i}``, see :mod:`megatron_zb.model.gpt_chunks`),
  so a checkpoint loads into any placement and pipeline size (plain, V, interleaved);
* ``vocab`` (``--enable-vocab-parallel``): the vocabulary slices' ``sharded_state_dict``, dim-0 shards of
  the ``[V_pad, h]`` matrices under the keys a ``GPTModel`` with them uses (docs/vocab_parallel.md);
* ``optimizer``: ``optimizer.sharded_state_dict(model_sharded_state_dict)`` (Adam moments,
  fp32 main params, loss scaler), keyed by the same global names; with the distributed
  optimizer in Megatron-LM's ``dp_reshardable`` format (per gradient bucket of one (PP, TP)
  layout; loading it at another (PP, TP), or into a run without the distributed optimizer, is
  refused by :func:`check_optimizer_format`);
* ``opt_param_scheduler``: the LR/weight-decay scheduler's state;
* the :class:`~megatron_zb.training.state.TrainState`: ``iteration``, ``consumed_train_samples``,
  ``consumed_valid_samples`` and ``zero_bubble`` (the schedule's name, its number of stages and
  the profiled costs, so a resumed run can rebuild the profiled schedule without profiling again);
  besides ``checkpoint_version`` and ``args`` (the model's shape fields of :data:`SHAPE_ARGS`, from
  the run's :class:`~megatron_zb.training.run_config.ModelConfig`, checked on load, and
  ``use_distributed_optimizer``; Megatron-LM's key, not its whole ``argparse.Namespace``);
* ``rng_state``: per (pipeline, tensor, data)-parallel rank, Python / NumPy / torch (and CUDA)
  generator states and megatron's RNG-tracker states. Restored only when the parallel layout
  is the one saved (otherwise a warning says so and the run starts from fresh RNG streams).

Resuming therefore continues bit for bit: the same parameters, optimizer state, LR, data
position and random streams as an uninterrupted run (on CPU; fp32 and fp16, also with the
distributed optimizer: ``tests/training/test_resume_distopt.py``). megatron-core 0.16.1's distributed
optimizer with torch's Adam (no apex / Transformer Engine) needs two repairs on load, see
:func:`materialize_adam_state` and :func:`give_each_param_its_step`;
:func:`repaired_distributed_adam_load` applies them around a load done by other code (Megatron-LM's
``load_checkpoint``, :mod:`megatron_zb.megatron_lm`).

A save first checks that the checkpoint fits on ``--save``'s file system (:mod:`.save_space`), then
writes the files, then ``manifest.json`` (every file's size and CRC-32, :mod:`.checkpoint_manifest`);
the tracker is written last: a job killed during a save leaves it at the previous complete
checkpoint, and a save that does not fit or fails stops every rank with one :class:`CheckpointError`
naming the latest intact checkpoint. Before reading anything, :func:`load_checkpoint` verifies the
checkpoint's files against its manifest (unless ``--no-ckpt-verify``) and checks its files, model
tensors and LR schedule (:mod:`.checkpoint_check`) and refuses what it cannot load with one
:class:`CheckpointError`, the same on every rank, naming the previous intact checkpoint and its
``--ckpt-step`` where that is the fix (docs/training.md, "Checkpoints and failures").
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from megatron_zb.training.adam_repair import (adam_step, give_each_param_its_step, load_optimizer_state,
                                              materialize_adam_state, repaired_distributed_adam_load)
from megatron_zb.training.checkpoint_check import (TRACKER_FILENAME, CheckpointError, check_scheduler, checkpoint_dir,
                                                    checkpoint_to_load, earlier_checkpoint_hint, first_line,
                                                    latest_intact, raise_on_every_rank, read_tracker, shape_mismatches,
                                                    OneRankSaveError, PEER_LOST)
from megatron_zb.training.checkpoint_manifest import MANIFEST_FILENAME, read_manifest, verify_share, write_manifest
from megatron_zb.training.logging_utils import print_rank_0
from megatron_zb.training.save_space import save_error_text, space_problem, writer_errors_said_once
from megatron_zb.training.run_config import RunConfig, ScheduleConfig
from megatron_zb.training.state import TrainState

__all__ = [
    "CHECKPOINT_VERSION",
    "adam_step",
    "give_each_param_its_step",
    "materialize_adam_state",
    "CheckpointError",
    "LoadedCheckpoint",
    "TRACKER_FILENAME",
    "check_optimizer_format",
    "checkpoint_dir",
    "collect_rng_state",
    "load_checkpoint",
    "read_tracker",
    "repaired_distributed_adam_load",
    "restore_rng_state",
    "save_checkpoint",
    "set_before_tracker_hook",
]

CHECKPOINT_VERSION = 3.0
SHAPE_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length",
              "max_position_embeddings", "padded_vocab_size", "kv_channels")
"""Fields of :class:`~megatron_zb.training.run_config.ModelConfig` (Megatron-LM's ``args`` names) that
must agree between the saved and the loading model; stored under the checkpoint's ``args``."""


_before_tracker_hook: Callable[[int], None] | None = None


def _vocab_fix(saved: int, config: Any) -> str:
    """How this run (a :class:`~megatron_zb.training.run_config.RunConfig`) loads a checkpoint of
    ``saved`` embedding rows (:func:`~megatron_zb.planning.model.padded_vocab_fix`)."""
    from megatron_zb.planning.model import padded_vocab_fix

    return padded_vocab_fix(saved, tp=config.parallel.tensor_model_parallel_size)


def set_before_tracker_hook(hook: Callable[[int], None] | None) -> None:
    """Install ``hook`` in this process, for fault injection (tests only; ``None``, the default, removes
    it): :func:`save_checkpoint` calls ``hook(iteration)`` on every rank once the checkpoint's files are
    written, before rank 0 writes the tracker -- so that a test can kill the job while a checkpoint is
    being written (``tests/training/test_checkpoint_failures.py`` pauses there, through its launcher
    ``tests/training/pause_before_tracker.py``). The product never installs one."""
    global _before_tracker_hook
    _before_tracker_hook = hook


# ---------------------------------------------------------------------------- RNG
def collect_rng_state() -> dict[str, Any]:
    """This process's random states (Python, NumPy, torch CPU, CUDA when present, megatron's tracker)."""
    from megatron.core import tensor_parallel

    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(),
             "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`collect_rng_state`."""
    from megatron.core import tensor_parallel

    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and "cuda_rng_state" in state:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _layout() -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """((PP, TP, DP) sizes, (pp, tp, dp) ranks) of this process."""
    from megatron.core import parallel_state as ps

    sizes = (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size(),
             ps.get_data_parallel_world_size())
    ranks = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
             ps.get_data_parallel_rank())
    return sizes, ranks


def _rng_sharded_object(data: Any) -> Any:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    sizes, ranks = _layout()
    return ShardedObject("rng_state", data, sizes, ranks, replica_id=0)


# ---------------------------------------------------------------------------- state dicts
def _model_key(i: int, n: int) -> str:
    return "model" if n == 1 else f"model{i}"


def _sharded_state_dict(chunks: Sequence[Any], optimizer: Any, *, is_loading: bool,
                        use_distributed_optimizer: bool, vocab: Any = None) -> dict[str, Any]:
    """Model chunks' (unwrapped ``GPTModel`` s), the vocabulary slices' (``vocab``, under ``vocab``) and
    the optimizer's sharded state dicts."""
    from megatron.core import parallel_state

    sd: dict[str, Any] = {}
    for i, module in enumerate(chunks):
        # Megatron-LM's metadata carries the data x context-parallel group; megatron-core's GPTModel reads it
        # directly for the MTP stage's word-embedding copy (a replica of stage 0's)
        metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
        sd[_model_key(i, len(chunks))] = module.sharded_state_dict(metadata=metadata)
    if vocab is not None:
        sd["vocab"] = vocab.sharded_state_dict()
    if optimizer is not None:
        kwargs: dict[str, Any] = {}
        if use_distributed_optimizer:
            # megatron-core 0.16.1's default distributed-optimizer format does not round-trip;
            # Megatron-LM selects this one.
            kwargs["metadata"] = {"distrib_optim_sharding_type": "dp_reshardable"}
        sd["optimizer"] = optimizer.sharded_state_dict(sd, is_loading=is_loading, **kwargs)
    return sd



def check_optimizer_format(common: dict[str, Any], *, distributed: bool, layout: Sequence[int], path: str,
                           vocab_parallel: bool = False) -> None:
    """Refuse (:class:`CheckpointError`) an optimizer state this run cannot load exactly.

    ``common``: the checkpoint's common state dict; ``distributed``: this run's
    ``--use-distributed-optimizer``; ``layout``: this run's (PP, TP, DP) sizes; ``vocab_parallel``: its
    ``--enable-vocab-parallel``. The distributed optimizer's state and the other optimizers' are
    different formats; the distributed one (``dp_reshardable``, Megatron-LM's) follows the gradient
    buckets of one (PP, TP) layout -- and of one ``--enable-vocab-parallel`` (the slices have buffers of
    their own). Checkpoints that do not record a flag are not checked for it.
    """
    saved = common.get("args", {}).get("use_distributed_optimizer")
    if saved is not None and bool(saved) != distributed:
        was, now = ("with", "without") if saved else ("without", "with")
        raise CheckpointError(f"checkpoint {path} was saved {was} --use-distributed-optimizer and this run is {now} "
                              f"it: the optimizer states differ in format; resume {was} --use-distributed-optimizer")
    saved_vocab = bool(common.get("args", {}).get("enable_vocab_parallel", False))
    if distributed and saved and saved_vocab != vocab_parallel:
        was = "with" if saved_vocab else "without"
        raise CheckpointError(f"checkpoint {path} holds the distributed optimizer's state of a run {was} "
                              f"--enable-vocab-parallel: its gradient buckets are not this run's; resume {was} "
                              f"--enable-vocab-parallel, or save and load without --use-distributed-optimizer")
    saved_layout = tuple(common.get("parallel_layout", ()))[:2]
    if distributed and saved and saved_layout != tuple(layout)[:2]:
        raise CheckpointError(f"checkpoint {path} holds the distributed optimizer's state of (PP, TP) = {saved_layout}; "
                              f"this run has {tuple(layout)[:2]}: that format follows the gradient buckets of one "
                              f"(PP, TP) layout (it reshards along data parallel only); resume with the saved "
                              f"pipeline and tensor parallel sizes")


def _zero_bubble_entry(state: TrainState, schedule: ScheduleConfig) -> dict[str, Any]:
    return {"schedule": schedule.name, "num_stages": schedule.num_pipeline_stages, "costs": state.schedule_costs}


def _train_state(common: dict[str, Any], *, iteration: int, schedule: ScheduleConfig) -> TrainState:
    """The saved :class:`TrainState`; the profiled costs only when they are for this run's schedule and stages."""
    zb = common.get("zero_bubble") or {}
    same = zb.get("schedule") == schedule.name and zb.get("num_stages") == schedule.num_pipeline_stages
    return TrainState(iteration=int(common.get("iteration", iteration)),
                      consumed_train_samples=int(common.get("consumed_train_samples", 0)),
                      consumed_valid_samples=int(common.get("consumed_valid_samples", 0)),
                      schedule_costs=zb.get("costs") if same else None)


def _latest_intact_phrase(root: str) -> str:
    """The checkpoint a run can resume from after a failed save under ``root`` (the tracker is not advanced)."""
    it = latest_intact(root)
    if it is None:
        return f"no intact checkpoint under {root} yet"
    return f"the latest intact checkpoint is iteration {it} ({checkpoint_dir(root, it)}), which --load {root} resumes"


def _save_state_dict(state: TrainState, chunks: Sequence[Any], optimizer: Any, scheduler: Any, config: RunConfig,
                     vocab: Any) -> dict[str, Any]:
    """What :func:`save_checkpoint` writes (its docstring and the module's)."""
    if optimizer is not None:
        materialize_adam_state(optimizer)
    distributed = config.parallel.use_distributed_optimizer
    sd = _sharded_state_dict(chunks, optimizer, is_loading=False, use_distributed_optimizer=distributed, vocab=vocab)
    sd.update({
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": state.iteration,
        "consumed_train_samples": state.consumed_train_samples,
        "consumed_valid_samples": state.consumed_valid_samples,
        "args": {**{k: getattr(config.model, k) for k in SHAPE_ARGS}, "use_distributed_optimizer": distributed,
                 "enable_vocab_parallel": vocab is not None},
        "parallel_layout": _layout()[0],
        "rng_state": _rng_sharded_object(collect_rng_state()),
    })
    if scheduler is not None:
        sd["opt_param_scheduler"] = scheduler.state_dict()
    sd["zero_bubble"] = _zero_bubble_entry(state, config.schedule)
    return sd


def _write(sd: dict[str, Any], root: str, path: str) -> None:
    """megatron-core's ``dist_checkpointing.save`` of ``sd`` into ``path``, then its manifest; collective.
    A failed write (an ``OSError`` of a writer, which megatron-core reports on every rank) raises one
    :class:`CheckpointError` on every rank naming it and the latest intact checkpoint."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    error = None
    if dist.get_rank() == 0:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            error = first_line(e)
    messages: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, error)  # also the barrier before every rank writes into path
    error = messages[0]
    if error is None:
        try:
            with writer_errors_said_once():
                dist_checkpointing.save(sd, path)
        except CheckpointException as e:  # torch's: the writers' results gathered, raised on every rank
            error = save_error_text(e)
        except Exception as e:  # noqa: BLE001 -- a step of this rank alone: the others wait in the save
            text = save_error_text(e)
            raise OneRankSaveError(f"rank {dist.get_rank()}: cannot save checkpoint {path}: {text}; "
                                   f"the tracker is not advanced: {_latest_intact_phrase(root)}",
                                   peer_lost=any(p in text for p in PEER_LOST)) from e
    if error is None:
        error = write_manifest(path, int(sd["iteration"]))  # before the tracker: a named checkpoint has one
    raise_on_every_rank(None if error is None else
                        f"cannot save checkpoint {path}: {error}; the tracker is not advanced: "
                        f"{_latest_intact_phrase(root)}")


def save_checkpoint(root: str, *, state: TrainState, chunks: Sequence[Any], optimizer: Any, scheduler: Any,
                    config: RunConfig, vocab: Any = None) -> str:
    """Save a checkpoint of ``state.iteration`` under ``root``; collective over all ranks. Returns its directory.

    ``chunks`` are this rank's unwrapped ``GPTModel`` chunks in stage order; ``vocab``: its
    :class:`~megatron_zb.model.vocab_parallel.VocabParallelSlices` (``--enable-vocab-parallel``); ``config``: the run's
    (its model's shape, the distributed optimizer, the schedule the profiled costs belong to).

    In order: the free space (:func:`~.save_space.space_problem`: a checkpoint that does not fit is not
    started), the files (megatron-core), the manifest (:func:`~.checkpoint_manifest.write_manifest`), the
    tracker. Raises :class:`CheckpointError` on every rank, the tracker not advanced, when the checkpoint
    does not fit or its write fails; the message names the latest intact checkpoint.
    """
    path = checkpoint_dir(root, state.iteration)
    sd = _save_state_dict(state, chunks, optimizer, scheduler, config, vocab)
    problem = space_problem(root, path, sd)
    raise_on_every_rank(None if problem is None else
                        f"cannot save checkpoint {path}: {problem}; {_latest_intact_phrase(root)}")
    _write(sd, root, path)
    if _before_tracker_hook is not None:
        _before_tracker_hook(state.iteration)
    error = None
    if dist.get_rank() == 0:  # last: a save killed before this line leaves the tracker at the previous one
        tmp = os.path.join(root, TRACKER_FILENAME + ".tmp")
        try:
            with open(tmp, "w") as f:
                f.write(str(state.iteration))
            os.replace(tmp, os.path.join(root, TRACKER_FILENAME))
        except OSError as e:
            error = (f"cannot save checkpoint {path}: its files and manifest are written, but the tracker is not: "
                     f"{first_line(e)}; {_latest_intact_phrase(root)}")
    raise_on_every_rank(error)  # also the barrier after which every rank may read the tracker
    return path


def _verify(path: str) -> str | None:
    """This rank's share of verifying the checkpoint ``path`` against its manifest (``--ckpt-verify``, the
    default); a checkpoint without one loads with one ``WARNING:`` line."""
    manifest = read_manifest(path)
    if manifest == (None, None):
        print_rank_0(f"WARNING: checkpoint {path} has no {MANIFEST_FILENAME} (saved before megatron-zb wrote "
                     f"manifests, or by Megatron-LM's own loop): its files are loaded unverified")
        return None
    start = time.perf_counter()
    problem = verify_share(path, manifest, dist.get_rank(), dist.get_world_size())
    files = manifest[0]
    total = sum(int(e["bytes"]) for e in (files or {}).values())
    print_rank_0(f"checked checkpoint {path} against its {MANIFEST_FILENAME}: {len(files or {})} files, "
                 f"{total / 2**20:.1f} MiB, CRC-32 shared over {dist.get_world_size()} ranks in "
                 f"{time.perf_counter() - start:.2f} s (rank 0's share; --no-ckpt-verify skips it)")
    return problem


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What :func:`load_checkpoint` restored besides model, optimizer and scheduler.

    Attributes:
        state: the saved :class:`TrainState` (``schedule_costs`` only when saved for this run's
            schedule and number of stages, else ``None``).
        path: the checkpoint directory read.
        rng_restored: whether the random states were restored (same parallel layout).
        same_layout: whether the checkpoint was saved with this (PP, TP, DP) layout.
        scheduler_differences: LR-schedule settings on which the checkpoint and this run differ
            (resolved by ``--override-opt_param-scheduler`` / ``--use-checkpoint-opt_param-scheduler``).
    """

    state: TrainState
    path: str
    rng_restored: bool
    same_layout: bool
    scheduler_differences: tuple[str, ...] = ()


def load_checkpoint(root: str, *, chunks: Sequence[Any], optimizer: Any, scheduler: Any, config: RunConfig,
                    load_rng: bool = True, vocab: Any = None) -> LoadedCheckpoint | None:
    """Load the checkpoint ``--load`` names into ``chunks`` / ``optimizer`` / ``scheduler``. Collective.

    ``config``: the run's (``--ckpt-step``, the LR-schedule flags, the model's shape, the distributed
    optimizer, the schedule). The tracker's iteration, or ``--ckpt-step`` when set. Returns ``None``
    when ``root`` holds no tracker file and no ``--ckpt-step`` is given. Raises
    :class:`CheckpointError` on every rank, before anything is loaded where it can be told
    beforehand, when the checkpoint is damaged (:func:`~.checkpoint_check.damage`; the message
    names the previous intact checkpoint and its ``--ckpt-step``), holds another model (the
    flags or the first mismatching tensor), another LR schedule without Megatron's flags for it,
    or an optimizer state this run cannot load (:func:`check_optimizer_format`). Unless ``--no-ckpt-verify``,
    its files are first verified against its manifest (sizes and CRC-32, shared over the ranks:
    :mod:`.checkpoint_manifest`), which names the first file whose bytes changed.
    """
    from megatron.core import dist_checkpointing

    found = checkpoint_to_load(root, config.checkpoint, verify=_verify if config.checkpoint.ckpt_verify else None)
    if found is None:
        return None
    iteration, path = found
    common = dist_checkpointing.load_common_state_dict(path)
    saved = common.get("args", {})
    diff = [f"--{k.replace('_', '-')}: checkpoint {saved[k]}, this run {getattr(config.model, k)}"
            + (f" ({_vocab_fix(saved[k], config)})" if k == "padded_vocab_size" else "")
            for k in SHAPE_ARGS if k in saved and saved[k] != getattr(config.model, k)]
    if diff:
        raise CheckpointError(f"checkpoint {path} holds a different model: " + "; ".join(diff))
    distributed = config.parallel.use_distributed_optimizer
    if optimizer is not None:
        check_optimizer_format(common, distributed=distributed, layout=_layout()[0], path=path,
                               vocab_parallel=vocab is not None)
    scheduler_differences = check_scheduler(common, scheduler, optim=config.optim, path=path)
    if optimizer is not None and distributed:
        # megatron-core's DistributedOptimizer.sharded_state_dict(is_loading=True) reads the step of
        # torch Adam's state, which a fresh optimizer does not have yet (apex/TE FusedAdam need none).
        materialize_adam_state(optimizer)
    sd = _sharded_state_dict(chunks, optimizer, is_loading=True, use_distributed_optimizer=distributed, vocab=vocab)
    mismatched = shape_mismatches({k: v for k, v in sd.items() if k.startswith("model") or k == "vocab"}, path)
    raise_on_every_rank(f"checkpoint {path} holds another model: {mismatched[0]}"
                         + (f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else "")
                         + "; load it with the model flags it was saved with" if mismatched else None)
    if scheduler is not None and "opt_param_scheduler" in common:
        sd["opt_param_scheduler"] = common["opt_param_scheduler"]
    same_layout = tuple(common.get("parallel_layout", ())) == _layout()[0]
    rng = load_rng and same_layout
    if rng:
        sd["rng_state"] = _rng_sharded_object(None)
    error = None
    try:
        loaded = dist_checkpointing.load(sd, path, strict=config.checkpoint.dist_ckpt_strictness)
        for i, module in enumerate(chunks):
            module.load_state_dict(loaded[_model_key(i, len(chunks))], strict=True)
        if vocab is not None:
            vocab.load_state_dict(loaded["vocab"], strict=True)
    except Exception as e:  # noqa: BLE001 -- reported on every rank as one line below
        error = (f"cannot load checkpoint {path}: {first_line(e)}; "
                 f"{earlier_checkpoint_hint(os.path.dirname(path), iteration)}")
    raise_on_every_rank(error)
    if optimizer is not None:
        load_optimizer_state(optimizer, loaded["optimizer"], distributed=distributed)
    if scheduler is not None and "opt_param_scheduler" in loaded:
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if rng:
        restore_rng_state(loaded["rng_state"])
    return LoadedCheckpoint(state=_train_state(common, iteration=iteration, schedule=config.schedule), path=path,
                            rng_restored=rng, same_layout=same_layout, scheduler_differences=scheduler_differences)

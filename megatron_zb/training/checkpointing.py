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

The tracker is written last, after every rank's files: a job killed during a save leaves it at
the previous complete checkpoint. Before reading anything, :func:`load_checkpoint` checks the
checkpoint's files, model tensors and LR schedule (:mod:`.checkpoint_check`) and refuses what
it cannot load with one :class:`CheckpointError`, the same on every rank, naming the previous
complete checkpoint and its ``--ckpt-step`` where that is the fix (docs/training.md,
"Checkpoints and failures").
"""

from __future__ import annotations

import contextlib
import os
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist

from megatron_zb.training.checkpoint_check import (TRACKER_FILENAME, CheckpointError, check_scheduler, checkpoint_dir,
                                                    checkpoint_to_load, earlier_checkpoint_hint, first_line,
                                                    raise_on_every_rank, read_tracker, shape_mismatches)
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
    sd: dict[str, Any] = {}
    for i, module in enumerate(chunks):
        sd[_model_key(i, len(chunks))] = module.sharded_state_dict()
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


def _adam_step_dtype() -> torch.dtype:
    """The dtype torch's Adam gives its per-parameter ``step`` tensor (float64 only when that is the default)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def adam_step(value: float, *, param: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """Adam's ``step`` tensor holding ``value``, where torch's Adam puts it (``torch/optim/adam.py``).

    A fused or capturable group keeps ``step`` on the parameter's device (fp32 when fused); any
    other group keeps it on the CPU on purpose (no kernel launch per step) -- the same rule
    ``Optimizer.load_state_dict`` applies when it places a loaded ``step``.
    """
    if group.get("fused") or group.get("capturable"):
        dtype = torch.float32 if group.get("fused") else _adam_step_dtype()
        return torch.tensor(value, dtype=dtype, device=param.device)
    return torch.tensor(value, dtype=_adam_step_dtype(), device="cpu")


def materialize_adam_state(optimizer: Any) -> None:
    """Give each parameter that has no Adam state yet the state torch's Adam creates at its first step.

    Before the first *successful* step (e.g. fp16 iterations skipped for overflow) torch's Adam
    has no state: a save would hold no ``exp_avg`` and loading it fails (megatron-core asks for
    the state it initialises). ``step`` 0 and zero moments are exactly what Adam's first step
    would create, so training continues bit for bit as without the save.

    A post-validation wrapper validates its pending step first: rolling back an eager first
    step removes the state that step created.
    """
    from megatron_zb.optimizer import PostValidationOptimizer

    if isinstance(optimizer, PostValidationOptimizer):
        optimizer.validate()
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        opt = getattr(part, "optimizer", None)
        if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in opt.param_groups:
            for p in group["params"]:
                if len(opt.state[p]) == 0:
                    st = opt.state[p]
                    st["step"] = adam_step(0.0, param=p, group=group)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if group.get("amsgrad"):
                        st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _restore_zero_steps(optimizer_sd: Any) -> None:
    """Put back Adam's ``step`` 0 that megatron-core 0.16.1 drops when saving.

    megatron-core saves the shared per-parameter step as ``common_step`` only ``if step:`` -- not
    when it is 0 (a checkpoint saved before any successful step, see
    :func:`materialize_adam_state`); torch's ``load_state_dict`` then fails on the missing key.
    """
    for part in optimizer_sd if isinstance(optimizer_sd, list) else [optimizer_sd]:
        inner = part.get("optimizer") if isinstance(part, dict) else None
        state = inner.get("state") if isinstance(inner, dict) else None
        if not isinstance(state, dict) or "common_step" in state:
            continue
        for param_state in state.values():
            if isinstance(param_state, dict) and "exp_avg" in param_state and "step" not in param_state:
                # load_state_dict moves it to the parameter's device where the group needs it
                param_state["step"] = torch.tensor(0.0, dtype=torch.float32, device="cpu")


def _saved_adam_steps(optimizer: Any, optimizer_sd: Any) -> list[float | None]:
    """Per part of a distributed ``optimizer``, the Adam step its checkpoint holds (``None``: none saved).

    megatron-core's ``DistributedOptimizer.state_dict()`` keeps the step once per parameter
    group, as ``param_groups[i]["step"]`` (torch Adam: always; apex/TE FusedAdam: once it stepped);
    the groups of one part agree.
    """
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    sds = [optimizer_sd] if len(parts) == 1 else [v for _, v in sorted(optimizer_sd.items())]
    steps: list[float | None] = []
    for sd in sds:
        found = {g["step"] for g in sd["optimizer"]["param_groups"] if g.get("step") is not None}
        if len(found) > 1:
            raise CheckpointError(f"the distributed optimizer's checkpoint holds different Adam steps in one part: "
                                  f"{sorted(found)}")
        steps.append(float(found.pop()) if found else None)
    return steps


def give_each_param_its_step(optimizer: Any, steps: Sequence[float | None]) -> None:
    """Set every parameter's Adam ``step`` to its part's saved step, as a tensor of its own.

    megatron-core 0.16.1's ``DistributedOptimizer.load_state_dict`` (torch Adam, no apex/TE)
    gives *one* step tensor to every parameter, and then ``load_parameter_state_from_dp_reshardable``
    copies into it the step the optimizer had *before* the load (the ``dp_reshardable`` format
    keeps ``step`` as a local, non-persistent object). torch's Adam increments ``state["step"]``
    in place once per parameter, so a shared tensor grows by the number of parameters per
    iteration; either makes the bias correction wrong from the first resumed step on.
    """
    for part, step in zip(getattr(optimizer, "chained_optimizers", [optimizer]), steps):
        opt = part.optimizer
        if step is None or not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
            continue  # apex/TE FusedAdam: the step lives in the param groups
        for group in opt.param_groups:
            for p in group["params"]:
                param_state = opt.state.get(p)
                if param_state is not None and "step" in param_state:
                    param_state["step"] = adam_step(step, param=p, group=group)


def _load_optimizer_state(optimizer: Any, optimizer_sd: Any, *, distributed: bool) -> None:
    """``optimizer.load_state_dict(optimizer_sd)`` with the repairs megatron-core 0.16.1 needs with torch's Adam."""
    _restore_zero_steps(optimizer_sd)
    steps = _saved_adam_steps(optimizer, optimizer_sd) if distributed else None
    with torch.no_grad():  # the distributed optimizer copies into its (leaf) main-param shards in place
        optimizer.load_state_dict(optimizer_sd)
    if steps is not None:
        give_each_param_its_step(optimizer, steps)


def _is_distributed_torch_adam(optimizer: Any) -> bool:
    """Whether some part of ``optimizer`` is megatron-core's ``DistributedOptimizer`` over torch's Adam / AdamW."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    adam = (torch.optim.Adam, torch.optim.AdamW)
    return any(isinstance(part, DistributedOptimizer) and isinstance(part.optimizer, adam)
               for part in getattr(optimizer, "chained_optimizers", [optimizer]))


def _loaded_group_steps(optimizer: Any) -> list[float | None]:
    """Per part of a distributed ``optimizer`` just loaded, the saved Adam step: megatron-core's
    ``DistributedOptimizer.load_state_dict`` hands each saved parameter group, its ``step`` included,
    to the torch optimizer's ``load_state_dict`` (``None``: nothing loaded into that part)."""
    steps: list[float | None] = []
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        found = {g["step"] for g in part.optimizer.param_groups if g.get("step") is not None}
        if len(found) > 1:
            raise CheckpointError(f"the loaded distributed optimizer holds different Adam steps in one part: "
                                  f"{sorted(found)}")
        steps.append(float(found.pop()) if found else None)
    return steps


@contextlib.contextmanager
def repaired_distributed_adam_load(optimizer: Any) -> Iterator[None]:
    """Around a load of ``optimizer`` that other code performs (Megatron-LM's ``load_checkpoint``):
    megatron-core 0.16.1's distributed optimizer with torch's Adam (no apex / Transformer Engine)
    gets the repairs :func:`load_checkpoint` applies to its own loads. Before: Adam's state as its
    first step creates it (:func:`materialize_adam_state`; else ``sharded_state_dict(is_loading=True)``
    fails at ``assert len(steps) == 1``); during: no autograd (the load copies into the leaf
    main-parameter shards in place, which autograd refuses for fp32 parameters); after: every
    parameter gets the saved step as a tensor of its own (:func:`give_each_param_its_step`).
    Anything else (no optimizer, not distributed, apex/TE FusedAdam) is left as it is."""
    if optimizer is None or not _is_distributed_torch_adam(optimizer):
        yield
        return
    materialize_adam_state(optimizer)
    with torch.no_grad():
        yield
    give_each_param_its_step(optimizer, _loaded_group_steps(optimizer))


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


def save_checkpoint(root: str, *, state: TrainState, chunks: Sequence[Any], optimizer: Any, scheduler: Any,
                    config: RunConfig, vocab: Any = None) -> str:
    """Save a checkpoint of ``state.iteration`` under ``root``; collective over all ranks. Returns its directory.

    ``chunks`` are this rank's unwrapped ``GPTModel`` chunks in stage order; ``vocab``: its
    :class:`~megatron_zb.model.vocab_parallel.VocabParallelSlices` (``--enable-vocab-parallel``); ``config``: the run's
    (its model's shape, the distributed optimizer, the schedule the profiled costs belong to).
    """
    from megatron.core import dist_checkpointing

    path = checkpoint_dir(root, state.iteration)
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
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
    dist_checkpointing.save(sd, path)
    dist.barrier()
    if _before_tracker_hook is not None:
        _before_tracker_hook(state.iteration)
    if dist.get_rank() == 0:  # last: a save killed before this line leaves the tracker at the previous one
        tmp = os.path.join(root, TRACKER_FILENAME + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(state.iteration))
        os.replace(tmp, os.path.join(root, TRACKER_FILENAME))
    dist.barrier()
    return path


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
    names the previous complete checkpoint and its ``--ckpt-step``), holds another model (the
    flags or the first mismatching tensor), another LR schedule without Megatron's flags for it,
    or an optimizer state this run cannot load (:func:`check_optimizer_format`).
    """
    from megatron.core import dist_checkpointing

    found = checkpoint_to_load(root, config.checkpoint)
    if found is None:
        return None
    iteration, path = found
    common = dist_checkpointing.load_common_state_dict(path)
    saved = common.get("args", {})
    diff = [f"--{k.replace('_', '-')}: checkpoint {saved[k]}, this run {getattr(config.model, k)}"
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
        _load_optimizer_state(optimizer, loaded["optimizer"], distributed=distributed)
    if scheduler is not None and "opt_param_scheduler" in loaded:
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if rng:
        restore_rng_state(loaded["rng_state"])
    return LoadedCheckpoint(state=_train_state(common, iteration=iteration, schedule=config.schedule), path=path,
                            rng_restored=rng, same_layout=same_layout, scheduler_differences=scheduler_differences)

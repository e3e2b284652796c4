"""megatron-core 0.16.1's distributed optimizer with torch's Adam, saved and loaded exactly.

Two repairs (docs/training.md, "Checkpoints and failures"): Adam's state created before the first
successful step so that it can be saved (:func:`materialize_adam_state`), and after a load every
parameter given the saved ``step`` as a tensor of its own (:func:`give_each_param_its_step`).
:func:`load_optimizer_state` applies them to :func:`~megatron_zb.training.checkpointing.load_checkpoint`'s
loads, :func:`repaired_distributed_adam_load` around a load done by other code (Megatron-LM's
``load_checkpoint``, :mod:`megatron_zb.megatron_lm`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch

from megatron_zb.training.checkpoint_check import CheckpointError

__all__ = ["adam_step", "give_each_param_its_step", "load_optimizer_state", "materialize_adam_state",
           "repaired_distributed_adam_load"]


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


def load_optimizer_state(optimizer: Any, optimizer_sd: Any, *, distributed: bool) -> None:
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

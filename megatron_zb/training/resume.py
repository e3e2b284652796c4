"""``--load`` for the Trainer: the latest checkpoint into the model, the optimizer and scheduler and the
planner's measured costs, with Megatron-LM's log lines and what ``--finetune`` / ``--no-load-optim`` /
``--no-load-rng`` leave unrestored (the files themselves: :mod:`.checkpointing`)."""

from __future__ import annotations

import time
from typing import Any

from megatron_zb.training.checkpointing import load_checkpoint
from megatron_zb.training.logging_utils import print_rank_0
from megatron_zb.training.model_setup import ModelBundle
from megatron_zb.training.optimizer_setup import OptimizerBundle
from megatron_zb.training.replanning import SchedulePlanner
from megatron_zb.training.run_config import RunConfig
from megatron_zb.training.state import TrainState

__all__ = ["resume"]


def resume(config: RunConfig, *, model: ModelBundle, optim: OptimizerBundle, planner: SchedulePlanner) -> TrainState:
    """``--load``: the latest checkpoint into ``model``, ``optim``'s optimizer and scheduler and ``planner``'s
    measured costs; the state to continue from. Collective."""
    ckpt = config.checkpoint
    t0 = time.perf_counter()
    print_rank_0(f"> loading checkpoint from {ckpt.load} ...")
    load_optim = not (ckpt.no_load_optim or ckpt.finetune)
    loaded = load_checkpoint(ckpt.load, chunks=model.gpt_models,
                             optimizer=optim.optimizer if load_optim else None,
                             scheduler=optim.scheduler if load_optim else None,
                             config=config, load_rng=not (ckpt.no_load_rng or ckpt.finetune),
                             vocab=model.vocab_slices)
    if loaded is None:
        print_rank_0(f"WARNING: no checkpoint in {ckpt.load} (no latest_checkpointed_iteration.txt); "
                     f"training from scratch")
        return TrainState()
    if loaded.scheduler_differences:
        which = ("this command line's (--override-opt_param-scheduler)" if config.optim.override_opt_param_scheduler
                 else "the checkpoint's (--use-checkpoint-opt_param-scheduler)")
        print_rank_0(f"> learning-rate schedule: {which}; they differ in " + "; ".join(loaded.scheduler_differences))
    if not load_optim:
        optim.optimizer.reload_model_params()  # the fp32 main params from the loaded model, as Megatron-LM
    if ckpt.no_load_rng or ckpt.finetune or ckpt.no_load_optim:
        return _loaded_partly(config, planner, loaded, load_optim=load_optim, seconds=time.perf_counter() - t0)
    if not loaded.rng_restored:
        print_rank_0("WARNING: the checkpoint was saved with another (pipeline, tensor, data)-parallel layout; "
                     "random states are not restored (dropout streams start afresh)")
    planner.restore(loaded.state.schedule_costs, iteration=loaded.state.iteration)
    print_rank_0(f"  successfully loaded checkpoint from {loaded.path} at iteration {loaded.state.iteration} "
                 f"({time.perf_counter() - t0:.1f} s)")
    return loaded.state


def _loaded_partly(config: RunConfig, planner: SchedulePlanner, loaded: Any, *, load_optim: bool,
                   seconds: float) -> TrainState:
    """After a load with ``--no-load-optim``, ``--no-load-rng`` or ``--finetune``: say what was not
    restored; the state to continue from (``--finetune``: iteration 0, nothing consumed, no costs)."""
    ckpt = config.checkpoint
    kept = [what for what, fresh in (("optimizer state and learning-rate scheduler", not load_optim),
                                     ("random states", not loaded.rng_restored)) if fresh]
    flags = " ".join(f for f, on in (("--finetune", ckpt.finetune), ("--no-load-optim", ckpt.no_load_optim),
                                     ("--no-load-rng", ckpt.no_load_rng)) if on)
    print_rank_0(f"> {flags}: not restored from the checkpoint: {', '.join(kept) or 'nothing'}"
                 + ("; starting at iteration 0 with no consumed samples (--finetune)" if ckpt.finetune else ""))
    state = TrainState() if ckpt.finetune else loaded.state
    if not ckpt.finetune:
        planner.restore(loaded.state.schedule_costs, iteration=loaded.state.iteration)
    print_rank_0(f"  successfully loaded checkpoint from {loaded.path} at iteration {state.iteration} "
                 f"({seconds:.1f} s)")
    return state

"""Optimizer post-validation inside NVIDIA Megatron-LM's own training loop.

With ``--enable-optimizer-post-validation`` on Megatron-LM's command line (``megatron_zb.megatron_lm.install()``),
:func:`install` rebinds two names of ``megatron.training.training`` (its ``setup_model_and_optimizer``
and ``train`` call them by those names), as :func:`megatron_zb.patch_megatron` rebinds megatron-core's:

* ``get_megatron_optimizer``: the optimizer Megatron-LM builds is wrapped in
  :class:`~megatron_zb.optimizer.PostValidationOptimizer`, with the settings of ``pretrain_gpt_zb.py``
  (:func:`~megatron_zb.training.wiring.wrap_post_validation`: ``--enable-exactly-numeric-match``,
  ``--post-validation-warmup-iters``, ``--post-validation-fallback-clean-iters``,
  ``--pipeline-timeout-seconds``). Megatron-LM's LR scheduler, ``grad_scale_func`` and checkpoints
  then use the wrapper (its ``state_dict`` / ``load_state_dict`` validate first).
* ``train_step``: :func:`post_validated_train_step`. Megatron-LM's own ``train_step`` runs with the
  wrapper: its ``optimizer.step()`` updates eagerly, without waiting for the pipeline-wide found-inf
  / grad-norm reductions, and returns the provisional ``(True, None, None)``. When it returns, the
  step is validated, and what ``train_step`` derived from the provisional result is repaired:
  the LR scheduler (stepped back when the validated step was skipped, forward when a step it
  counted as skipped was taken), and the ``skipped_iter``, ``grad_norm`` and ``num_zeros_in_grad``
  that ``train`` hands to ``training_log``, as ``train_step``'s model-parallel reductions would give
  them (post-validation's own reductions made them equal on every rank already). So Megatron-LM's
  log line, skipped-iteration count, TensorBoard and checkpoints see the validated values.

Why the step is validated at the end of ``train_step`` and not before the next forward (where
``pretrain_gpt_zb.py`` validates it): Megatron-LM's ``train_step`` all-reduces
``update_successful`` and ``grad_norm`` over the model-parallel group right after
``optimizer.step()`` (blocking, over every pipeline stage), and its ``train`` reads
``optimizer.get_loss_scale()`` for the log line before the next iteration (the loss scale after an
fp16 step is known only once the step is validated). So the stages leave ``train_step`` together
as they do without post-validation; what post-validation removes from the iteration is the two
blocking all-reduces megatron-core's ``step()`` makes before its update (found-inf, grad norm):
each stage updates as soon as its own backward is done, and those reductions complete while
Megatron-LM's own run. ``begin_iteration`` still opens every ``train_step`` (nothing is pending
then; it guarantees no forward uses parameters that may still be rolled back).

Each rank that rolls a step back prints one line (``megatron-zb: post-validation rolled back ...``).
What Megatron-LM's loop cannot give post-validation is refused before it initialises
(:func:`check_flags`, one line, exit 2).
"""

from __future__ import annotations

import argparse
import functools
from typing import Any, Callable

from ..training.arguments.common import ArgumentError
from .rebind import Rebinds

__all__ = ["REFUSED", "check_flags", "install", "post_validated_train_step", "uninstall"]

REFUSED: dict[str, str] = {
    "optimizer_cpu_offload": "the offloaded (hybrid-device) optimizer's step is not the one post-validation "
                             "mirrors; drop one of the two",
    "use_precision_aware_optimizer": "post-validation does not mirror the precision-aware optimizer's step "
                                     "(decoupled grads); drop one of the two",
    "overlap_param_gather_with_optimizer_step": "post-validation does not mirror the parameter all-gather "
                                                "overlapped with the optimizer step; drop one of the two",
    "use_megatron_fsdp": "post-validation supports megatron-core DDP (with or without the distributed "
                         "optimizer), not Megatron FSDP; drop one of the two",
    "use_torch_fsdp2": "post-validation supports megatron-core DDP, not torch FSDP2; drop one of the two",
}
"""Megatron-LM flags (``args`` attribute -> why and what to do) refused with ``--enable-optimizer-post-validation``."""

_REBINDS = Rebinds()
"""What :func:`install` replaced in ``megatron.training.training`` (restored by :func:`uninstall`)."""


def check_flags(args: argparse.Namespace, spec: Any) -> None:
    """Post-validation's flags on Megatron-LM's parsed ``args``: the rules of ``pretrain_gpt_zb.py``
    (:func:`~megatron_zb.training.arguments.zero_bubble.check_post_validation`; ``spec``: the
    zero-bubble schedule's, None for megatron-core's own), then what Megatron-LM's loop adds.
    Raises :class:`ArgumentError` naming the flag."""
    from ..training.arguments.common import flag
    from ..training.arguments.zero_bubble import check_post_validation

    check_post_validation(args, spec)
    if not args.enable_optimizer_post_validation:
        return
    for dest, why in REFUSED.items():
        if getattr(args, dest, False):
            raise ArgumentError(flag(dest), f"cannot be combined with --enable-optimizer-post-validation: {why}")
    if "muon" in args.optimizer:
        raise ArgumentError("--optimizer", f"{args.optimizer!r}: Megatron-LM builds Muon with "
                                           f"get_megatron_muon_optimizer, which post-validation does not wrap; use "
                                           f"--optimizer adam or sgd, or drop --enable-optimizer-post-validation")
    if args.optimizer != "adam" and not args.enable_exactly_numeric_match:
        raise ArgumentError("--optimizer", f"{args.optimizer!r}: the in-place rollback inverts Adam steps only; "
                                           f"add --enable-exactly-numeric-match (exact rollback) or use adam")
    if (getattr(args, "expert_model_parallel_size", 1) or 1) > 1:
        raise ArgumentError("--expert-model-parallel-size", "expert parallelism gives the expert optimizer "
                                                            "another grad-stats group, which post-validation does "
                                                            "not support; use 1 or drop "
                                                            "--enable-optimizer-post-validation")


def install(args: argparse.Namespace) -> None:
    """Rebind ``megatron.training.training``'s ``get_megatron_optimizer`` and ``train_step`` (module
    docstring). ``args``: Megatron-LM's parsed arguments, checked by :func:`check_flags` (read when
    the optimizer is built). Idempotent; :func:`uninstall` restores both names."""
    from megatron.training import training

    if _REBINDS:
        return
    build = training.get_megatron_optimizer

    @functools.wraps(build)
    def get_megatron_optimizer(*a: Any, **kw: Any) -> Any:
        from ..training.run_config import PostValidationConfig
        from ..training.wiring import wrap_post_validation

        return wrap_post_validation(PostValidationConfig.from_args(args), build(*a, **kw))

    for name, value in (("get_megatron_optimizer", get_megatron_optimizer),
                        ("train_step", post_validated_train_step(training.train_step))):
        _REBINDS.set(training, name, value)


def uninstall() -> None:
    """Restore the names :func:`install` rebound."""
    _REBINDS.restore()


def post_validated_train_step(original: Callable) -> Callable:
    """Megatron-LM's ``train_step`` (core_v0.16.1, core_v0.19.0; ``original``, same arguments) around a
    :class:`~megatron_zb.optimizer.PostValidationOptimizer`: ``begin_iteration`` first, the step
    validated when ``original`` returns and its returned values repaired (module docstring)."""

    @functools.wraps(original)
    def train_step(forward_step_func: Callable, data_iterator: Any, model: Any, optimizer: Any,
                   opt_param_scheduler: Any, config: Any, forward_backward_func: Callable,
                   iteration: int | None = None, **kwargs: Any) -> tuple:
        """``kwargs``: what a later release's ``train_step`` takes besides (core_v0.19.0:
        ``pg_collection``, ``p2p_communicator``), passed on."""
        optimizer.begin_iteration()  # nothing pending (validated at the end of the previous call)
        eager_steps = optimizer.counters().eager_steps
        out = original(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
                       forward_backward_func, iteration=iteration, **kwargs)
        if optimizer.counters().eager_steps == eager_steps:  # megatron-core's synchronous step (warm-up,
            return out                                       # fallback), or no step: its values stand
        return _validated(out, optimizer, opt_param_scheduler, iteration)

    return train_step


def _validated(out: tuple, optimizer: Any, scheduler: Any, iteration: int | None) -> tuple:
    """Validate the step that took the eager path (every rank alike; a rank whose own grad norm
    proved clipping has validated it inside ``step()`` already); ``out``: ``train_step``'s 8 values
    from the provisional result, returned with ``skipped_iter``, ``grad_norm`` and
    ``num_zeros_in_grad`` validated; the scheduler made to follow the validated outcome.
    ``iteration``: Megatron-LM's 0-based count.

    The validated values come from post-validation's all-reduces over the grad-stats group, which
    holds the model-parallel group: every rank there has the same ones. ``train_step`` would reduce
    them over that group (``logical_and_across_model_parallel_group``,
    ``reduce_max_stat_across_model_parallel_group``); with equal values on every rank those give the
    value itself, as float32 (:func:`_as_reduced`), so no further collective runs here."""
    import torch
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.training import get_args

    loss_dict, skipped_iter, should_checkpoint, should_exit, exit_code, _, _, max_logit = out
    optimizer.validate()
    report = optimizer.last_report
    args = get_args()
    successful = bool(report.result.update_successful)
    if successful == bool(skipped_iter):  # train_step stepped the scheduler on the provisional outcome
        increment = get_num_microbatches() * args.micro_batch_size * args.data_parallel_size
        scheduler.step(increment=increment if successful else -increment)
    num_zeros = report.result.num_zeros_in_grad
    if args.log_num_zeros_in_grad:
        num_zeros = _as_reduced(num_zeros)
    if report.rolled_back:
        what = ("an inf/nan was found: the step is skipped" if report.found_inf else
                "the gradients were clipped: the step was redone with the clipped gradients")
        n = "?" if iteration is None else iteration + 1
        print(f"megatron-zb: post-validation rolled back the step of iteration {n} on rank "
              f"{torch.distributed.get_rank()}: {what}", flush=True)
    return (loss_dict, int(not successful), should_checkpoint, should_exit, exit_code,
            _as_reduced(report.result.grad_norm), num_zeros, max_logit)


def _as_reduced(value: float | None) -> float | None:
    """What Megatron-LM's ``reduce_max_stat_across_model_parallel_group`` returns when every rank
    holds ``value``: None stays None, a number comes back through a float32 tensor."""
    import torch

    return None if value is None else torch.tensor([value], dtype=torch.float32).item()

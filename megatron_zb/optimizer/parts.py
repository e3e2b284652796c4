"""The megatron-core optimizers under a post-validation wrapper, and what it does to them.

:class:`OptimizerParts` holds the parts of the wrapped optimizer (a ``ChainedOptimizer``'s
``chained_optimizers``, or the one bare ``FP32Optimizer`` / ``Float16OptimizerWithFloat16Params``
/ ``DistributedOptimizer``), refuses the setups post-validation cannot mirror, and performs the
pieces of megatron-core's ``step()`` that post-validation runs separately: the local half of
``prepare_grads``, the loss-scaler update, clipping with the global norm, the refresh of model
params after a restore, and the return conventions of each optimizer type. Private
megatron-core internals are reached only through :mod:`megatron_zb.megatron_compat.optimizer` (and :mod:`megatron_zb.megatron_compat`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Literal

import torch

from megatron_zb.megatron_compat import optimizer as megatron_compat_optimizer
from megatron_zb.optimizer.grad_stats import local_zero_count, same_group, stats_device
from megatron_zb.optimizer.rollback import ExactSnapshot, InPlaceRecord, check_adam_invertible, group_hyperparams
from megatron_zb.optimizer.values import PostValidationError, StepResult

__all__ = ["Hyperparams", "OptimizerParts"]

Hyperparams = list[list[dict[str, Any]]]
"""Per part, per param group: the group's hyper-parameters (``lr``, ``weight_decay``, ``betas``, ...)."""


def _split(optimizer: Any) -> tuple[Literal["chained", "fp32", "mixed"], list[Any]]:
    """The wrapped optimizer's kind and its parts; ``TypeError`` for anything else."""
    from megatron.core.optimizer.optimizer import ChainedOptimizer, FP32Optimizer, MixedPrecisionOptimizer

    if isinstance(optimizer, ChainedOptimizer):
        return "chained", list(optimizer.chained_optimizers)
    if isinstance(optimizer, (FP32Optimizer, MixedPrecisionOptimizer)):
        return ("fp32" if isinstance(optimizer, FP32Optimizer) else "mixed"), [optimizer]
    raise TypeError(f"unsupported optimizer {type(optimizer).__qualname__}: expected megatron-core's "
                    "ChainedOptimizer, FP32Optimizer, Float16OptimizerWithFloat16Params or DistributedOptimizer")


def _check_part(part: Any, *, exact: bool) -> None:
    """Refuse a part whose ``step()`` post-validation does not mirror, or a setup it cannot undo."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

    if type(part) not in (FP32Optimizer, Float16OptimizerWithFloat16Params, DistributedOptimizer):
        raise TypeError(f"unsupported optimizer part {type(part).__qualname__} (its step() is not the one "
                        "post-validation mirrors)")
    cfg = part.config
    if cfg.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
        raise NotImplementedError("precision-aware optimizer (decoupled_grad, TE FusedAdam) is not supported")
    if cfg.overlap_param_gather_with_optimizer_step:
        raise NotImplementedError("overlap_param_gather_with_optimizer_step is not supported")
    if getattr(getattr(part, "ddp_config", None), "use_megatron_fsdp", False):
        raise NotImplementedError("megatron FSDP is not supported")
    for message in megatron_compat_optimizer.unsupported_step_features(part):
        raise NotImplementedError(message)
    if not exact and not getattr(part, "is_stub_optimizer", False):
        check_adam_invertible(part.optimizer)


@dataclass(frozen=True, kw_only=True)
class OptimizerParts:
    """The checked parts of one wrapped megatron-core optimizer (build with :meth:`inspect`).

    Attributes:
        kind: ``"chained"`` (a ``ChainedOptimizer``), ``"fp32"`` or ``"mixed"`` (a bare
            ``FP32Optimizer`` / mixed-precision optimizer): decides the return conventions.
        parts: the megatron-core optimizers that step (in the chain's order).
        stats_group: their common grad-stats group *G* (``get_grad_stats_parallel_group()``).
        config: the parts' shared ``OptimizerConfig``.
        scaled: per part, it has a loss scaler (its grads are unscaled and checked for inf/nan).
        needs_norm: megatron-core's step computes the grad norm (chained, or ``clip_grad > 0``).
        needs_zeros: it counts zero grads (``log_num_zeros_in_grad``).
    """

    kind: Literal["chained", "fp32", "mixed"]
    parts: list[Any]
    stats_group: Any
    config: Any
    scaled: list[bool]
    needs_norm: bool
    needs_zeros: bool

    @classmethod
    def inspect(cls, optimizer: Any, *, exact: bool) -> "OptimizerParts":
        """Check ``optimizer`` (raises ``TypeError`` / ``NotImplementedError`` /
        :class:`PostValidationError` for what is not supported) and describe it."""
        from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer

        kind, parts = _split(optimizer)
        if not parts:
            raise PostValidationError("the ChainedOptimizer holds no optimizer")
        for part in parts:
            _check_part(part, exact=exact)
        stats_group = parts[0].get_grad_stats_parallel_group()
        if not all(same_group(p.get_grad_stats_parallel_group(), stats_group) for p in parts[1:]):
            raise NotImplementedError("optimizer parts with different grad-stats groups (expert-parallel MoE "
                                      "optimizers) are not supported")
        config = parts[0].config
        return cls(kind=kind, parts=parts, stats_group=stats_group, config=config,
                   scaled=[isinstance(p, MixedPrecisionOptimizer) and p.grad_scaler is not None for p in parts],
                   needs_norm=kind == "chained" or config.clip_grad > 0.0,
                   needs_zeros=bool(config.log_num_zeros_in_grad))

    # ------------------------------------------------------------------ local statistics
    def prepare_grads_locally(self) -> torch.Tensor | None:
        """megatron-core's ``prepare_grads`` of every part without the found-inf all-reduce and
        the scaler update. Returns the per-part found-inf flags (fp32, one per part; None when
        no part has a loss scaler), to be all-reduced MAX over :attr:`stats_group`."""
        from megatron.core.optimizer.optimizer import FP32Optimizer

        found = torch.zeros(len(self.parts), dtype=torch.float, device=stats_device()) if any(self.scaled) else None
        with self.no_timers():
            for i, part in enumerate(self.parts):
                if isinstance(part, FP32Optimizer):
                    part.prepare_grads()  # main_grad -> grad; no collective, no inf/nan check in fp32
                    continue
                if part.is_stub_optimizer:
                    continue
                megatron_compat_optimizer.copy_model_grads_to_main_grads(part)
                if found is not None and self.scaled[i]:
                    megatron_compat_optimizer.unscale_main_grads_locally_(part, found[i:i + 1])
        return found

    def grads_for_norm(self) -> list[torch.Tensor]:
        """The main grads megatron-core's grad norm is taken over, all parts."""
        return [g for p in self.parts for g in megatron_compat_optimizer.grads_for_norm(p)]

    def local_zero_count(self) -> torch.Tensor:
        """This rank's zero-grad count, over the params megatron-core's ``count_zeros`` of the
        wrapped type counts (the chain's: every part's, without a TP group)."""
        groups = megatron_compat_optimizer.zero_count_groups(self.parts[0], chained=self.kind == "chained")
        if self.kind == "chained":
            return local_zero_count([q for p in self.parts for q in p.get_parameters()], groups)
        return local_zero_count(self.parts[0].get_parameters(), groups)

    # ------------------------------------------------------------------ decisions and results
    def clip_fires(self, grad_norm: float | None) -> bool:
        """Would megatron-core scale the grads for this (global) ``grad_norm``?"""
        clip = self.config.clip_grad
        if clip <= 0.0 or grad_norm is None or not any(p.get_parameters() for p in self.parts):
            return False
        return clip / (grad_norm + 1.0e-6) < 1.0  # megatron-core's clip_grad_by_total_norm_fp32

    def update_loss_scalers(self, found: torch.Tensor | None) -> bool:
        """Update each part's loss scaler with its own all-reduced flag of ``found``, as its
        ``prepare_grads`` does; return whether any part found an inf/nan."""
        found_inf = False
        if found is not None:
            for i, part in enumerate(self.parts):
                if self.scaled[i]:
                    flag = found[i].item() > 0
                    part.grad_scaler.update(flag)
                    found_inf |= flag
        return found_inf

    def result(self, *, found_inf: bool, grad_norm: float | None, num_zeros: float | None,
               success: bool) -> StepResult:
        """The tuple megatron-core's ``step()`` of the wrapped type returns."""
        if found_inf:
            return StepResult(False, None, None)
        clip = self.config.clip_grad > 0.0
        if self.kind == "chained":
            return StepResult(success, grad_norm, num_zeros if self.needs_zeros else None)
        if self.kind == "mixed":
            return StepResult(success, grad_norm if clip else 0.0, num_zeros if self.needs_zeros else 0)
        return StepResult(success, grad_norm if clip else None, num_zeros if self.needs_zeros else None)

    # ------------------------------------------------------------------ updates and their undo
    def hyperparams(self) -> Hyperparams:
        """The param groups' current hyper-parameters, per part (copies)."""
        return [group_hyperparams(p.optimizer) if p.optimizer is not None else [] for p in self.parts]

    def capture_undo(self, *, exact: bool) -> list[ExactSnapshot | InPlaceRecord | None]:
        """Per part, what a rollback of the step about to be taken needs (None: nothing steps)."""
        kind = ExactSnapshot if exact else InPlaceRecord
        return [kind.capture(p.optimizer) if p.optimizer is not None and not p.is_stub_optimizer else None
                for p in self.parts]

    def clip_(self, grad_norm: float) -> None:
        """megatron-core's clipping with the global norm (``ChainedOptimizer.step`` / ``clip_grad_norm``)."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        for part in self.parts:
            if part.is_stub_optimizer or part.config.clip_grad <= 0.0:
                continue
            params = part.get_parameters()
            if params:
                clip_grad_by_total_norm_fp32(params, max_norm=part.config.clip_grad, total_norm=grad_norm,
                                             use_decoupled_grad=part.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)

    def resync_model_params(self) -> None:
        """After restoring main params without a redo: refresh the model params from them, as
        megatron-core's ``step_with_ready_grads`` does after the inner step (with the distributed
        optimizer's param all-gather unless it is overlapped)."""
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
        from megatron.core.optimizer.optimizer import FP32Optimizer

        with self.no_timers():
            for part in self.parts:
                if part.is_stub_optimizer or isinstance(part, FP32Optimizer):
                    continue
                megatron_compat_optimizer.copy_main_params_to_model_params(part)
                if isinstance(part, DistributedOptimizer) and not part.ddp_config.overlap_param_gather:
                    for chunk in part.model_chunks:
                        chunk.start_param_sync()

    @contextlib.contextmanager
    def no_timers(self) -> Iterator[None]:
        """Run megatron-core's optimizer internals without its timers: with
        ``barrier_with_L1_time`` they barrier on the default group, which cannot line up when
        stages take different paths (one rolls back in begin_iteration, another skipped)."""
        configs = {id(p.config): p.config for p in self.parts}
        saved = {k: c.timers for k, c in configs.items()}
        for c in configs.values():
            c.timers = None
        try:
            yield
        finally:
            for k, c in configs.items():
                c.timers = saved[k]

    @contextlib.contextmanager
    def hyperparams_set_to(self, values: Hyperparams) -> Iterator[None]:
        """Temporarily give the param groups ``values`` (those of an earlier step: an LR scheduler
        may have moved them on since); restore the current values afterwards."""
        groups = [list(p.optimizer.param_groups) if p.optimizer is not None else [] for p in self.parts]
        current = [[{k: g[k] for k in vals if k in g} for g, vals in zip(gs, vs)] for gs, vs in zip(groups, values)]
        for gs, vs in zip(groups, values):
            for g, vals in zip(gs, vs):
                g.update(vals)
        try:
            yield
        finally:
            for gs, vs in zip(groups, current):
                for g, vals in zip(gs, vs):
                    g.update(vals)

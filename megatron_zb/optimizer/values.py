"""Public value types of optimizer post-validation: its settings, results, counters and errors.

Pure data (no torch, no process groups); :class:`~megatron_zb.optimizer.post_validation.PostValidationOptimizer`
produces and consumes them. See ``docs/post_validation.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, NamedTuple

from megatron_zb.optimizer.policy import check_iteration_counts
from megatron_zb.runtime.peer_wait import PipelineTimeoutError

__all__ = [
    "PostValidationConfig",
    "PostValidationCounters",
    "PostValidationError",
    "PostValidationTimeout",
    "StepResult",
    "ValidationReport",
]


@dataclass(frozen=True, kw_only=True)
class PostValidationConfig:
    """Settings of :class:`PostValidationOptimizer` (all keyword-only), and the post-validation
    section of the run configuration (:class:`megatron_zb.training.run_config.OptimConfig`
    ``.post_validation``, built by :meth:`from_args`): the one definition. Every default is what
    ``pretrain_gpt_zb.py``'s flag gives (``sync_on_local_clip`` has no flag).

    Attributes:
        exact: rollback mode. True (``--enable-exactly-numeric-match``): before each eager step
            copy the params the inner optimizer updates (fp32 main params / their distributed
            shards) and their optimizer state; a rollback restores the copies, so every result
            is bitwise what megatron-core's synchronous step gives. False (in-place): store
            nothing; a rollback inverts the Adam/AdamW update algebraically from the post-step
            values and the gradients still in the grad buffers (torch ``Adam``/``AdamW`` only;
            agrees with the synchronous path to fp32 round-off).
        warmup_iters: the first ``warmup_iters`` steps use megatron-core's synchronous step
            (``pretrain_gpt_zb.py --post-validation-warmup-iters``).
        clean_iters_required: after a step that clipped or found an inf/nan, use the synchronous
            step until that many consecutive steps neither clipped nor overflowed (the
            published heuristic: 10); 0 never falls back
            (``pretrain_gpt_zb.py --post-validation-fallback-clean-iters``).
        timeout: seconds any wait of the wrapper may block (the asynchronous reductions and the
            stage-local agreement reduction): ``--pipeline-timeout-seconds`` (default 300 s), the
            deadline of every collective the zero-bubble path adds, which fires before the process
            groups' own ``--distributed-timeout-minutes``. On expiry :class:`PostValidationTimeout`
            is raised; the process group is then unusable, as after any collective timeout.
        sync_on_local_clip: when this stage's own part of the squared grad norm already proves
            that clipping will fire (the global norm is at least the local one), wait for the
            global norm inside ``step()`` and step correctly instead of stepping eagerly and
            rolling back.
    """

    exact: bool = False
    warmup_iters: int = 10
    clean_iters_required: int = 10
    timeout: float = 300.0
    sync_on_local_clip: bool = True

    @classmethod
    def from_args(cls, args: Any) -> "PostValidationConfig":
        """From ``args`` of ``pretrain_gpt_zb.py`` or Megatron-LM (the same flag names)."""
        return cls(exact=args.enable_exactly_numeric_match, warmup_iters=args.post_validation_warmup_iters,
                   clean_iters_required=args.post_validation_fallback_clean_iters,
                   timeout=args.pipeline_timeout_seconds)

    def __post_init__(self) -> None:
        if not isinstance(self.exact, bool):
            raise TypeError(f"exact must be a bool, got {self.exact!r}")
        check_iteration_counts(warmup_iters=self.warmup_iters, clean_iters_required=self.clean_iters_required)
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout}")


class StepResult(NamedTuple):
    """megatron-core's ``step()`` return value: ``(update_successful, grad_norm, num_zeros_in_grad)``."""

    update_successful: bool
    grad_norm: float | None
    num_zeros_in_grad: float | int | None


@dataclass(frozen=True)
class ValidationReport:
    """What validation found for one post-validated step.

    Attributes:
        iteration: 0-based index of the ``step()`` call validated.
        result: what megatron-core's synchronous ``step()`` returns for that iteration.
        provisional: what ``step()`` returned (``(True, None, None)`` after an eager update,
            ``(False, None, None)`` when this stage already saw an inf/nan).
        clipped: clipping scaled the gradients (the step was redone with clipped grads).
        found_inf: an inf/nan was found on some rank (the step is skipped): by a loss scaler, or with
            ``check_nonfinite`` a non-finite grad norm or a rank's ``note_nonfinite``.
        rolled_back: this rank undid an update it had applied eagerly.
    """

    iteration: int
    result: StepResult
    provisional: StepResult
    clipped: bool
    found_inf: bool
    rolled_back: bool

    @property
    def changed(self) -> bool:
        """The validated ``update_successful`` differs from the provisional one: a training loop
        that acted on the provisional value (e.g. advanced an LR schedule) must undo that."""
        return self.result.update_successful != self.provisional.update_successful


@dataclass
class PostValidationCounters:
    """Event counts (see :meth:`PostValidationOptimizer.counters`).

    ``rollbacks`` and its split are this rank's (a stage that saw the inf/nan itself never
    applied the update and has nothing to roll back); the others are the same on every rank.
    """

    eager_steps: int = 0  #: steps that took the post-validated path (not megatron's synchronous step)
    sync_steps: int = 0  #: megatron-core's synchronous step (warm-up / after clipping)
    local_clip_syncs: int = 0  #: eager iterations that waited in step() because the local norm proved clipping
    rollbacks: int = 0  #: eager updates this rank undid (clip redo or inf/nan skip)
    clip_rollbacks: int = 0
    inf_rollbacks: int = 0
    clipped_iterations: int = 0  #: validated steps whose gradients were clipped
    skipped_iterations: int = 0  #: validated steps skipped for inf/nan (update_successful False)

    def add(self, other: "PostValidationCounters") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


class PostValidationError(RuntimeError):
    """Post-validation cannot guarantee the synchronous result (misuse or unsupported setup)."""


class PostValidationTimeout(PostValidationError, PipelineTimeoutError, TimeoutError):
    """A wait of :class:`PostValidationOptimizer` passed its ``timeout``: the one named error of a late
    peer (:class:`~megatron_zb.runtime.peer_wait.PipelineTimeoutError`, :mod:`megatron_zb.runtime.peer_wait`)."""

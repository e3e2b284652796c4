"""Optimizer extensions: post-validation of megatron-core optimizer steps (``docs/post_validation.md``).

Modules: ``post_validation`` (the wrapper), ``values`` (its public settings, results, counters
and errors), ``policy`` (warm-up and clean-streak fallback), ``grad_stats`` (local grad
statistics and their asynchronous reductions), ``parts`` (what is done to megatron-core's
optimizers; private megatron-core internals via :mod:`megatron_zb.megatron_compat.optimizer`),
``rollback`` (exact snapshots and the in-place Adam/AdamW inversion).
"""

from megatron_zb.optimizer.post_validation import (
    PostValidationConfig,
    PostValidationCounters,
    PostValidationError,
    PostValidationOptimizer,
    PostValidationTimeout,
    StepResult,
    ValidationReport,
)
from megatron_zb.optimizer.rollback import ExactSnapshot, InPlaceRecord, check_adam_invertible, invert_adam_step_

__all__ = [
    "ExactSnapshot",
    "InPlaceRecord",
    "PostValidationConfig",
    "PostValidationCounters",
    "PostValidationError",
    "PostValidationOptimizer",
    "PostValidationTimeout",
    "StepResult",
    "ValidationReport",
    "check_adam_invertible",
    "invert_adam_step_",
]

"""Optimizer extensions: post-validation of megatron-core optimizer steps (``docs/post_validation.md``)."""

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

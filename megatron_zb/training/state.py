"""The training state a checkpoint carries besides model, optimizer, LR scheduler and RNG states."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["TrainState"]


@dataclass
class TrainState:
    """Counters of the run and the schedule's profiled costs; saved and restored by
    :mod:`megatron_zb.training.checkpointing`.

    Attributes:
        iteration: completed training iterations (Megatron's ``iteration``).
        consumed_train_samples: training samples read so far, all data-parallel ranks
            [samples]; where the training iterator resumes.
        consumed_valid_samples: validation samples read so far [samples]; where the validation
            iterator resumes.
        schedule_costs: the profiled cost model the schedule was re-planned from
            (``dataclasses.asdict`` of a :class:`~megatron_zb.schedules.CostModel`, times in ms),
            or ``None`` before profiling; a run resumed from the checkpoint rebuilds the schedule
            from it instead of profiling again.
    """

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    schedule_costs: dict[str, Any] | None = None

    def advance(self, *, global_batch_size: int) -> int:
        """Count one finished training iteration of ``global_batch_size`` samples; returns its number."""
        self.iteration += 1
        self.consumed_train_samples += global_batch_size
        return self.iteration

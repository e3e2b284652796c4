"""The global batch of each iteration: constant, or growing with ``--rampup-batch-size`` (Megatron-LM's meaning).

The global batch size is a function of the samples consumed so far, computed by megatron-core's own
calculators (``megatron.core.num_microbatches_calculator``: ``ConstantNumMicroBatchesCalculator`` and
``RampupBatchsizeNumMicroBatchesCalculator``), used as objects of this run rather than through
megatron-core's process-global one. With ``--rampup-batch-size START INCREMENT SAMPLES`` the batch
starts at ``START`` and grows by ``INCREMENT`` every ``SAMPLES / ((GBS - START) / INCREMENT)``
consumed samples until it reaches ``--global-batch-size``; the number of micro batches per
iteration per data-parallel rank, ``m = batch / (micro batch x DP)``, grows with it.

:func:`train_iters_from_samples` is Megatron-LM's ``update_train_iters`` (``--train-samples`` ->
iterations, the ramp's included); :func:`samples_of_iterations` the samples those iterations read.
Nothing here needs a process group.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["BatchRamp", "samples_of_iterations", "train_iters_from_samples"]

_QUIET_RANK = -1
"""The ``rank`` given to megatron-core's calculators: only its rank 0 logs, so they stay quiet (the
trainer prints Megatron-LM's lines itself, once, on global rank 0)."""


class BatchRamp:
    """The current global batch of a run, updated from the consumed samples before each iteration.

    Attributes:
        global_batch_size: samples of the current iteration, all data-parallel ranks [samples].
        num_microbatches: micro batches of the current iteration per data-parallel rank.
        ramps: whether ``--rampup-batch-size`` is given (else the batch is constant).
    """

    def __init__(self, *, global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                 rampup_batch_size: Sequence[int] | None = None, consumed_samples: int = 0) -> None:
        """The batch of the iteration that starts after ``consumed_samples`` [samples]."""
        from megatron.core.num_microbatches_calculator import ConstantNumMicroBatchesCalculator

        from megatron_zb.megatron_compat import rampup_calculator

        self.ramps = rampup_batch_size is not None
        if rampup_batch_size is None:
            self._calc = ConstantNumMicroBatchesCalculator(
                global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                data_parallel_size=data_parallel_size, decrease_batch_size_if_needed=False, rank=_QUIET_RANK)
        else:
            start, increment, samples = (int(v) for v in rampup_batch_size)
            calculator = rampup_calculator()
            if calculator is None:  # validation refuses the flag on such a release first
                raise RuntimeError("the installed megatron-core has no batch-size ramp-up calculator")
            self._calc = calculator(
                global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                data_parallel_size=data_parallel_size, decrease_batch_size_if_needed=False, rank=_QUIET_RANK,
                start_global_batch_size=start, batch_size_increment=increment, ramup_samples=samples)
        self.update(consumed_samples)

    @property
    def global_batch_size(self) -> int:
        return int(self._calc.get_current_global_batch_size())

    @property
    def num_microbatches(self) -> int:
        return int(self._calc.get())

    def update(self, consumed_samples: int) -> bool:
        """The batch of the iteration after ``consumed_samples`` samples; returns whether it changed.
        Raises ``AssertionError`` (megatron-core's) if it is not whole micro batches per DP rank."""
        before = self._calc.get()
        self._calc.update(consumed_samples, consistency_check=True, verbose=False)
        return self._calc.get() != before


def train_iters_from_samples(train_samples: int, *, global_batch_size: int, micro_batch_size: int,
                             data_parallel_size: int, rampup_batch_size: Sequence[int] | None = None) -> int:
    """Iterations of a ``--train-samples`` run (Megatron-LM's ``update_train_iters``).

    Constant batch: ``train_samples // global_batch_size``. With a ramp: one iteration per batch while
    the consumed samples are at most the ramp's ``SAMPLES`` (and ``train_samples``), then
    ``(train_samples - consumed) // global_batch_size`` more; a last incomplete batch is dropped.
    """
    if rampup_batch_size is None:
        return train_samples // global_batch_size
    ramp = BatchRamp(global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                     data_parallel_size=data_parallel_size, rampup_batch_size=rampup_batch_size)
    ramp_samples = int(rampup_batch_size[2])
    iterations = consumed = 0
    while consumed <= ramp_samples and consumed <= train_samples:
        ramp.update(consumed)
        consumed += ramp.global_batch_size
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // global_batch_size
    return iterations


def samples_of_iterations(train_iters: int, *, global_batch_size: int, micro_batch_size: int,
                          data_parallel_size: int, rampup_batch_size: Sequence[int] | None = None) -> int:
    """Samples that ``train_iters`` iterations from the start read, all data-parallel ranks [samples]."""
    ramp = BatchRamp(global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                     data_parallel_size=data_parallel_size, rampup_batch_size=rampup_batch_size)
    consumed = 0
    for done in range(train_iters):
        ramp.update(consumed)
        if ramp.global_batch_size == global_batch_size:  # constant from here on
            return consumed + (train_iters - done) * global_batch_size
        consumed += ramp.global_batch_size
    return consumed

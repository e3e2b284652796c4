"""``--timing-log-level``, ``--timing-log-option``, ``--no-barrier-with-level-1-timing``: Megatron-LM's timers.

As Megatron-LM core_v0.16.1 (``megatron/training/training.py``, ``global_vars._set_timers``): one
megatron-core :class:`~megatron.core.timers.Timers` per process, given to the model's and the
optimizer's configs (``config.timers``), so that the code which already times itself does so:

* level 1 -- what runs about once per iteration: ``forward-backward`` (megatron-core's
  ``forward_backward_func`` and megatron-zb's runtime alike), the gradient reduces of
  ``finalize_model_grads`` (``all-grads-sync``, ``embedding-grads-all-reduce``, ...), the
  optimizer's parts (``optimizer-copy-to-main-grad``, ..., ``optimizer-inner-step``) and the
  trainer's ``optimizer`` (the whole step). With ``barrier_with_L1_time`` (the default; off with
  ``--no-barrier-with-level-1-timing``) level-1 timers start after a barrier, as Megatron-LM's;
* level 2 -- what runs once per micro batch: ``batch-generator`` (the forward step's batch),
  ``forward-compute`` and ``backward-compute`` (megatron-core's ``forward_step`` /
  ``backward_step``, which megatron-zb's runtime calls for F and B). megatron-core's p2p timers
  (``forward-recv``, ...) run only under megatron-core's schedules: megatron-zb's runtime has its
  own p2p, whose waits the ``--profile`` timeline shows instead (:mod:`.measured_timeline`);
  megatron-zb's W is not timed here.

Every ``--log-interval``, after the iteration line, the last rank prints Megatron-LM's block (times
per iteration: the interval's sum divided by ``--log-interval``, in ms), e.g. with ``minmax``::

    (min, max) time across ranks (ms):
        forward-backward ...............................: (123.45, 125.67)

``max`` prints the largest over ranks, ``all`` every rank's. Level 0 (the default) prints nothing
and times nothing beyond the iteration line. Evaluation is not timed (Megatron-LM sets
``config.timers = None`` around it).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

from megatron_zb.training.logging_utils import print_rank_last

__all__ = ["LEVEL_1_TIMERS", "LEVEL_2_TIMERS", "TimingLog", "optimizer_configs", "timers_to_log"]

LEVEL_1_TIMERS: tuple[str, ...] = (
    "forward-backward", "layernorm-grads-all-reduce", "embedding-grads-all-reduce", "all-grads-sync",
    "params-all-gather", "optimizer-copy-to-main-grad", "optimizer-unscale-and-check-inf",
    "optimizer-clip-main-grad", "optimizer-count-zeros", "optimizer-inner-step",
    "optimizer-copy-main-to-model-params", "optimizer")
"""Megatron-LM's ``timers_to_log`` at ``--timing-log-level 1``, in its order."""
LEVEL_2_TIMERS: tuple[str, ...] = (
    "batch-generator", "forward-compute", "backward-compute", "forward-recv", "forward-send", "backward-recv",
    "backward-send", "forward-send-forward-recv", "forward-send-backward-recv", "backward-send-forward-recv",
    "backward-send-backward-recv", "forward-backward-send-forward-backward-recv")
"""Added at ``--timing-log-level 2``, in Megatron-LM's order."""


def timers_to_log(level: int) -> list[str]:
    """The timers Megatron-LM logs at ``level`` (0: none)."""
    return (list(LEVEL_1_TIMERS) if level >= 1 else []) + (list(LEVEL_2_TIMERS) if level >= 2 else [])


def optimizer_configs(optimizer: Any) -> list[Any]:
    """The ``OptimizerConfig`` of every part of megatron-core's ``optimizer`` (a ``ChainedOptimizer``'s parts)."""
    parts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [p.config for p in parts if getattr(p, "config", None) is not None]


class TimingLog:
    """This process's timers (``None`` at level 0) and the block printed every log interval.

    Attributes:
        level: ``--timing-log-level``.
        timers: megatron-core's ``Timers(level, option)``; ``None`` at level 0 (nothing is timed).
        barrier: ``barrier_with_L1_time`` (``--no-barrier-with-level-1-timing`` clears it).
    """

    def __init__(self, *, level: int, option: str, barrier: bool) -> None:
        self.level, self.barrier = level, barrier
        self.timers: Any = None
        if level > 0:
            from megatron.core.timers import Timers

            self.timers = Timers(level, option)
        self._configs: list[Any] = []

    def install(self, configs: Sequence[Any]) -> None:
        """Give the model's and the optimizer's ``configs`` these timers and the barrier setting."""
        if self.timers is None:
            return
        for c in configs:
            if all(c is not d for d in self._configs):
                c.timers, c.barrier_with_L1_time = self.timers, self.barrier
                self._configs.append(c)

    def __call__(self, name: str, log_level: int) -> Any:
        """The timer ``name`` (a no-op timer above the level or at level 0), megatron-core's ``timers(name, level)``."""
        if self.timers is None:
            from megatron.core.timers import DummyTimer

            return DummyTimer()
        return self.timers(name, log_level=log_level)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No timing inside (evaluation), as Megatron-LM's ``config.timers = None`` around it."""
        for c in self._configs:
            c.timers = None
        try:
            yield
        finally:
            for c in self._configs:
                c.timers = self.timers

    def log(self, *, normalizer: int) -> None:
        """Megatron-LM's block for the interval (times divided by ``normalizer``, ``--log-interval``)
        on the last rank; the timers restart from zero. Collective (an all-gather over all ranks)."""
        if self.timers is None:
            return
        text = self.timers.get_all_timers_string(timers_to_log(self.level), normalizer=normalizer, reset=True)
        if text is not None:
            print_rank_last(text)

"""What Megatron-LM's loop does around each iteration besides training: garbage collection, the CUDA
cache and the ``--profile`` window (core_v0.16.1 ``megatron/training/training.py``).

* ``--manual-gc``: ``gc.disable()`` and one ``gc.collect()`` before the first iteration; a full
  collection after every ``--manual-gc-interval`` iterations; unless ``--no-manual-gc-eval``, a full
  collection before each evaluation during training and a generation-0 one after it. The
  collector is turned back on when the run closes.
* ``--empty-unused-memory-level``: ``torch.cuda.empty_cache()`` after forward-backward (>= 1), after
  the optimizer step (2) and after each evaluation step (>= 1); on CPU nothing to release (the
  start-up line says so).
* ``--profile``: :mod:`.profile_window`.

:class:`LoopHooks` is what the Trainer calls; each call is one line there.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

import torch

from megatron_zb.training.profile_window import ProfileWindow, profile_window
from megatron_zb.training.run_config import MemoryConfig, RunConfig

__all__ = ["GarbageAndCache", "LoopHooks"]


class GarbageAndCache:
    """``--manual-gc*`` and ``--empty-unused-memory-level`` (module docstring)."""

    def __init__(self, config: MemoryConfig, *, device: torch.device) -> None:
        self.config = config
        self.cuda = device.type == "cuda"
        self.collections = 0  # full or generation-0 collections done by hand (tests read it)
        self._was_enabled: bool | None = None

    def _collect(self, generation: int = 2) -> None:
        gc.collect(generation)
        self.collections += 1

    def empty_cache(self, level: int) -> None:
        """``torch.cuda.empty_cache()`` when ``--empty-unused-memory-level`` >= ``level`` (CUDA only)."""
        if self.cuda and self.config.empty_unused_memory_level >= level:
            torch.cuda.empty_cache()

    def start(self) -> None:
        """Before the first iteration: with ``--manual-gc``, the collector off and one collection."""
        if self.config.manual_gc:
            self._was_enabled = gc.isenabled()
            gc.disable()
            self._collect()

    def after_iteration(self, it: int) -> None:
        """After iteration ``it``: the ``--manual-gc-interval`` collection."""
        interval = self.config.manual_gc_interval
        if self.config.manual_gc and interval != 0 and it % interval == 0:
            self._collect()

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        """Around an evaluation during training: collections before (full) and after (generation 0)."""
        on = self.config.manual_gc and self.config.manual_gc_eval
        if on:
            self._collect()
        yield
        if on:
            self._collect(generation=0)

    def close(self) -> None:
        """Turn the collector back on if :meth:`start` turned it off."""
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None


class LoopHooks:
    """The Trainer's calls around iterations: garbage collection, the CUDA cache, the profile window.

    Attributes:
        memory: the garbage-collection and CUDA-cache part.
        profile: this rank's ``--profile`` window.
    """

    def __init__(self, config: RunConfig, *, rank: int, device: torch.device) -> None:
        self.memory = GarbageAndCache(config.memory, device=device)
        self.profile: ProfileWindow = profile_window(config.profiling, rank=rank, device=device)

    def start(self, completed: int) -> None:
        """Before this run's first iteration (``completed`` iterations done before, from ``--load``)."""
        self.memory.start()
        self.profile.start(completed)

    def before_iteration(self, it: int) -> None:
        self.profile.before_iteration(it)

    def after_forward_backward(self) -> None:
        self.memory.empty_cache(1)

    def after_optimizer_step(self) -> None:
        self.memory.empty_cache(2)

    def after_eval_step(self) -> None:
        self.memory.empty_cache(1)

    def after_iteration(self, it: int) -> None:
        self.profile.after_iteration(it)
        self.memory.after_iteration(it)

    def evaluation(self) -> contextlib.AbstractContextManager[None]:
        """Around an evaluation during training (``--manual-gc-eval``)."""
        return self.memory.evaluation()

    def close(self) -> None:
        """Stop a profile window still open; the garbage collector back on."""
        self.profile.close()
        self.memory.close()

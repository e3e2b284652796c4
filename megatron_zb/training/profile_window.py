"""``--profile``: Megatron-LM's profiling window (core_v0.16.1 ``megatron/training/training.py``).

On the ranks of ``--profile-ranks``, one of two backends, as Megatron-LM:

* **PyTorch's profiler** (``--use-pytorch-profiler``, and always without CUDA): started before
  the first iteration with Megatron-LM's schedule -- wait ``start - 1`` iterations, warm up 1,
  record ``end - start`` -- so it records iterations ``start`` to ``end - 1`` (1-based; the
  trace names them ``ProfilerStep#N``), and stopped after iteration ``end``. Each profiled rank
  writes one Chrome trace (Perfetto, TensorBoard's profiler plugin) into ``--tensorboard-dir``:
  ``rank<R>.<time_ns>.pt.trace.json`` (``torch.profiler.tensorboard_trace_handler``), and says so.
  A run resumed from a checkpoint keeps the window on the global iteration numbers (the trace's
  ``ProfilerStep#N`` then counts this run's iterations). Settings: Megatron-LM's
  (``record_shapes``, ``with_stack``) with ``--use-pytorch-profiler``; without it on a machine
  without CUDA -- where Megatron-LM's capture range cannot run -- shapes but no Python stacks
  (measured on the CPU demo, one iteration of rank 0: 447 MB of trace with stacks);
* **CUDA's capture range** (CUDA without ``--use-pytorch-profiler``): ``cudaProfilerStart`` and
  NVTX ranges (``torch.autograd.profiler.emit_nvtx``) before iteration ``start + 1``,
  ``cudaProfilerStop`` after iteration ``end``: for ``nsys profile --capture-range=cudaProfilerApi``.

:class:`ProfileWindow` decides when (shared by both backends); a backend only starts, steps and
stops. The CUDA backend is not run here (no GPU); its window is tested with a recording backend.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import torch

from megatron_zb.training.run_config import ProfilingConfig

__all__ = ["CudaCaptureRange", "ProfileBackend", "ProfileWindow", "TorchProfiler", "profile_window"]


class ProfileBackend(Protocol):
    """What a profiler does; :class:`ProfileWindow` says when."""

    continuous: bool
    """True: started before the first iteration and stepped every iteration (its own schedule
    picks the window); False: started at the window's first iteration."""

    def start(self, completed: int) -> None:
        """Start (``completed``: iterations done before this run's first one)."""

    def step(self) -> None:
        """A new iteration begins (continuous backends)."""

    def stop(self) -> None:
        """Stop; write what was recorded."""


class TorchProfiler:
    """PyTorch's profiler with Megatron-LM's schedule and settings (``record_shapes``; ``with_stack``
    unless told not to: module doc)."""

    continuous = True

    def __init__(self, config: ProfilingConfig, *, rank: int, with_stack: bool = True) -> None:
        if config.trace_dir is None:
            raise ValueError("TorchProfiler needs ProfilingConfig.trace_dir (--tensorboard-dir)")
        self.config, self.rank, self.written, self.with_stack = config, rank, [], with_stack
        self._prof: Any = None

    def _on_trace_ready(self, prof: Any) -> None:
        directory = self.config.trace_dir
        before = set(os.listdir(directory)) if os.path.isdir(directory) else set()
        torch.profiler.tensorboard_trace_handler(directory, worker_name=f"rank{self.rank}")(prof)
        for name in sorted(set(os.listdir(directory)) - before):
            path = os.path.join(directory, name)
            self.written.append(path)
            print(f"> rank {self.rank}: PyTorch profiler trace of iterations {self.config.profile_step_start}-"
                  f"{self.config.profile_step_end - 1} written to {path}", flush=True)

    def start(self, completed: int) -> None:
        start, end = self.config.profile_step_start, self.config.profile_step_end
        megatron = torch.profiler.schedule(wait=max(start - 1, 0), warmup=1 if start > 0 else 0, active=end - start,
                                           repeat=1)
        self._prof = torch.profiler.profile(schedule=lambda step: megatron(step + completed),
                                            on_trace_ready=self._on_trace_ready, record_shapes=True,
                                            with_stack=self.with_stack)
        self._prof.start()

    def step(self) -> None:
        self._prof.step()

    def stop(self) -> None:
        self._prof.stop()


class CudaCaptureRange:
    """``cudaProfilerStart/Stop`` with NVTX ranges (Megatron-LM's ``--profile`` on GPU; not run here)."""

    continuous = False

    def __init__(self) -> None:
        self._nvtx: Any = None

    def start(self, completed: int) -> None:
        torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())
        self._nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
        self._nvtx.__enter__()

    def step(self) -> None:
        pass

    def stop(self) -> None:
        torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())
        if self._nvtx is not None:
            self._nvtx.__exit__(None, None, None)
            self._nvtx = None


class ProfileWindow:
    """When this rank profiles (``backend`` ``None``: not a profiled rank, every call does nothing).

    Call :meth:`start` before the loop, :meth:`before_iteration` / :meth:`after_iteration` around
    each iteration (1-based numbers), :meth:`close` at the end (stops a window the run did not finish).
    """

    def __init__(self, config: ProfilingConfig, backend: ProfileBackend | None) -> None:
        self.config, self.backend = config, backend
        self.running = False
        self._done = False

    def start(self, completed: int) -> None:
        """Before the first iteration of this run; ``completed`` iterations are done already."""
        if self.backend is None or completed >= self.config.profile_step_end:
            self._done = True
            return
        if self.backend.continuous:
            self.backend.start(completed)
            self.running = True

    def before_iteration(self, it: int) -> None:
        """Iteration ``it`` (1-based) begins."""
        if self._done:
            return
        if self.backend.continuous:
            self.backend.step()
        elif it - 1 == self.config.profile_step_start:
            self.backend.start(it - 1)
            self.running = True

    def after_iteration(self, it: int) -> None:
        """Iteration ``it`` (1-based) ended."""
        if not self._done and it == self.config.profile_step_end:
            self.close()

    def close(self) -> None:
        """Stop the backend if it runs."""
        if self.running:
            self.backend.stop()
            self.running = False
        self._done = True


def profile_window(config: ProfilingConfig, *, rank: int, device: torch.device) -> ProfileWindow:
    """The window of ``--profile`` for global ``rank``: PyTorch's profiler with ``--use-pytorch-profiler``
    (Megatron-LM's settings) or without CUDA (no stacks), else CUDA's capture range; no backend off
    ``--profile-ranks`` or without ``--profile``."""
    if not config.profile or rank not in config.profile_ranks:
        return ProfileWindow(config, None)
    if config.use_pytorch_profiler or device.type != "cuda":
        return ProfileWindow(config, TorchProfiler(config, rank=rank, with_stack=config.use_pytorch_profiler))
    return ProfileWindow(config, CudaCaptureRange())

"""Counts what drains a GPU on the pipeline's hot path, over one real iteration (CPU tests).

:func:`count_host_syncs` runs two iterations of a tiny GPT with megatron-zb's schedule in one rank
of :func:`~megatron_zb.testing.distributed.run_distributed` and, during the second (outside any
profiling window, no action timing, no memory tracking), counts every call that would make the
host wait for the GPU: ``Tensor.item``, ``Tensor.cpu``, ``Tensor.tolist``,
``torch.cuda.synchronize`` and ``Work.wait`` with a timeout -- and, for contrast, the p2p waits
without one. Each call is counted under the top-level package of its caller (``"item in megatron_zb"``,
``"item in megatron"``): megatron-core's own layers call ``.item()`` on CPU tensors (its RNG tracker
compares CPU generator states), which does not wait for a GPU and which its own schedules do too. The ``Work`` objects are wrapped by a recording proxy (the real gloo works underneath),
so every transfer still runs for real.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from typing import Any, Iterator

import torch


class _RecordingWork:
    """Delegates to a real ``Work``; records how ``wait`` is called (a test double's thin shell)."""

    def __init__(self, work: Any, counts: Counter) -> None:
        self._work, self._counts = work, counts

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self._counts["timed wait" if (args or kwargs.get("timeout") is not None) else "stream wait"] += 1
        return self._work.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        return self._work.is_completed()


@contextlib.contextmanager
def counting(counts: Counter) -> Iterator[None]:
    """Count host-synchronising calls (module docstring) into ``counts`` inside this block."""
    from megatron_zb.runtime import p2p

    saved = {name: getattr(torch.Tensor, name) for name in ("item", "cpu", "tolist")}
    sync, real_dist = torch.cuda.synchronize, p2p.dist

    def counted(name: str) -> Any:
        def call(self: torch.Tensor, *a: Any, **k: Any) -> Any:
            counts[f"{name} in {_caller()}"] += 1
            return saved[name](self, *a, **k)
        return call

    def counted_sync(*a: Any, **k: Any) -> None:
        counts[f"synchronize in {_caller()}"] += 1
        return sync(*a, **k)

    try:
        for name in saved:
            setattr(torch.Tensor, name, counted(name))
        torch.cuda.synchronize = counted_sync
        p2p.dist = _RecordingDist(real_dist, counts)  # the p2p layer's view only (megatron-core keeps its own)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        torch.cuda.synchronize, p2p.dist = sync, real_dist


class _RecordingDist:
    """``torch.distributed`` as the p2p layer sees it, with ``isend`` / ``irecv`` returning recording works."""

    def __init__(self, dist: Any, counts: Counter) -> None:
        self._dist, self._counts = dist, counts

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dist, name)

    def isend(self, *a: Any, **k: Any) -> _RecordingWork:
        return _RecordingWork(self._dist.isend(*a, **k), self._counts)

    def irecv(self, *a: Any, **k: Any) -> _RecordingWork:
        return _RecordingWork(self._dist.irecv(*a, **k), self._counts)


def _caller() -> str:
    """Top-level package of the code that called the counted function."""
    frame = sys._getframe(2)
    return str(frame.f_globals.get("__name__", "?")).split(".")[0]


def count_host_syncs(schedule: str | None, *, wait_policy: str = "stream", pp: int = 2) -> dict[str, Any]:
    """In one rank: the counts of the second of two iterations, and its number of compute actions
    (``schedule=None``: megatron-core's own 1F1B, for comparison; its compute actions are not counted)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func as megatron_func

    from megatron_zb.runtime import Measure, get_forward_backward_func
    from megatron_zb.runtime.p2p import WaitPolicy
    from megatron_zb.testing.tiny_gpt import TinyGPT, build, forward_backward, measured_forward_backward

    cfg = TinyGPT(pp=pp)
    _, modules = build(cfg, schedule)
    if schedule is None:
        fb = megatron_func()
    else:
        fb = get_forward_backward_func(schedule, wait_policy=WaitPolicy(wait_policy), **cfg.schedule_options)
    forward_backward(fb, modules, cfg.microbatches(), seq=cfg.seq, micro_batch=cfg.micro_batch)
    for m in modules:
        m.zero_grad()
    counts: Counter = Counter()
    with counting(counts):
        if schedule is None:
            forward_backward(fb, modules, cfg.microbatches(), seq=cfg.seq, micro_batch=cfg.micro_batch)
            actions = 0
        else:
            actions = measured_forward_backward(fb, modules, cfg.microbatches(), seq=cfg.seq, micro_batch=cfg.micro_batch,
                                                measure=Measure()).overhead.compute_actions
    return {"counts": dict(counts), "compute_actions": actions}

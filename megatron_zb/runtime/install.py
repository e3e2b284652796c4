"""The one install protocol: global rank 0 builds a schedule, every rank gets rank 0's, checks the
placement, installs it.

Every route that runs megatron-zb's runtime -- ``pretrain_gpt_zb.py``, Megatron-LM's own loop through
``--enable-zero-bubble`` (cost-aware or not), :func:`megatron_zb.patch_megatron`, the V routes -- gets
its schedules here, because :class:`~megatron_zb.runtime.forward_backward.ZeroBubbleForwardBackward`
calls :func:`install_from_rank0` for every ``(p, m)`` it has not installed (its ``install``), and the
re-plans of :mod:`megatron_zb.training.replanning` call the same method with measured costs. So a
generator that is not deterministic across processes (a time-limited solver) cannot give ranks
different action lists, and a schedule that cannot be built fails on every rank alike.

Collective over the default process group (every rank of the job calls it together: each training or
evaluation call of ``forward_backward_func`` is made by every rank); without ``torch.distributed``
initialised (one process) the build is local.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch.distributed as dist

from ..schedules.ir import Schedule, ScheduleError

__all__ = ["Installed", "NotBuilt", "install_from_rank0"]


@dataclass(frozen=True)
class Installed:
    """Rank 0's schedule, installed on this rank; ``seconds``: rank 0's build time [s]."""

    schedule: Schedule
    seconds: float


@dataclass(frozen=True)
class NotBuilt:
    """Rank 0 could not build the schedule (``reason``: the :class:`ScheduleError`'s message); nothing
    was installed on any rank. ``seconds``: rank 0's time until it failed [s]."""

    reason: str
    seconds: float


def install_from_rank0(build: Callable[[], Schedule], *, stage_to_rank: Sequence[int],
                       install: Callable[[Schedule], None]) -> Installed | NotBuilt:
    """Global rank 0 calls ``build()`` (a :class:`ScheduleError` becomes :class:`NotBuilt`); its
    outcome is broadcast; on every rank a built schedule must place stages as ``stage_to_rank`` (the
    placement this rank's model chunks were built for: a ``RuntimeError`` otherwise), then
    ``install(schedule)`` runs. Collective (module docstring)."""
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    outcome: list[Installed | NotBuilt | None] = [None]
    if not distributed or dist.get_rank() == 0:
        t0 = time.perf_counter()
        try:
            outcome[0] = Installed(build(), time.perf_counter() - t0)
        except ScheduleError as e:
            outcome[0] = NotBuilt(str(e), time.perf_counter() - t0)
    if distributed:
        dist.broadcast_object_list(outcome, src=0)
    result = outcome[0]
    assert result is not None
    if isinstance(result, Installed):
        if list(result.schedule.stage_to_rank) != list(stage_to_rank):
            raise RuntimeError(f"rank 0's schedule places stages as {result.schedule.stage_to_rank}, this rank's "
                               f"model was built for {list(stage_to_rank)}")
        install(result.schedule)
    return result

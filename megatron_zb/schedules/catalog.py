"""The catalogue of schedule names: :class:`ScheduleSpec` and the :func:`register` decorator.

A generator module registers each of its schedules here when it is imported (see
:mod:`megatron_zb.schedules.generators`); :mod:`megatron_zb.schedules.registry` looks names up.
This module knows no generator, so generators can import it without an import cycle.

Units: ``costs`` are per *stage* (with several chunks per rank, a stage is one chunk);
``memory_limit`` is the per-rank peak activation memory in the unit of ``costs.mem_b``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from .costs import CostModel
from .ir import Placement, Schedule, ScheduleError

__all__ = ["SCHEDULES", "Builder", "ScheduleSpec", "register"]


class Builder(Protocol):
    """What every registered generator is called with (all keyword arguments, always all given).

    ``costs`` is never ``None`` (the registry fills in the defaults); ``memory_limit`` ``None``
    means ``costs.memory_limit``, else the schedule's own default (a cost-aware builder resolves it
    with :func:`~.limits.resolve_limit`); ``num_chunks`` matters only for the interleaved placement.
    """

    def __call__(self, *, num_ranks: int, num_microbatches: int, costs: CostModel, memory_limit: float | None,
                 num_chunks: int) -> Schedule: ...


@dataclass(frozen=True)
class ScheduleSpec:
    """What a schedule name stands for.

    Attributes:
        name: the user-facing name (``--schedule NAME``).
        description: one line for ``--help`` and the README table.
        placement: :class:`~.ir.Placement` (``PLAIN``: one stage per rank; ``INTERLEAVED``: ``v``
            chunks per rank, stage ``s`` on rank ``s % p``; ``V``: two chunks per rank in a V).
        split_backward: whether the schedule splits backward into B and W.
        cost_aware: whether the generator uses the cost model / memory limit.
        build: the generator (see :class:`Builder`).
        vocab_parallel: whether the schedule holds vocabulary-parallel passes (``IF``, ``S``,
            ``T``, ``IB``; ``Schedule.vocab_barriers > 0``). The simulator, the plots and the
            JSON form take them; the runtime runs them given the model's vocabulary slices
            (docs/vocab_parallel.md; ``pretrain_gpt_zb.py --enable-vocab-parallel``); the export to
            PyTorch does not yet; the consumers refuse such a schedule otherwise by this flag.
    """

    name: str
    description: str
    placement: Placement
    split_backward: bool
    cost_aware: bool
    build: Callable[..., Schedule]
    vocab_parallel: bool = False

    def chunks_per_rank(self, num_chunks: int) -> int:
        """Model chunks per rank; ``num_chunks`` matters only for the interleaved placement."""
        return self.placement.chunks_per_rank(num_chunks)


SCHEDULES: dict[str, ScheduleSpec] = {}
"""Every registered schedule, in registration order (the order ``megatron-zb list`` shows)."""


def register(name: str, description: str, *, placement: Placement, split_backward: bool,
             cost_aware: bool, vocab_parallel: bool = False) -> Callable[[Builder], Builder]:
    """Decorator: register the decorated builder as schedule ``name`` (returns it unchanged);
    the keyword arguments are :class:`ScheduleSpec`'s fields.

    Raises:
        ScheduleError: ``name`` is registered already.
    """
    def add(build: Builder) -> Builder:
        if name in SCHEDULES:
            raise ScheduleError(f"schedule {name!r} is registered twice "
                                f"({SCHEDULES[name].build.__module__} and {build.__module__})")
        SCHEDULES[name] = ScheduleSpec(name, description, Placement(placement), split_backward, cost_aware, build,
                                       vocab_parallel)
        return build
    return add

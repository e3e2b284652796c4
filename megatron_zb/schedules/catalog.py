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
        excluded_from_plan: why ``megatron-zb plan`` leaves the schedule out unless ``--schedules``
            names it (said in the plan's report, e.g. an exact solver's minutes); ``None``: planned
            by default (:mod:`megatron_zb.planning.planner`).
        torch_auto_candidate: one of the families that ``auto`` of the PyTorch-pipelining export
            compares for its placement (:func:`megatron_zb.torch_pipelining.choice.candidates`:
            the fused-backward ones first, then registration order).
        v_mem_setup: the ``--zero-bubble-v-schedule-mem-setup`` value that selects this V-placement
            schedule with ``--zero-bubble-v-schedule`` (``pretrain_gpt_zb.py``, Megatron-LM's route);
            ``None``: no value does (:data:`megatron_zb.training.arguments.V_MEM_SETUP_TO_SCHEDULE`).
    """

    name: str
    description: str
    placement: Placement
    split_backward: bool
    cost_aware: bool
    build: Callable[..., Schedule]
    vocab_parallel: bool = False
    excluded_from_plan: str | None = None
    torch_auto_candidate: bool = False
    v_mem_setup: str | None = None

    def chunks_per_rank(self, num_chunks: int) -> int:
        """Model chunks per rank; ``num_chunks`` matters only for the interleaved placement."""
        return self.placement.chunks_per_rank(num_chunks)


SCHEDULES: dict[str, ScheduleSpec] = {}
"""Every registered schedule, in registration order (the order ``megatron-zb list`` shows)."""


def register(name: str, description: str, *, placement: Placement, split_backward: bool,
             cost_aware: bool, vocab_parallel: bool = False, excluded_from_plan: str | None = None,
             torch_auto_candidate: bool = False, v_mem_setup: str | None = None) -> Callable[[Builder], Builder]:
    """Decorator: register the decorated builder as schedule ``name`` (returns it unchanged);
    the keyword arguments are :class:`ScheduleSpec`'s fields.

    Raises:
        ScheduleError: ``name`` is registered already; ``v_mem_setup`` on a placement other than
            the V, or a value another schedule has.
    """
    def add(build: Builder) -> Builder:
        if name in SCHEDULES:
            raise ScheduleError(f"schedule {name!r} is registered twice "
                                f"({SCHEDULES[name].build.__module__} and {build.__module__})")
        if v_mem_setup is not None:
            if Placement(placement) is not Placement.V:
                raise ScheduleError(f"schedule {name!r}: v_mem_setup needs the V placement, not {placement}")
            taken = [s.name for s in SCHEDULES.values() if s.v_mem_setup == v_mem_setup]
            if taken:
                raise ScheduleError(f"schedule {name!r}: v_mem_setup {v_mem_setup!r} is {taken[0]!r}'s already")
        SCHEDULES[name] = ScheduleSpec(name=name, description=description, placement=Placement(placement),
                                       split_backward=split_backward, cost_aware=cost_aware, build=build,
                                       vocab_parallel=vocab_parallel, excluded_from_plan=excluded_from_plan,
                                       torch_auto_candidate=torch_auto_candidate, v_mem_setup=v_mem_setup)
        return build
    return add

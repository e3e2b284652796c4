"""The communicators a pipeline's programs use: created in one order everywhere, warmed up before use.

A program (:mod:`~megatron_zb.runtime.comm_program`) names every op's communicator by an id
(:data:`~megatron_zb.runtime.comm_certify.Comm`):

* ``("p2p", src, dst, slot)`` -- a direction of the pipeline (two ranks: the transfers of
  stage outputs and gradients);
* ``("bcast", kind, src, dst, slot)`` -- what one stage's rank sends to every other (vocabulary
  parallelism's ``X``, loss gradient and embedding gradient; two ranks);
* ``("coll", kind, slot)`` -- a vocabulary all-reduce over every rank of the model-parallel group.

Pipeline ranks in the ids are the pipeline group's; the ``coll`` communicators span the
model-parallel group (tensor x pipeline ranks). :meth:`Channels.ensure` gives every id its own
process group -- ``torch.distributed.new_group`` is collective over the default group, so every
rank creates every replica's groups, in the order of the plan's warm-up sequence, which every rank
computes alike -- and then **warms them up**: one tiny op on each communicator, in that one global
order, waited for before the first iteration. NCCL creates a communicator at its first op (neither
``training/distributed.py`` nor Megatron-LM passes ``device_id`` to ``init_process_group``), and
that creation is a host rendezvous of its members; inside an iteration two ranks could wait in
two creations for each other, while in one global order they cannot
(:mod:`~megatron_zb.runtime.comm_certify` replays the warm-up with the programs). gloo creates its
groups eagerly; the warm-up runs there too (the same code).
"""

from __future__ import annotations

import datetime
from typing import Any, Sequence

import torch
import torch.distributed as dist

__all__ = ["Channels", "NCCL_TIMEOUT_MARGIN_S", "channels_for"]

NCCL_TIMEOUT_MARGIN_S = 60.0
"""Seconds the communicators' own timeout (NCCL's watchdog) adds to the pipeline timeout, so that
the named :class:`~megatron_zb.runtime.peer_wait.PipelineTimeoutError` comes first."""

Comm = tuple


class Channels:
    """This rank's process groups for the communicator ids of its pipeline (module docstring).

    Attributes:
        pp_ranks: the pipeline group's global ranks (pipeline rank -> global rank).
        mp_ranks: the model-parallel group's global ranks (the ``coll`` communicators' members).
        backend: the process groups' backend (``"nccl"``, ``"gloo"``; ``"fake"`` in unit tests).
    """

    def __init__(self, pp_ranks: Sequence[int], mp_ranks: Sequence[int], backend: str, *, timeout: float,
                 groups: dict[Comm, Any] | None = None) -> None:
        self.pp_ranks, self.mp_ranks = tuple(pp_ranks), tuple(mp_ranks)
        self.backend, self.timeout = backend, timeout
        self._groups: dict[Comm, Any] = dict(groups or {})   # given: a unit test's fake groups
        self._warm: set[Comm] = set(self._groups)

    def group(self, comm: Comm) -> Any:
        """The process group of communicator ``comm``."""
        try:
            return self._groups[comm]
        except KeyError:
            raise ValueError(f"no communicator {comm} on this rank: the plan's warm-up sequence did not name it "
                             f"(Channels.ensure)") from None

    def peer(self, pipeline_rank: int) -> int:
        """The global rank of ``pipeline_rank``."""
        return self.pp_ranks[pipeline_rank]

    def ensure(self, sequence: Sequence[tuple[Comm, tuple[int, ...]]], device: torch.device) -> None:
        """Create and warm up every communicator of ``sequence`` (a plan's
        :attr:`~megatron_zb.runtime.rank_plan.RankPlan.communicators`) not done yet, in its order.
        Collective over the default group when a communicator is new: every rank calls it with
        the same sequence (every rank plans every rank's program)."""
        new = [(c, m) for c, m in sequence if c not in self._groups]
        if new:
            self._create([c for c, _ in new])
        cold = [(c, m) for c, m in sequence if c not in self._warm]
        if cold:
            _warm_up(self, cold, device)
            self._warm.update(c for c, _ in cold)

    def _create(self, comms: list[Comm]) -> None:
        """New process groups for ``comms``: every replica's, on every rank, in one order."""
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (self.pp_ranks, self.mp_ranks))
        pipelines = sorted({pp for pp, _ in everyone})
        mps = sorted({mp for _, mp in everyone})
        td = datetime.timedelta(seconds=self.timeout + NCCL_TIMEOUT_MARGIN_S)
        for comm in comms:
            for ranks in (mps if comm[0] == "coll" else pipelines):
                members = list(ranks) if comm[0] == "coll" else [ranks[comm[-3]], ranks[comm[-2]]]
                pg = dist.new_group(members, timeout=td, backend=self.backend,
                                    group_desc="megatron_zb_" + "_".join(str(x) for x in comm))
                if ranks == (self.mp_ranks if comm[0] == "coll" else self.pp_ranks):
                    self._groups[comm] = pg


def _warm_up(channels: Channels, sequence: Sequence[tuple[Comm, tuple[int, ...]]], device: torch.device) -> None:
    """One tiny op on each communicator of ``sequence`` this rank belongs to, in order, then wait
    for all of them (the NCCL model's replay of it: ``comm_certify._warmup_calls``)."""
    me = channels.pp_ranks.index(dist.get_rank()) if dist.get_rank() in channels.pp_ranks else None
    works = []
    for comm, members in sequence:
        t = torch.zeros(1, device=device)
        if comm[0] == "coll":
            works.append(dist.all_reduce(t, group=channels.group(comm), async_op=True))
        elif me == members[0]:
            works.append(dist.isend(t, dst=channels.peer(members[1]), group=channels.group(comm)))
        elif me == members[1]:
            works.append(dist.irecv(t, src=channels.peer(members[0]), group=channels.group(comm)))
    for w in works:
        w.wait()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_CACHE: dict[tuple, Channels] = {}


def channels_for(pp_group: Any, mp_group: Any, *, timeout: float) -> Channels:
    """This rank's :class:`Channels` for ``pp_group`` (and the vocabulary all-reduces over
    ``mp_group``), one per group pair and timeout, kept for the process (the communicators it
    creates outlive an iteration)."""
    pp = tuple(dist.get_process_group_ranks(pp_group))
    mp = tuple(dist.get_process_group_ranks(mp_group))
    # the key holds the default group itself (kept alive, so a later process group's id cannot
    # collide after destroy_process_group / init_process_group in the same process)
    key = (dist.group.WORLD, pp, mp, float(timeout))
    if key not in _CACHE:
        _CACHE[key] = Channels(pp, mp, dist.get_backend(pp_group), timeout=timeout)
    return _CACHE[key]

"""Executes one rank's part of any schedule on megatron-core model chunks.

The schedule is lowered (:func:`megatron_zb.schedules.lower`) and checked once per schedule
(:func:`plan_rank`); every iteration the rank then walks its action list (:func:`execute`):

* ``F``  -- megatron-core's ``forward_step`` on the chunk holding the stage (first stage reads
  the data iterator, the last stage computes the loss);
* ``B``  -- megatron-core's ``backward_step`` inside :meth:`WeightGradStore.deferring`: input
  gradients now, weight gradients of linear layers queued;
* ``W``  -- runs the queue of that (stage, microbatch);
* ``BW`` -- megatron-core's ``backward_step`` as is (fused, as 1F1B does);
* ``RECV_*`` / ``SEND_*`` -- p2p via :class:`PipeComm`, matched by order as on NCCL: the
  receives from each peer are posted in the order that peer sends them (:attr:`RankPlan.recv_order`),
  up to ``recv_lookahead`` actions ahead (on NCCL never ahead of one of this rank's own earlier
  sends to that peer, see :class:`RecvPoster`); transfers between two stages on the same rank
  (the tip of the V) are handed over in memory.

Using megatron-core's own ``forward_step``/``backward_step`` keeps loss scaling, per-token loss
normalisation and the loss bookkeeping identical to megatron-core's schedules.
"""

from __future__ import annotations

import bisect
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from ..schedules.ir import Action, Schedule
from ..schedules.lowering import check_lowered, lower
from .memory import ActivationMemoryTracker
from .p2p import PipeComm
from .wgrad_store import get_weight_grad_store


@dataclass
class ActionTiming:
    """Wall-clock seconds (``time.perf_counter``) of one iteration's actions on this rank.

    ``records``: every compute action ``(action, start, end)``. ``comm``: every communication
    action -- for a ``SEND_*`` the ``isend`` call (the copy into the transport), for a ``RECV_*``
    the posting of the receives it needs plus the wait for its data.
    """

    records: list[tuple[Action, float, float]] = field(default_factory=list)
    comm: list[tuple[Action, float, float]] = field(default_factory=list)

    def durations(self, op: str) -> dict[int, list[float]]:
        """Per stage, the durations (seconds) of actions of kind ``op`` (compute or communication)."""
        out: dict[int, list[float]] = {}
        for a, t0, t1 in (self.comm if op.startswith(("SEND", "RECV")) else self.records):
            if a.op == op:
                out.setdefault(a.stage, []).append(t1 - t0)
        return out


@dataclass
class StageRuntime:
    """What the executor needs to know about the rank's chunks and the tensors between stages.

    Attributes:
        chunks: stage index -> model chunk (the megatron-core module, possibly DDP-wrapped).
        data_iterators: stage index -> data iterator passed to ``forward_step_func``.
        tensor_shape: shape of the hidden states sent between stages
            (``[seq_len / tp if sequence parallel else seq_len, micro_batch_size, hidden]``).
        dtype: dtype of those hidden states (``config.pipeline_dtype``).
        device: device of those hidden states.
    """

    chunks: dict[int, torch.nn.Module]
    data_iterators: dict[int, Iterator[Any] | None]
    tensor_shape: Sequence[int]
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class RankPlan:
    """One rank's part of a lowered, checked schedule: what :func:`execute` walks.

    Built once per schedule by :func:`plan_rank` (lowering and validation cost milliseconds at
    large ``p * m``, which would otherwise be paid, on every rank at once, at the start of every
    iteration) and reused by every iteration.

    Attributes:
        schedule: the lowered schedule (compute and communication actions, all ranks).
        rank: the pipeline rank this plan is for.
        actions: that rank's actions, in execution order.
        recv_positions: indices into ``actions`` of its receives (posted ahead of use).
        out_of_order_stages: stages of this rank whose forwards do not run in microbatch order
            (their data iterators are read through an in-order buffer).
        forward_only: whether the plan keeps only the forwards and their transfers (evaluation).
        recv_order: per peer rank, this rank's receives from it in the order the peer's action
            list sends them -- the order they must be posted in, since transfers are matched by
            order (a V or interleaved placement carries activations and gradients over the same
            pair of ranks, and the peer may send them in another order than this rank needs them).
        send_positions: per peer rank, indices into ``actions`` of this rank's sends to it.
        recv_slot: ``(op, mb, stage)`` of each receive -> its index in ``recv_order[peer]``.
    """

    schedule: Schedule
    rank: int
    actions: tuple[Action, ...]
    recv_positions: tuple[int, ...]
    out_of_order_stages: frozenset[int]
    forward_only: bool
    recv_order: dict[int, tuple[Action, ...]] = field(default_factory=dict)
    send_positions: dict[int, tuple[int, ...]] = field(default_factory=dict)
    recv_slot: dict[tuple[str, int, int], int] = field(default_factory=dict)


def plan_rank(schedule: Schedule, *, rank: int, forward_only: bool = False, validate: bool = True) -> RankPlan:
    """Lower ``schedule`` (unless it already holds communication), check it, and keep ``rank``'s part.

    ``forward_only`` keeps only the forwards and their transfers, in the same order (evaluation).
    ``validate=False`` skips the checks (only for testing the runtime's own safety nets: p2p
    timeouts and the weight-gradient store's pending-W check). Raises
    :class:`~megatron_zb.schedules.ScheduleError` naming the first bad action.
    """
    if not 0 <= rank < schedule.num_ranks:
        raise ValueError(f"rank {rank} is outside the schedule's {schedule.num_ranks} pipeline ranks")
    if any(not a.is_compute for _, _, a in schedule.actions()):
        lowered = schedule  # already lowered (e.g. loaded from JSON): run it as written
        if validate:
            check_lowered(lowered)
    else:
        lowered = lower(schedule, check=validate)
    acts = lowered.ranks[rank]
    if forward_only:
        acts = [a for a in acts if a.op in ("F", "SEND_F", "RECV_F")]
    stages = {a.stage for a in acts if a.op == "F"}
    mine = {(a.op, a.mb, a.stage): a for a in acts if a.op.startswith("RECV")}
    recv_order: dict[int, tuple[Action, ...]] = {}
    for q in sorted({a.peer for a in mine.values()}):
        # the peer's sends to this rank, in its order, as this rank's receive actions
        sent = [mine.get((b.op.matching, b.mb, b.stage)) for b in lowered.ranks[q]
                if b.op.is_send and b.peer == rank]
        recv_order[q] = tuple(a for a in sent if a is not None)
    send_positions: dict[int, list[int]] = {}
    for i, a in enumerate(acts):
        if a.op.startswith("SEND"):
            send_positions.setdefault(a.peer, []).append(i)
    return RankPlan(schedule=lowered, rank=rank, actions=tuple(acts),
                    recv_positions=tuple(i for i, a in enumerate(acts) if a.op.startswith("RECV")),
                    out_of_order_stages=frozenset(s for s in stages if _forwards_out_of_order(acts, s)),
                    forward_only=forward_only, recv_order=recv_order,
                    send_positions={q: tuple(v) for q, v in send_positions.items()},
                    recv_slot={(a.op, a.mb, a.stage): i for order in recv_order.values()
                               for i, a in enumerate(order)})


class RecvPoster:
    """When one rank posts its receives: the policy :func:`execute` follows.

    * Receives from a peer are posted in the order that peer sends them (``plan.recv_order``):
      transfers are matched by order, as on NCCL.
    * Before action ``i`` (:meth:`ahead`), the receives whose ``RECV`` action is among the next
      ``lookahead`` actions are posted. With ``behind_sends`` (the default on NCCL), never one
      that would be posted ahead of one of this rank's own earlier sends to the same peer: NCCL
      runs the transfers of a pair of ranks on one stream, in posting order, so a receive posted
      early would hold that send back. gloo has no such stream; there, posting early lets the
      peer's send go out at once (gloo sends only into a receive the peer has announced).
    * Before waiting at a ``RECV`` (:meth:`through`), that receive and the peer's earlier ones are
      posted if they are not yet.
    """

    def __init__(self, plan: RankPlan, lookahead: int, *, behind_sends: bool = True) -> None:
        self.plan, self.lookahead, self.behind_sends = plan, lookahead, behind_sends
        self._index = plan.recv_slot
        self._posted = {q: 0 for q in plan.recv_order}   # per peer: receives posted, in its order
        self._next = 0                                  # next entry of plan.recv_positions
        self._orphans: set[tuple[str, int, int]] = set()

    def ahead(self, i: int) -> list[Action]:
        """Receives to post before running action ``i``."""
        plan, out = self.plan, []
        pos = plan.recv_positions
        while self._next < len(pos) and pos[self._next] < i + self.lookahead:
            j = pos[self._next]
            if self.behind_sends and self._send_pending(plan.actions[j].peer, i, j):
                break  # it would go ahead of our own earlier send to that peer
            out += self.through(plan.actions[j])
            self._next += 1
        return out

    def through(self, a: Action) -> list[Action]:
        """Receives to post (in the peer's order) so that ``a``'s receive is posted."""
        key = (a.op, a.mb, a.stage)
        idx = self._index.get(key)
        if idx is None:  # the peer never sends it (only with validate=False): post it, let it time out
            if key in self._orphans:
                return []
            self._orphans.add(key)
            return [a]
        order, q = self.plan.recv_order[a.peer], a.peer
        out = list(order[self._posted[q]:idx + 1])
        self._posted[q] = max(self._posted[q], idx + 1)
        return out

    def _send_pending(self, q: int, i: int, j: int) -> bool:
        """Whether this rank has a send to ``q`` at a position in ``[i, j)`` (not issued yet)."""
        pos = self.plan.send_positions.get(q, ())
        k = bisect.bisect_left(pos, i)
        return k < len(pos) and pos[k] < j


def execute(*, plan: RankPlan, runtime: StageRuntime, forward_step_func: Callable, config: Any,
            comm: PipeComm, collect_non_loss_data: bool = False, cp_group_size: int = 1,
            first_val_step: bool | None = None, recv_lookahead: int = 8, recv_behind_sends: bool = True,
            timing: ActionTiming | None = None,
            memory: ActivationMemoryTracker | None = None) -> tuple[list[Any], torch.Tensor]:
    """Run one iteration of ``plan`` (see :func:`plan_rank`); return (forward data store, total tokens).

    The forward data store holds what megatron-core's schedules return: the reduced losses of
    the last stage, in microbatch order. ``recv_lookahead`` and ``recv_behind_sends`` set when
    receives are posted (:class:`RecvPoster`).
    """
    from megatron.core.pipeline_parallel.schedules import backward_step, check_first_val_step, forward_step
    from megatron.core.utils import get_model_type

    schedule, rank, forward_only = plan.schedule, plan.rank, plan.forward_only
    acts = plan.actions
    m, last = schedule.num_microbatches, schedule.num_stages - 1
    store = get_weight_grad_store()
    shape, dtype, device = runtime.tensor_shape, runtime.dtype, runtime.device

    inputs: dict[tuple[int, int], Any] = {}      # (mb, stage) -> stage input (None on stage 0)
    outputs: dict[tuple[int, int], Any] = {}     # (mb, stage) -> stage output (loss on last)
    grads: dict[tuple[int, int], torch.Tensor] = {}   # (mb, stage) -> grad of that stage's output
    local_act: dict[tuple[int, int], torch.Tensor] = {}  # same-rank handover of activations
    local_grad: dict[tuple[int, int], torch.Tensor] = {}  # same-rank handover of gradients
    stage_data: dict[tuple[int, int], list[Any]] = {}    # per-(mb, stage) forward data (reordered below)
    total_tokens = torch.zeros([], dtype=torch.int)
    feeders = {s: _InOrderFeeder(it) for s, it in runtime.data_iterators.items()
               if it is not None and s in plan.out_of_order_stages}
    poster = RecvPoster(plan, recv_lookahead, behind_sends=recv_behind_sends)
    model_type = get_model_type(next(iter(runtime.chunks.values())))

    for i, a in enumerate(acts):
        # look ahead, but not between a compute action and its sends (they are on the peer's
        # critical path) nor between a receive and the compute action waiting for it
        if not (a.op.startswith("SEND") or (i > 0 and acts[i - 1].op.startswith("RECV"))):
            for r in poster.ahead(i):
                comm.post_recv(r, shape, dtype, device)
        key = (a.mb, a.stage)
        t0 = time.perf_counter()
        if a.op.startswith("RECV"):
            for r in poster.through(a):
                comm.post_recv(r, shape, dtype, device)
        if not a.is_compute:
            if a.op == "RECV_F":
                t = comm.wait_recv(a, shape, dtype, device)
                inputs[(a.mb, a.stage + 1)] = t.requires_grad_(not forward_only)
            elif a.op == "RECV_B":
                grads[(a.mb, a.stage - 1)] = comm.wait_recv(a, shape, dtype, device)
            elif a.op == "SEND_F":
                comm.send(a, _first(outputs[key]))
                if forward_only:
                    outputs.pop(key)
            else:  # SEND_B
                comm.send(a, inputs.pop(key))
            if timing is not None:
                timing.comm.append((a, t0, time.perf_counter()))
            continue
        if a.op == "F":
            model = runtime.chunks[a.stage]
            if a.stage == 0:
                inp = None
            elif (a.mb, a.stage) in inputs:
                inp = inputs[(a.mb, a.stage)]
            else:  # previous stage lives on this rank (tip of the V)
                inp = local_act.pop((a.mb, a.stage - 1)).detach().requires_grad_(not forward_only)
                inputs[(a.mb, a.stage)] = inp
            data: list[Any] = []
            ctx = memory.saving() if memory is not None else contextlib.nullcontext()
            with ctx:
                out, n_tok = forward_step(
                    forward_step_func,
                    feeders[a.stage].for_microbatch(a.mb) if a.stage in feeders else runtime.data_iterators.get(a.stage),
                    model, m, inp, data, config,
                    cp_group_size, collect_non_loss_data=collect_non_loss_data,
                    is_first_microbatch=check_first_val_step(first_val_step, forward_only, a.mb == 0),
                    current_microbatch=a.mb, is_last_stage=(a.stage == last))
            total_tokens += n_tok
            if data:
                stage_data[key] = data
            if a.stage < last and schedule.stage_to_rank[a.stage + 1] == rank:
                local_act[key] = _first(out)
            if not forward_only or a.stage < last:
                outputs[key] = out
            if forward_only and a.stage == last:
                inputs.pop(key, None)
        elif a.op in ("B", "BW"):
            inp = inputs.pop(key, None)
            out = outputs.pop(key)
            if a.stage == last:
                out_grad = None
            elif key in grads:
                out_grad = grads.pop(key)
            else:  # next stage lives on this rank
                out_grad = local_grad.pop(key)
            if a.op == "B":
                with store.deferring(a.stage, a.mb):
                    in_grad = backward_step(inp, out, out_grad, model_type, config)
            else:
                in_grad = backward_step(inp, out, out_grad, model_type, config)
            del out, out_grad
            if a.stage > 0:
                if schedule.stage_to_rank[a.stage - 1] == rank:
                    local_grad[(a.mb, a.stage - 1)] = in_grad
                else:
                    inputs[key] = in_grad  # picked up by the SEND_B that follows
        elif a.op == "W":
            store.run(a.stage, a.mb)
        if timing is not None:
            timing.records.append((a, t0, time.perf_counter()))
    comm.finish()
    if not forward_only:
        store.assert_empty()
    forward_data = [d for mb in range(m) for d in stage_data.get((mb, last), [])]
    return forward_data, total_tokens


def _first(x: Any) -> torch.Tensor:
    return x[0] if isinstance(x, (list, tuple)) else x


def _forwards_out_of_order(acts: Sequence[Action], stage: int) -> bool:
    mbs = [a.mb for a in acts if a.op == "F" and a.stage == stage]
    return mbs != sorted(mbs)


class _InOrderFeeder:
    """Serves micro batch ``i`` of a data iterator to a forward that runs out of order.

    megatron-core's data iterators are read in microbatch order, one item per forward. When a
    schedule runs a stage's forwards out of microbatch order, this reads the iterator in order,
    keeps the items not yet used, and hands each forward a one-item iterator with its own micro
    batch. Stages whose forwards are in order use the iterator directly (no buffering).
    """

    def __init__(self, it: Iterator[Any]) -> None:
        self._it = it
        self._read = 0
        self._held: dict[int, Any] = {}

    def for_microbatch(self, mb: int) -> Iterator[Any]:
        while self._read <= mb:
            self._held[self._read] = next(self._it)
            self._read += 1
        return iter([self._held.pop(mb)])

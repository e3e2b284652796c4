"""Point-to-point transfers of a lowered schedule over torch.distributed, with timeouts.

Matching is by order, never by tag: every transfer uses the same tag, so a receive from a peer
is matched with that peer's sends to this rank in the order both were posted -- the semantics
NCCL has anyway (it ignores tags). Running the CPU tests on gloo with one tag therefore
exercises exactly what a GPU run relies on. The executor keeps the orders equal: it posts the
receives from each peer in the order that peer's action list sends them
(:attr:`~megatron_zb.runtime.rank_plan.RankPlan.recv_order`), which on a V or interleaved
placement can differ from the order in which this rank *needs* them (activations and gradients
travel over the same pair of ranks). Receives are therefore identified by
``(op, microbatch, producing stage)`` here and posted ahead of use (:meth:`PipeComm.post_recv`);
sends are asynchronous and drained at the end of the iteration. Every wait has a timeout and
raises :class:`PipelineTimeoutError` naming the rank, the action and the peer.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from ..schedules.ir import Action


class PipelineTimeoutError(RuntimeError):
    """A pipeline transfer did not complete in time (a peer died, or the schedule is inconsistent)."""


PIPELINE_TAG = 0
"""The one tag of every pipeline transfer (matching is by posting order, as with NCCL)."""


@dataclass
class _Pending:
    work: dist.Work
    tensor: torch.Tensor
    action: Action


class PipeComm:
    """Sends and receives of one rank, over ``group`` (ranks are *group* ranks).

    Args:
        group: the pipeline-parallel process group.
        num_stages: stages of the schedule.
        timeout: seconds to wait for any single transfer before failing.
    """

    def __init__(self, *, group: dist.ProcessGroup | None, num_stages: int, timeout: float = 120.0) -> None:
        self.group = group
        self.num_stages = num_stages
        self.timeout = datetime.timedelta(seconds=timeout)
        self.rank = dist.get_rank(group)
        # group rank -> global rank, looked up once (not per transfer)
        self._global_ranks = dist.get_process_group_ranks(group) if group is not None else None
        self._recvs: dict[tuple[str, int, int], _Pending] = {}
        self._sends: list[_Pending] = []

    def _global(self, group_rank: int) -> int:
        return self._global_ranks[group_rank] if self._global_ranks is not None else group_rank

    def post_recv(self, a: Action, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> None:
        """Post the receive of ``a`` (a ``RECV_F``/``RECV_B``) if not posted yet.

        Receives from one peer must be posted in the order that peer sends (see the module
        docstring); the caller guarantees it.
        """
        key = (a.op, a.mb, a.stage)
        if key in self._recvs:
            return
        buf = torch.empty(tuple(shape), dtype=dtype, device=device)
        work = dist.irecv(buf, src=self._global(a.peer), group=self.group, tag=PIPELINE_TAG)
        self._recvs[key] = _Pending(work, buf, a)

    def wait_recv(self, a: Action, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Wait for the receive of ``a`` (posting it first if needed) and return the tensor."""
        self.post_recv(a, shape, dtype, device)
        p = self._recvs.pop((a.op, a.mb, a.stage))
        self._wait(p, "receive")
        return p.tensor

    def send(self, a: Action, tensor: torch.Tensor) -> None:
        """Start the send of ``a`` (a ``SEND_F``/``SEND_B``); it completes asynchronously."""
        t = tensor.detach().contiguous()
        work = dist.isend(t, dst=self._global(a.peer), group=self.group, tag=PIPELINE_TAG)
        self._sends.append(_Pending(work, t, a))
        if len(self._sends) > 64:  # bound the number of in-flight sends
            self._wait(self._sends.pop(0), "send")

    def finish(self) -> None:
        """Wait for every outstanding send; fail if a posted receive was never consumed."""
        while self._sends:
            self._wait(self._sends.pop(0), "send")
        if self._recvs:
            left = ", ".join(str(p.action) for p in self._recvs.values())
            self._recvs.clear()
            raise RuntimeError(f"rank {self.rank}: receives posted but never used: {left}")

    def _wait(self, p: _Pending, what: str) -> None:
        try:
            ok = p.work.wait(timeout=self.timeout)
        except RuntimeError as e:  # gloo raises on timeout
            raise PipelineTimeoutError(
                f"pipeline rank {self.rank}: {what} for {p.action} with peer rank {p.action.peer} did not "
                f"complete within {self.timeout.total_seconds():g} s ({e.__class__.__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''})") from None
        if ok is False:
            raise PipelineTimeoutError(
                f"pipeline rank {self.rank}: {what} for {p.action} with peer rank {p.action.peer} did not "
                f"complete within {self.timeout.total_seconds():g} s")

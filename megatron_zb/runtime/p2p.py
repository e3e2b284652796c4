"""Point-to-point transfers of a lowered schedule over torch.distributed: one communicator per
direction, waits that do not block the host on NCCL, sends released when sent, timeouts.

* **Communicators.** Each direction of each pair of neighbouring pipeline ranks has its own
  two-rank process groups (:class:`~megatron_zb.runtime.channels.Channels`), one per *slot*: the
  program names the slot of every transfer (:mod:`~megatron_zb.runtime.comm_program`). On NCCL
  the transfers of one communicator run on one stream in posting order, and a send above NCCL's
  internal buffer completes only once the peer's receive runs; with both directions on one
  communicator, rank 0's ``[send F1, recv B0]`` and rank 1's ``[send B0, recv F1]`` wait for each
  other (1F1B's steady state). Every program is replayed under a model of NCCL before it runs
  (:mod:`~megatron_zb.runtime.comm_certify`). gloo uses the same communicators.
* **Matching** is by order, never by tag (NCCL ignores tags): the receives of a direction are
  posted in the order the peer sends them (:attr:`RankPlan.recv_order`); they are identified by
  ``(op, microbatch, producing stage)`` and posted ahead of use (:meth:`PipeComm.post_recv`).
* **Waits** follow the one deadline rule of :mod:`megatron_zb.runtime.peer_wait` (:class:`WaitPolicy`):
  on gloo the host waits with the pipeline timeout and a late transfer raises
  :class:`PipelineTimeoutError` naming the rank, action and peer. On NCCL ``Work.wait()`` is
  called without a timeout, which only makes the compute stream wait (with a timeout PyTorch's
  NCCL ``wait`` polls on the host); a :class:`~megatron_zb.runtime.peer_wait.Watchdog` thread checks the
  outstanding transfers every few seconds, and the next p2p call raises the same named error (or,
  with the main thread blocked behind the transfer, the watchdog ends the process with it); the
  communicators' own NCCL timeout (the pipeline timeout plus a margin) is the last resort.
* **Memory.** A send's tensor is dropped once the send completes (checked without blocking at
  every p2p call) and at the latest at its ``RELEASE`` step (:mod:`~megatron_zb.runtime.comm_program`),
  so at most :attr:`Program.max_outstanding_sends` are held. With an activation tracker, receive
  buffers and sent tensors are counted as p2p bytes.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from .peer_wait import Awaited, PipelineTimeoutError, WaitPolicy, Watchdog, wait_host
from ..schedules.ir import Action
from .channels import Channels
from .comm_program import transfer_key

__all__ = ["PipeComm", "PipelineTimeoutError", "WaitPolicy"]


PIPELINE_TAG = 0
"""The one tag of every pipeline transfer (matching is by posting order, as with NCCL)."""


@dataclass
class _Pending:
    work: Any                # a torch.distributed Work
    tensor: torch.Tensor
    action: Action
    since: float             # time.monotonic() when it was issued [s]


class PipeComm:
    """Sends and receives of one rank (pipeline-group ranks), for one iteration.

    Args:
        channels: the pipeline's communicators (:func:`~megatron_zb.runtime.channels.channels_for`).
        rank: this rank in the pipeline group.
        timeout: seconds any single transfer may take before :class:`PipelineTimeoutError`.
        policy: how to wait (default: from the channels' backend).
        memory: an activation tracker that counts receive buffers and sent tensors as p2p bytes.
        max_outstanding_sends: the plan's bound (:attr:`Program.max_outstanding_sends`); more
            held sends is a bug and raises.
    """

    def __init__(self, *, channels: Channels, rank: int, timeout: float = 120.0,
                 policy: WaitPolicy | None = None, memory: Any = None, max_outstanding_sends: int | None = None) -> None:
        self.channels, self.rank = channels, rank
        self.timeout = datetime.timedelta(seconds=timeout)
        self.policy = policy or WaitPolicy.for_backend(channels.backend)
        self.memory, self.max_sends = memory, max_outstanding_sends
        self._recvs: dict[tuple, _Pending] = {}
        self._sends: dict[tuple, _Pending] = {}
        self._watchdog = None
        if self.policy is WaitPolicy.STREAM:
            self._watchdog = Watchdog(self._watched, timeout_s=timeout, name=f"megatron-zb-p2p-watchdog-{rank}")

    def post_recv(self, a: Action, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
                  slot: int = 0) -> None:
        """Post the receive of ``a`` (a ``RECV_F``/``RECV_B``) into a new buffer on ``device``, on
        communicator ``slot`` of its direction."""
        self._check()
        buf = torch.empty(tuple(shape), dtype=dtype, device=device)
        group = self.channels.group(("p2p", a.peer, self.rank, slot))
        work = dist.irecv(buf, src=self.channels.peer(a.peer), group=group, tag=PIPELINE_TAG)
        self._recvs[transfer_key(a)] = _Pending(work, buf, a, time.monotonic())
        if self.memory is not None:
            self.memory.track_p2p(buf)

    def wait_recv(self, a: Action) -> torch.Tensor:
        """Wait for the posted receive of ``a`` and return its tensor."""
        p = self._recvs.pop(transfer_key(a))
        self._wait(p, "receive")
        self._reap()
        return p.tensor

    def send(self, a: Action, tensor: torch.Tensor, slot: int = 0) -> None:
        """Start the send of ``a`` (a ``SEND_F``/``SEND_B``) on communicator ``slot`` of its
        direction; it completes asynchronously."""
        self._check()
        t = tensor.detach().contiguous()
        group = self.channels.group(("p2p", self.rank, a.peer, slot))
        work = dist.isend(t, dst=self.channels.peer(a.peer), group=group, tag=PIPELINE_TAG)
        self._sends[transfer_key(a)] = _Pending(work, t, a, time.monotonic())
        if self.memory is not None:
            self.memory.track_p2p(t)
        self._reap()
        if self.max_sends is not None and len(self._sends) > self.max_sends:
            raise RuntimeError(f"pipeline rank {self.rank}: {len(self._sends)} sends held, above the plan's "
                               f"bound of {self.max_sends} (a RELEASE step is missing)")

    def release(self, a: Action) -> None:
        """Wait for the send of ``a`` (if still held) and drop its tensor."""
        p = self._sends.pop(transfer_key(a), None)
        if p is not None:
            self._wait(p, "send")

    @property
    def held_sends(self) -> int:
        """Sends started and not yet dropped."""
        return len(self._sends)

    def finish(self) -> None:
        """Wait for every outstanding send; fail if a posted receive was never consumed."""
        for key in list(self._sends):
            self._wait(self._sends.pop(key), "send")
        if self._watchdog is not None:
            self._watchdog.stop()
        if self._recvs:
            left = ", ".join(str(p.action) for p in self._recvs.values())
            self._recvs.clear()
            raise RuntimeError(f"rank {self.rank}: receives posted but never used: {left}")

    def abort(self) -> None:
        """Stop the watchdog and drop everything (the iteration failed)."""
        if self._watchdog is not None:
            self._watchdog.stop()
        self._sends.clear()
        self._recvs.clear()

    def _reap(self) -> None:
        """Drop the sends that have completed (no blocking: ``Work.is_completed``)."""
        for key in [k for k, p in self._sends.items() if p.work.is_completed()]:
            del self._sends[key]

    def _check(self) -> None:
        if self._watchdog is not None:
            self._watchdog.check()

    def _wait(self, p: _Pending, what: str) -> None:
        if self.policy is WaitPolicy.STREAM:
            self._check()
            p.work.wait()  # the current stream waits; the host goes on (the watchdog keeps the timeout)
            return
        wait_host(p.work, self.awaited(p, what), self.timeout.total_seconds())

    def awaited(self, p: _Pending, what: str) -> Awaited:
        """What waiting for transfer ``p`` (a ``"receive"`` / ``"send"``) waits for, for the named error."""
        return Awaited(f"pipeline rank {self.rank}", f"{what} for {p.action}", (p.action.peer,),
                       global_ranks=(self.channels.peer(self.rank), (self.channels.peer(p.action.peer),)))

    def timeout_error(self, p: _Pending, what: str, detail: str = "") -> RuntimeError:
        """The named error for transfer ``p`` that did not complete within the timeout."""
        return self.awaited(p, what).error(self.timeout.total_seconds(), detail)

    def _watched(self) -> list[tuple[Any, float, Awaited]]:
        return [(p.work, p.since, self.awaited(p, what)) for p, what in self.outstanding()]

    def outstanding(self) -> list[tuple[_Pending, str]]:
        """Every transfer issued and not yet consumed or dropped, with ``"receive"`` / ``"send"``."""
        return [(p, "receive") for p in list(self._recvs.values())] + [(p, "send") for p in list(self._sends.values())]

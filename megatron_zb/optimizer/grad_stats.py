"""The gradient statistics of a post-validated step: local values, asynchronous global reductions.

megatron-core's ``step()`` reduces three values over the optimizer's grad-stats group *G*
before any update: the found-inf flag (all-reduce MAX), the squared grad norm (SUM) and, when
logged, the zero count (SUM). This module computes this rank's share of each exactly as
megatron-core does (same kernels, same order), launches the *same* all-reduces with
``async_op=True`` (:class:`GradStatsInFlight`), and waits for them later with a timeout. It
also builds the stage-local agreement group *H* (the ranks of *G* at this pipeline stage).
``docs/post_validation.md``, "Data flow", describes how the wrapper uses them.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from megatron_zb.megatron_compat import optimizer as megatron_compat_optimizer
from megatron_zb.runtime.peer_wait import Awaited, wait_host
from megatron_zb.optimizer.values import PostValidationTimeout

__all__ = [
    "GradStatsInFlight",
    "local_sq_norm",
    "local_zero_count",
    "same_group",
    "stage_agreement_group",
    "stats_device",
    "wait_for",
]


def stats_device() -> torch.device:
    """Where megatron-core keeps its statistics tensors: the current CUDA device, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def local_sq_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """This rank's squared L2 norm of ``grads`` (1-element fp32) computed as megatron-core's
    ``get_grad_norm_fp32`` does before its all-reduce (same multi-tensor kernel, same ``** 2.0``)."""
    if grads:
        dummy_overflow_buf = torch.zeros(1, dtype=torch.int, device=stats_device())
        grad_norm = megatron_compat_optimizer.multi_tensor_l2_norm(list(grads), dummy_overflow_buf)
    else:
        grad_norm = torch.zeros(1, dtype=torch.float, device=stats_device())
    return grad_norm ** 2.0


def local_zero_count(params: Sequence[torch.Tensor], groups: dict[str, Any]) -> torch.Tensor:
    """This rank's count of zero gradient elements (1 element; fp32 on megatron-core 0.16.1, int64
    on 0.19) as megatron-core's ``count_zeros_fp32`` accumulates it before its all-reduce;
    ``groups``: :func:`megatron_compat.optimizer.zero_count_groups`."""
    total = torch.zeros(1, dtype=megatron_compat_optimizer.zero_count_dtype(), device=stats_device())
    for param in params:
        if getattr(param, "grad", None) is not None and megatron_compat_optimizer.param_counts_for_zeros(param, groups):
            grad = param.grad.detach()
            total = (grad.numel() - torch.count_nonzero(grad)) + total
    return total


def _ranks(group: Any) -> list[int]:
    if group is None or group is dist.GroupMember.WORLD:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def same_group(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are the same process group or hold the same ranks in the same order."""
    return a is b or _ranks(a) == _ranks(b)


def stage_agreement_group(stats_group: Any, pp_group: Any, timeout: float) -> Any:
    """The ranks of ``stats_group`` at this rank's pipeline stage, as a process group (None if alone).

    Collective over the default group: every rank gathers every rank's (stats-group ranks, pp
    rank) and creates the same sub-groups in the same order. ``timeout`` in seconds.
    """
    me = dist.get_rank()
    pp_ranks = _ranks(pp_group)
    info: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(info, (tuple(_ranks(stats_group)), pp_ranks.index(me)))
    wanted = set()
    for members, stage in info:
        wanted.add(tuple(sorted(r for r in members if info[r][1] == stage)))
    mine = tuple(sorted(r for r in info[me][0] if info[r][1] == info[me][1]))
    result = None
    for members in sorted(wanted):
        if len(members) > 1:
            pg = dist.new_group(list(members), timeout=datetime.timedelta(seconds=timeout))
            if members == mine:
                result = pg
    return result


def wait_for(work: Any, *, timeout: float, iteration: int, what: str, group: Any) -> None:
    """Wait for an asynchronous collective on ``group`` at most ``timeout`` seconds, by the deadline rule of
    :mod:`megatron_zb.runtime.peer_wait` (a timed host wait: the result is read on the host right after, so
    the wait is where the host would block anyway); on expiry raise :class:`PostValidationTimeout`
    naming this rank, ``what`` was awaited, the step ``iteration`` (the wrapper's 0-based count)
    and the other ranks of ``group``."""
    me = dist.get_rank()
    awaited = Awaited(f"rank {me}", f"post-validation's {what} of iteration {iteration}",
                      tuple(r for r in _ranks(group) if r != me))
    wait_host(work, awaited, timeout, error_type=PostValidationTimeout)


@dataclass
class GradStatsInFlight:
    """One step's statistics on their way to megatron-core's global values.

    The tensors are reduced in place by the launched all-reduces; read them only after
    :meth:`wait`. Absent values (``None``) are those megatron-core's step would not compute.

    Attributes:
        found: per optimizer part, its found-inf flag (fp32, > 0: inf/nan), all-reduced MAX.
        found_work / norm_work / zeros_work: the asynchronous all-reduces' handles.
        norm_sq: squared grad norm, all-reduced SUM (exactly megatron-core's tensor).
        zeros: zero-gradient count, all-reduced SUM.
        local_found_inf: this rank saw an inf/nan itself.
        local_norm_sq: this rank's own squared norm (float), copied before the launch.
    """

    found: torch.Tensor | None
    norm_sq: torch.Tensor | None
    zeros: torch.Tensor | None
    local_found_inf: bool
    local_norm_sq: float | None
    found_work: Any = None
    norm_work: Any = None
    zeros_work: Any = None
    group: Any = None

    @classmethod
    def launch(cls, *, found: torch.Tensor | None, norm_sq: torch.Tensor | None, zeros: torch.Tensor | None,
               group: Any) -> "GradStatsInFlight":
        """Keep the local values, launch megatron-core's all-reduces on ``group`` (the grad-stats
        group) without waiting -- the same collectives on the same tensors -- and only then read the
        local values on the host, so that the reductions are queued before the host waits for the
        device (on a GPU ``.item()`` drains the stream)."""
        local_found = found.sum() > 0 if found is not None else None      # device tensors, before
        local_norm = norm_sq.clone() if norm_sq is not None else None     # the in-place all-reduces
        works = [dist.all_reduce(t, op=op, group=group, async_op=True) if t is not None else None
                 for t, op in ((found, dist.ReduceOp.MAX), (norm_sq, dist.ReduceOp.SUM), (zeros, dist.ReduceOp.SUM))]
        return cls(found=found, norm_sq=norm_sq, zeros=zeros,
                   local_found_inf=bool(local_found is not None and local_found.item()),
                   local_norm_sq=float(local_norm.item()) if local_norm is not None else None,
                   found_work=works[0], norm_work=works[1], zeros_work=works[2], group=group)

    def agree_in_stage(self, agree_group: Any, *, timeout: float, iteration: int) -> tuple[bool, float | None]:
        """Sum (inf flag, squared norm) over the stage-local group *H* (waited, ``timeout`` s):
        the ranks of one stage share collectives in the update, so they must decide alike.
        Returns (inf/nan seen in the stage, the stage's squared norm); this rank's alone without *H*."""
        if agree_group is None:
            return self.local_found_inf, self.local_norm_sq
        device = stats_device()
        vec = torch.tensor([1.0 if self.local_found_inf else 0.0, self.local_norm_sq or 0.0],
                           dtype=torch.float64, device=device)
        wait_for(dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=agree_group, async_op=True),
                 timeout=timeout, iteration=iteration, what="stage agreement all-reduce", group=agree_group)
        return vec[0].item() > 0, vec[1].item()

    def wait(self, *, timeout: float, iteration: int) -> None:
        """Wait for the launched all-reduces, each at most ``timeout`` seconds."""
        for work, what in ((self.found_work, "found-inf all-reduce"), (self.norm_work, "grad-norm all-reduce"),
                           (self.zeros_work, "zero-count all-reduce")):
            if work is not None:
                wait_for(work, timeout=timeout, iteration=iteration, what=what + " over the grad-stats group",
                         group=self.group)

    def global_grad_norm(self) -> float | None:
        """The all-reduced grad norm as ``get_grad_norm_fp32`` returns it (after :meth:`wait`)."""
        return None if self.norm_sq is None else megatron_compat_optimizer.grad_norm_from_sq_sum(self.norm_sq)

    def global_zero_count(self) -> float | None:
        """The all-reduced zero count (after :meth:`wait`)."""
        return None if self.zeros is None else self.zeros.item()

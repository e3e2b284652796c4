"""FSDP (``fully_shard``) stages in PyTorch's pipeline runtime: their gradient reduce in the cost model.

Tested with PyTorch 2.13 (CPU, gloo, a 2 x 2 mesh: ``tests/torch_pipelining/test_torch_runtime.py``).
When a stage's module is FSDP-sharded, PyTorch's lowering (``_prepare_schedule_with_comms``)
adds, per stage, ``UNSHARD`` before its first compute action, ``RESHARD`` after its last, and one
``REDUCE_GRAD`` right after the stage's last ``W`` (or fused ``B``) of the iteration: the runtime
then calls ``PipelineStage.perform_reduce_grad``, whose FSDP post-backward reduce-scatters the
stage's gradients over the data-parallel mesh (on CUDA on FSDP's own stream, so it overlaps the
rank's remaining compute -- read from PyTorch's FSDP code, not run here; with gloo on the CPU the call returns when the reduce is done). With
many stages per rank (V, interleaved), the order of a rank's trailing ``W``'s decides when each
stage's reduce can start and how much of it the other stage's ``W``'s hide -- the question
megatron-zb's reduce-aware tail (:func:`~megatron_zb.schedules.dp_reduce.reduce_aware_tail`)
answers for megatron-core's bucketed reduce.

So the reduce is one bucket per stage of :func:`stage_grad_bytes` bytes, ready at the stage's
last ``W``: :func:`fsdp_reduce_model` is the
:class:`~megatron_zb.schedules.costs.DPReduceModel` (``overlap=True``, no buckets) that
:func:`~.profiling.profile_and_replan` puts into the measured costs, with the bandwidth measured
from the ``REDUCE_GRAD`` calls (``R`` in its medians); the V family and ``interleaved-zb`` then
place the trailing ``W``'s to hide it. Not modelled: the ``UNSHARD`` all-gathers (issued before
a stage's first forward; PyTorch keeps at most three stages unsharded) and the memory of
unsharded parameters.

Refused (:func:`nested_fsdp`, called by :func:`~.runtime.check_stage_modules`) for a family
that splits the backward: ``fully_shard``-ed submodules inside a stage module (the usual
per-block sharding). Measured with PyTorch 2.13 on the 2 x 2 mesh, each block ``fully_shard``-ed
and then the stage: on the loss stage, when every backward is an ``I`` followed later by a ``W``
(zb-1p, zb-h1, zb-2p, interleaved-zb at p = 2, m = 4), the blocks' ``.grad`` stays ``None``; on a
middle stage of zbv the blocks' gradients came out wrong (relative error ~0.9); and one run hung in
FSDP's reduce-scatter. Sharding each stage module as one unit gives the unpipelined gradients
(the test).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch.distributed as dist

from ..schedules.costs import DPReduceModel

__all__ = ["fsdp_reduce_model", "nested_fsdp", "stage_grad_bytes", "uses_fsdp"]


def uses_fsdp(stage: Any) -> bool:
    """Whether ``stage``'s module is FSDP-sharded (PyTorch runs its ``REDUCE_GRAD`` as FSDP's reduce)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(stage.submod, FSDPModule)


def stage_grad_bytes(stages: Sequence[Any], num_stages: int, group: Any = None) -> list[float]:
    """Bytes each stage's ``REDUCE_GRAD`` reduces [bytes]: the gradients of its parameters at full
    (unsharded) size for an FSDP stage, 0 for any other; every stage's value, on every rank (an
    all-gather over the pipeline ``group``)."""
    mine = {st.stage_index: float(sum(q.numel() * q.element_size() for q in st.submod.parameters()
                                      if q.requires_grad)) if uses_fsdp(st) else 0.0 for st in stages}
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    merged = {s: b for g in gathered for s, b in g.items()}
    return [merged.get(s, 0.0) for s in range(num_stages)]


def fsdp_reduce_model(stage_bytes: Sequence[float], reduce_ms: Sequence[float | None]) -> DPReduceModel | None:
    """The FSDP reduce as the cost model's data-parallel reduce (module doc), or ``None`` when no
    stage reduces anything.

    Args:
        stage_bytes: per stage, bytes its ``REDUCE_GRAD`` reduces (:func:`stage_grad_bytes`).
        reduce_ms: per stage, the measured median time of its ``REDUCE_GRAD`` [ms] (``None``: not
            measured). The bandwidth is the FSDP stages' bytes over their summed time [bytes/ms].
    """
    timed = [(b, t) for b, t in zip(stage_bytes, reduce_ms) if b > 0 and t is not None and t > 0]
    if not timed:
        return None
    bandwidth = sum(b for b, _ in timed) / sum(t for _, t in timed)
    return DPReduceModel(stage_bytes=list(stage_bytes), bucket_bytes=None, bandwidth=bandwidth, overlap=True)


def nested_fsdp(stage: Any) -> list[str]:
    """Names of the ``fully_shard``-ed submodules of ``stage``'s module other than the module
    itself (module doc: refused for a split backward)."""
    from torch.distributed.fsdp import FSDPModule

    return [name for name, mod in stage.submod.named_modules() if name and isinstance(mod, FSDPModule)]

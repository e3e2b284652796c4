"""Process groups of a run: ``torch.distributed``, megatron-core's ``parallel_state``, Megatron's seeds."""

from __future__ import annotations

import datetime
import os
import random
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch
import torch.distributed as dist

from megatron_zb.training.run_config import ParallelConfig

__all__ = ["DistributedContext", "LAUNCH_VARIABLES", "context_from_parallel_state", "init_distributed",
           "launch_environment_problem", "local_rank", "shutdown_distributed", "single_process_store"]

LAUNCH_VARIABLES = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")
"""What a launcher (torchrun, or SLURM with them exported) sets for every process: all four, or none."""


def launch_environment_problem(environ: Mapping[str, str]) -> str | None:
    """What is wrong with the launch environment ``environ``, in one line; ``None`` when
    :func:`init_distributed` can start from it: a launcher's (:data:`LAUNCH_VARIABLES` all set), or one
    process -- none of them, ``WORLD_SIZE=1`` / ``RANK=0`` alone, or ``MASTER_ADDR`` and ``MASTER_PORT``.
    Anything else would end in ``torch.distributed``'s ``env://`` error, or make every process rank 0."""
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        if name in environ and not environ[name].strip().isdigit():
            return f"{name}={environ[name]!r} in the environment is not an integer >= 0"
    world, rank = int(environ.get("WORLD_SIZE", "1")), int(environ.get("RANK", "0"))
    if world < 1 or rank >= world:
        return (f"RANK={rank}, WORLD_SIZE={world} in the environment (WORLD_SIZE unset counts 1): a rank must be "
                f"below the number of processes; launch with torchrun, or unset both to run one process")
    if world == 1 and "MASTER_PORT" not in environ:
        return None  # single_process_store: an in-memory store
    needed = ("MASTER_ADDR", "MASTER_PORT") + (("RANK",) if world > 1 else ())
    if all(name in environ for name in needed):
        return None
    present = [name for name in LAUNCH_VARIABLES if name in environ]
    missing = [name for name in LAUNCH_VARIABLES if name not in environ]
    return (f"partial launch environment: {_listed(present, environ)} set but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not (a launcher sets all of {', '.join(LAUNCH_VARIABLES)}): "
            f"launch with torchrun (torchrun --nproc_per_node N pretrain_gpt_zb.py ...), or unset "
            f"{', '.join(present)} to run one process")


def _listed(names: list[str], environ: Mapping[str, str]) -> str:
    values = [f"{name}={environ[name]}" for name in names]
    return values[0] + " is" if len(values) == 1 else ", ".join(values) + " are"


def local_rank() -> int:
    """This process's rank on its node (``LOCAL_RANK``, else ``RANK``, else 0); no process group needed."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))


@dataclass(frozen=True)
class DistributedContext:
    """Where this process sits in the job (after :func:`init_distributed`).

    Attributes:
        pp_group: the pipeline-parallel process group of this rank.
        pp_rank: rank in ``pp_group`` (the pipeline rank).
        tp_rank: tensor-parallel rank.
        dp_rank: data-parallel rank.
        device: ``cuda:<current>`` with nccl, else ``cpu``.
        started_pg: whether :func:`init_distributed` started the default process group (and
            :func:`shutdown_distributed` must destroy it).
    """

    pp_group: Any
    pp_rank: int
    tp_rank: int
    dp_rank: int
    device: torch.device
    started_pg: bool


def init_distributed(parallel: ParallelConfig, *, seed: int) -> DistributedContext:
    """Start ``torch.distributed`` (unless started) and megatron-core's TP/PP groups; seed as Megatron.

    A single process without a launcher gets a local rendezvous (free port on 127.0.0.1). Seeds:
    ``seed + 100 * pipeline rank`` (``seed``: ``--seed``) for Python, NumPy, torch and megatron's RNG tracker
    (tensor-parallel streams are forked by megatron-core).
    """
    from megatron.core import parallel_state, tensor_parallel

    if int(os.environ.get("RANK", "0")) == 0:  # no process group yet
        print(f"> initializing torch distributed with {parallel.world_size} process(es), backend "
              f"{parallel.distributed_backend} ...", flush=True)
    if parallel.distributed_backend == "nccl":
        torch.cuda.set_device(local_rank())
    started = False
    if not dist.is_initialized():
        dist.init_process_group(backend=parallel.distributed_backend, world_size=parallel.world_size,
                                rank=int(os.environ.get("RANK", "0")), store=single_process_store(parallel),
                                timeout=datetime.timedelta(minutes=parallel.distributed_timeout_minutes))
        started = True
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        distributed_timeout_minutes=parallel.distributed_timeout_minutes)
    ctx = context_from_parallel_state(backend=parallel.distributed_backend, started_pg=started)
    seed = seed + 100 * ctx.pp_rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return ctx


def context_from_parallel_state(*, backend: str, started_pg: bool = False) -> DistributedContext:
    """This process's :class:`DistributedContext` from megatron-core's initialised ``parallel_state``
    (``backend``: ``"nccl"`` puts the device on the current CUDA device, anything else on the CPU)."""
    from megatron.core import parallel_state

    return DistributedContext(
        pp_group=parallel_state.get_pipeline_model_parallel_group(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        device=torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu"),
        started_pg=started_pg)


def single_process_store(parallel: ParallelConfig) -> dist.Store | None:
    """An in-memory store for a one-process run started without a launcher (no ``MASTER_PORT``): no port
    to pick, so none another process can take first; ``None`` (``env://`` rendezvous) otherwise."""
    if parallel.world_size != 1 or "MASTER_PORT" in os.environ:
        return None
    return dist.HashStore()


def shutdown_distributed(ctx: DistributedContext | None) -> None:
    """Destroy megatron-core's groups and the default group when :func:`init_distributed` started it."""
    if ctx is not None and ctx.started_pg and dist.is_initialized():
        from megatron.core import parallel_state
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()

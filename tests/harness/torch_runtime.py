"""One rank of the tests of :mod:`megatron_zb.torch_pipelining.runtime` and ``.profiling``.

The float64 :class:`~megatron_zb.testing.torch_pipelining.TinyLM` (no dropout, for the reason given
there) split into ``PipelineStage``s as the family places them, run by PyTorch's own
``_PipelineScheduleRuntime`` built with :func:`~megatron_zb.torch_pipelining.runtime.build_pipeline`.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_zb.testing.torch_pipelining import LMConfig, batch, loss_fn, stage_module

__all__ = ["api_rank", "auto_rank", "fsdp_rank"]


def _stages(cfg: LMConfig, name: str) -> tuple[dict[int, Any], list[Any]]:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from megatron_zb.torch_pipelining.runtime import stages_for_rank

    p, rank = dist.get_world_size(), dist.get_rank()
    mine = stages_for_rank(name, num_ranks=p, rank=rank)
    n = p * len(mine)
    mods = {s: stage_module(cfg, s, n) for s in mine}
    return mods, [PipelineStage(mods[s], s, n, torch.device("cpu")) for s in mine]


def _step(pipe: Any, mods: dict[int, Any], cfg: LMConfig, m: int) -> dict[str, Any]:
    """One zero-grad + step; the losses (last stage's rank) and this rank's gradients."""
    x, y = batch(cfg, m)
    for mod in mods.values():
        mod.zero_grad(set_to_none=True)
    n = pipe.schedule.num_stages
    losses: list[torch.Tensor] = []
    pipe.step(*((x,) if 0 in mods else ()), **({"target": y, "losses": losses} if n - 1 in mods else {}))
    return {"losses": [v.detach() for v in losses],
            "grads": {k: prm.grad.clone() for mod in mods.values() for k, prm in mod.named_parameters()}}


def api_rank(cfg: LMConfig, m: int, names: tuple[str, ...], replan_name: str, auto: bool = False) -> dict[str, Any]:
    """One rank: every family of ``names`` built by ``build_pipeline`` and stepped once; then
    ``replan_name`` profiled (1 warm-up, 2 timed iterations), re-planned and stepped again; then
    the refusals (a DDP-wrapped and a compiled stage module for ``zb-1p``; DDP over a one-rank group);
    with ``auto``, then :func:`auto_rank` (its result under ``"auto"``).

    Returns ``{name: {"losses", "grads"}, "replan": {"medians", "bytes", "t_b", "t_w", "mem_b", "mem_w",
    "before", "after", "loaded", "samples", "step"},
    "refused": {"ddp": message, "compiled": message, "compiled_in_place": message}}``.
    """
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.nn.parallel import DistributedDataParallel

    from megatron_zb.torch_pipelining.export import TorchExportError
    from megatron_zb.torch_pipelining.profiling import profile_and_replan
    from megatron_zb.torch_pipelining.runtime import build_pipeline

    out: dict[str, Any] = {}
    for name in names:
        mods, stages = _stages(cfg, name)
        pipe = build_pipeline(stages, name, num_microbatches=m, loss_fn=loss_fn)
        out[name] = _step(pipe, mods, cfg, m)

    mods, stages = _stages(cfg, replan_name)
    pipe = build_pipeline(stages, replan_name, num_microbatches=m, loss_fn=loss_fn)
    rep = profile_and_replan(pipe, lambda: _step(pipe, mods, cfg, m), iterations=2, warmup=1)
    out["replan"] = {"medians": rep.medians_ms, "bytes": rep.bytes, "dp_reduce": rep.costs.dp_reduce,
                     "t_b": list(rep.costs.t_b),  # type: ignore[arg-type]
                     "t_w": list(rep.costs.t_w), "mem_b": list(rep.costs.mem_b), "mem_w": list(rep.costs.mem_w),  # type: ignore[arg-type]
                     "before": rep.before, "after": rep.after, "loaded": pipe.schedule is rep.after,
                     "samples": rep.samples, "step": _step(pipe, mods, cfg, m)}

    rank, p = dist.get_rank(), dist.get_world_size()
    own = [dist.new_group([r]) for r in range(p)]  # every rank creates every group
    refused: dict[str, str] = {}
    for label in ("ddp", "compiled", "compiled_in_place"):
        mod: Any = stage_module(cfg, rank, p)
        if label == "ddp":
            mod = DistributedDataParallel(mod, process_group=own[rank])
        elif label == "compiled":
            mod = torch.compile(mod)  # compiles lazily, on the first call: nothing runs here
        else:
            mod.compile()
        try:
            build_pipeline([PipelineStage(mod, rank, p, torch.device("cpu"))], "zb-1p", num_microbatches=m,
                           loss_fn=loss_fn)
        except TorchExportError as e:
            refused[label] = str(e)
    out["refused"] = refused
    if auto:
        out["auto"] = auto_rank(cfg, m)
    return out


def fsdp_rank(cfg: LMConfig, m: int, names: tuple[str, ...], replan_name: str) -> dict[str, Any]:
    """One rank of a 2 x 2 mesh (data-parallel x pipeline, 4 processes): every stage module
    ``fully_shard``-ed as one unit over its data-parallel pair, each data-parallel replica stepping its own
    batch (:func:`~.torch_pipelining.batch`'s ``replica``); every family of ``names`` built by
    ``build_pipeline`` and stepped once, then ``replan_name`` profiled and re-planned; then stages
    whose blocks are sharded one by one (on pipeline rank 1 only) given to ``build_pipeline`` for
    ``zb-1p`` (refused: :mod:`megatron_zb.torch_pipelining.fsdp`).

    Returns ``{"dp": replica, name: {"losses", "grads"} (gradients at full size, gathered over the
    data-parallel pair), "no_dp_group": the refusal of a re-plan without the data-parallel group,
    "replan": {"medians", "dp_reduce", "stage_params", "loaded", "after", "step"},
    "refused": message or None}``; ``stage_params``: this rank's stages' parameter counts, counted
    on the unsharded modules.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage

    from megatron_zb.torch_pipelining.export import TorchExportError
    from megatron_zb.torch_pipelining.profiling import profile_and_replan
    from megatron_zb.torch_pipelining.runtime import build_pipeline, stages_for_rank

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    dp, pp = mesh["dp"].get_local_rank(), mesh["pp"].get_local_rank()
    x, y = batch(cfg, m, replica=dp)

    def sharded(name: str, *, per_block: bool = False) -> tuple[dict[int, Any], list[Any], dict[int, int]]:
        mine = stages_for_rank(name, num_ranks=2, rank=pp)
        n = 2 * len(mine)
        mods = {s: stage_module(cfg, s, n) for s in mine}
        counts = {s: sum(q.numel() for q in mod.parameters()) for s, mod in mods.items()}
        for s, mod in mods.items():
            for block in mod.blocks.values() if per_block else ():
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(mod, mesh=mesh["dp"])
        return mods, [PipelineStage(mods[s], s, n, torch.device("cpu"), group=mesh["pp"].get_group())
                      for s in mine], counts

    def build(name: str) -> tuple[dict[int, Any], Any, dict[int, int]]:
        mods, stages, counts = sharded(name)
        return mods, build_pipeline(stages, name, num_microbatches=m, loss_fn=loss_fn), counts

    def step(pipe: Any, mods: dict[int, Any]) -> dict[str, Any]:
        for mod in mods.values():
            mod.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        last = pipe.schedule.num_stages - 1
        pipe.step(*((x,) if 0 in mods else ()), **({"target": y, "losses": losses} if last in mods else {}))
        return {"losses": [v.detach() for v in losses],
                "grads": {k: q.grad.full_tensor() for mod in mods.values() for k, q in mod.named_parameters()}}

    out: dict[str, Any] = {"dp": dp}
    for name in names:
        mods, pipe, _ = build(name)
        out[name] = step(pipe, mods)
    mods, pipe, counts = build(replan_name)
    try:
        profile_and_replan(pipe, lambda: step(pipe, mods), iterations=1, warmup=0)
    except TorchExportError as e:
        out["no_dp_group"] = str(e)
    rep = profile_and_replan(pipe, lambda: step(pipe, mods), iterations=2, warmup=1, memory=False,
                             data_parallel_group=mesh["dp"].get_group())
    out["replan"] = {"medians": rep.medians_ms, "dp_reduce": rep.costs.dp_reduce, "stage_params": counts,
                     "loaded": pipe.schedule is rep.after, "after": rep.after, "step": step(pipe, mods)}
    out["refused"] = None
    _, stages, _ = sharded("zb-1p", per_block=pp == 1)
    try:
        build_pipeline(stages, "zb-1p", num_microbatches=m, loss_fn=loss_fn)
    except TorchExportError as e:
        out["refused"] = str(e)
    dist.barrier()
    return out


def auto_rank(cfg: LMConfig, m: int) -> dict[str, Any]:
    """One rank: ``build_pipeline(..., "auto")`` on stages built for the V placement, stepped once;
    then profiled (no warm-up, 1 timed iteration per form, memory off), re-chosen and stepped again.

    Returns ``{"first": {"losses", "grads"}, "chosen": (before, after) family names, "candidates":
    pipe.candidates after, "medians": the measured medians, "t_bw", "t_f": the measured costs' (the
    action overhead included), "overhead": the measured overhead per action [ms], "step_ms": per form
    the slowest rank's median iteration [ms], "samples", "step": {"losses", "grads"} after re-planning}``.
    """
    from megatron_zb.torch_pipelining.profiling import profile_and_replan
    from megatron_zb.torch_pipelining.runtime import build_pipeline

    mods, stages = _stages(cfg, "zbv")   # the V placement's stages
    pipe = build_pipeline(stages, "auto", num_microbatches=m, loss_fn=loss_fn)
    out: dict[str, Any] = {"first": _step(pipe, mods, cfg, m)}
    rep = profile_and_replan(pipe, lambda: _step(pipe, mods, cfg, m), iterations=1, warmup=0, memory=False)
    out.update(chosen=(rep.before.name, rep.after.name), candidates=pipe.candidates, medians=rep.medians_ms,
               t_bw=rep.costs.t_bw, t_f=rep.costs.t_f, overhead=rep.action_overhead_ms, step_ms=rep.step_ms,
               samples=rep.samples, step=_step(pipe, mods, cfg, m))
    return out

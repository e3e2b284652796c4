"""Training iterations of the tiny GPT under megatron-core DDP with data-parallel overlap (tests).

:func:`run_dp_iterations` runs inside a rank of :func:`megatron_zb.testing.run_distributed`: it
builds the rank's chunks for the schedule's placement, wraps them with the product's own wiring
(:func:`megatron_zb.training.wiring.wrap_chunks`: megatron-core ``DistributedDataParallel`` with
the :class:`DPCase` configuration, ``disable_bucketing`` for every chunk after the first,
``no_sync_func`` per chunk, ``grad_sync_func`` = ``start_grad_sync`` as with Megatron's default
``--align-grad-reduce``), and runs ``iterations`` training iterations with megatron-core's Adam
(:func:`~megatron_zb.training.wiring.megatron_optimizer`, optionally post-validated) -- with megatron-core's own 1F1B when ``schedule is None``. Every iteration
reads new micro batches. It returns per iteration the losses, the data-parallel launch report
of megatron-zb's runtime, and at the end every parameter's ``main_grad`` of the last iteration
(before the step) and every parameter after the last step (all-gathered first when the
parameter all-gather is overlapped).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from megatron_zb.testing.tiny_gpt import (TinyGPT, build_chunks, forward_backward, full_tensor, measured_forward_backward,
                                       placement_for, random_microbatches)


@dataclass(frozen=True)
class DPCase:
    """DDP configuration of a run (megatron-core's ``DistributedDataParallelConfig`` meanings).

    Attributes:
        overlap_grad_reduce, overlap_param_gather, use_distributed_optimizer,
        average_in_collective: as the Megatron flags of the same names.
        bucket_size: DDP bucket size in elements (``--ddp-bucket-size``); small values give
            several buckets on the first pipeline stage.
        post_validation: wrap the optimizer in ``PostValidationOptimizer(exact=True,
            warmup_iters=0)``.
        iterations: training iterations.
    """

    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = False
    use_distributed_optimizer: bool = False
    average_in_collective: bool = False
    bucket_size: int | None = 4000
    post_validation: bool = False
    iterations: int = 3


def _parallel(case: DPCase) -> Any:
    """The case as the product's :class:`~megatron_zb.training.run_config.ParallelConfig`."""
    from megatron_zb.training.run_config import ParallelConfig

    return ParallelConfig(overlap_grad_reduce=case.overlap_grad_reduce, overlap_param_gather=case.overlap_param_gather,
                          use_distributed_optimizer=case.use_distributed_optimizer, ddp_bucket_size=case.bucket_size,
                          ddp_average_in_collective=case.average_in_collective)


def _optimizer(modules: list[Any], case: DPCase) -> Any:
    """The product's optimizer wiring: megatron-core's Adam (lr 0.01, clipping at 1.0), optionally
    post-validated (exact rollback, no warm-up, no fallback)."""
    from megatron_zb.training.run_config import OptimConfig, PostValidationConfig, PrecisionConfig
    from megatron_zb.training.wiring import megatron_optimizer, wrap_post_validation

    inner = megatron_optimizer(OptimConfig(lr=0.01), precision=PrecisionConfig(), parallel=_parallel(case),
                               modules=modules)
    if not case.post_validation:
        return inner
    return wrap_post_validation(PostValidationConfig(exact=True, warmup_iters=0, clean_iters_required=0), inner,
                                announce=False)


def run_dp_iterations(cfg: TinyGPT, case: DPCase, *, schedule: str | None, **options: Any) -> dict[str, Any]:
    """Run ``case.iterations`` iterations on this rank (see the module docstring)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_zb.model import named_global_parameters
    from megatron_zb.runtime import Measure, get_forward_backward_func
    from megatron_zb.training.run_config import PrecisionConfig
    from megatron_zb.training.wiring import wrap_chunks
    from megatron_zb.testing.distributed import device_from_env, init_parallel_state

    init_parallel_state(pipeline_model_parallel_size=cfg.pp, seed=cfg.seed)
    chunks = build_chunks(replace(cfg, ddp=True), placement_for(schedule, cfg.pp))
    modules = wrap_chunks([c.module for c in chunks],
                          first_last=[(c.plan.pre_process, c.plan.post_process) for c in chunks],
                          parallel=_parallel(case), precision=PrecisionConfig(), device=device_from_env())
    opt = _optimizer(modules, case)
    if schedule is None:
        from megatron.core.pipeline_parallel import get_forward_backward_func as megatron_func
        fb = megatron_func()
    else:
        fb = get_forward_backward_func(schedule, **options)
    dp_rank = parallel_state.get_data_parallel_rank()
    out: dict[str, Any] = {"losses": [], "reports": [], "grads": {}, "params": {},
                           "pp_rank": parallel_state.get_pipeline_model_parallel_rank(), "dp_rank": dp_rank}
    for it in range(case.iterations):
        if case.post_validation:
            opt.begin_iteration()
        for m in modules:
            m.zero_grad_buffer()
        opt.zero_grad()
        data = random_microbatches(cfg.num_microbatches, vocab=cfg.vocab, micro_batch=cfg.micro_batch, seq=cfg.seq,
                                   seed=7 + 1000 * dp_rank + 31 * it)
        if schedule is None:
            losses, report = forward_backward(fb, modules, data, seq=cfg.seq, micro_batch=cfg.micro_batch), None
        else:
            measured = measured_forward_backward(fb, modules, data, seq=cfg.seq, micro_batch=cfg.micro_batch,
                                                 measure=Measure())
            losses, report = measured.data, measured.grad_sync
        out["losses"].append([d["lm loss"] for d in losses])
        out["reports"].append(report)
        if it == case.iterations - 1:
            out["grads"] = {n: full_tensor(p.main_grad, p) for c in chunks for n, p in named_global_parameters(c)}
        opt.step()
    if case.post_validation:
        opt.finalize()
    if case.overlap_param_gather:
        for m in modules:
            m.start_param_sync(force_sync=True)
    out["params"] = {n: full_tensor(p, p) for c in chunks for n, p in named_global_parameters(c)}
    dist.barrier()
    return out


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per DP rank: losses (from the last pipeline stage), grads and params of every stage, reports."""
    merged: dict[int, dict[str, Any]] = {}
    for r in results:
        d = merged.setdefault(r["dp_rank"], {"losses": [], "grads": {}, "params": {}, "reports": {}})
        if any(r["losses"]):
            d["losses"] = r["losses"]
        d["grads"].update(r["grads"])
        d["params"].update(r["params"])
        d["reports"][r["pp_rank"]] = r["reports"]
    return merged


def assert_equal_runs(ref: dict[int, dict[str, Any]], got: dict[int, dict[str, Any]], *, what: str,
                      bitwise: bool, grads: bool = True) -> None:
    """Losses, last-iteration ``main_grad`` (when ``grads``) and final params, per DP rank."""
    def same(a: torch.Tensor, b: torch.Tensor, msg: str) -> None:
        if bitwise:
            assert torch.equal(a, b), msg
        else:  # another placement sums in another order; Adam magnifies that for near-zero gradients
            scale = float(b.abs().max()) if b.numel() else 0.0
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3 * scale, msg=lambda m: f"{msg}: {m}")

    for dp, r in ref.items():
        g = got[dp]
        assert len(g["losses"]) == len(r["losses"]) > 0
        for i, (a, b) in enumerate(zip(g["losses"], r["losses"])):
            assert len(a) == len(b) > 0
            for x, y in zip(a, b):
                same(x, y, f"{what}: DP rank {dp} iteration {i} loss")
        keys = ("grads", "params") if grads else ("params",)
        for key in keys:
            assert g[key].keys() == r[key].keys() and r[key], f"{what}: {key} names differ"
            for n, t in r[key].items():
                same(g[key][n], t, f"{what}: DP rank {dp} {key[:-1]} {n}")

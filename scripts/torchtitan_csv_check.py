#!/usr/bin/env python
"""torchtitan's own schedule builder loading megatron-zb's CSV: one step compared with the unpipelined model.

Usage (needs torchtitan installed beside torch 2.13; not a test dependency, so not in the suite):
    pip install torchtitan==0.3.0 && python scripts/torchtitan_csv_check.py

On 2 gloo processes (CPU): megatron-zb writes ``zb-1p`` and ``zbv`` at p=2, m=4 as the compute-only
CSV (``write_torch_csv``); torchtitan's ``distributed.pipeline_parallel._build_pipeline_schedule``
-- what its trainer calls for ``[parallelism] pipeline_parallel_schedule_csv`` -- builds the
runtime from it for the float64 test model's ``PipelineStage``s (``testing/torch_pipelining.py``)
and steps once. Printed: the runtime class, and the worst relative difference of the losses and of
the gradients (torchtitan passes ``scale_grads=False``: divided by m here) against the unpipelined
model. torchtitan's trainer itself is not run (docs/torch_pipelining.md says why).
"""
import sys
import tempfile
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_zb.testing.distributed import run_distributed  # noqa: E402

def rank_fn(name: str, csv_dir: str, m: int) -> dict:
    """One rank: the CSV written (rank 0), torchtitan's builder, one step; losses and gradients."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed.pipeline_parallel import _build_pipeline_schedule
    from megatron_zb.schedules.registry import build_schedule
    from megatron_zb.torch_pipelining.export import write_torch_csv
    from megatron_zb.torch_pipelining.runtime import runtime_costs, stages_for_rank
    from megatron_zb.schedules.costs import CostModel
    from megatron_zb.testing.torch_pipelining import LMConfig, batch, loss_fn, stage_module
    cfg = LMConfig()
    rank, p = dist.get_rank(), dist.get_world_size()
    mine = stages_for_rank(name, num_ranks=p, rank=rank)
    n = p * len(mine)
    sched = build_schedule(name, num_ranks=p, num_microbatches=m, costs=runtime_costs(CostModel(), n))
    path = f"{csv_dir}/{name}.csv"
    if rank == 0:
        write_torch_csv(sched, path)
    dist.barrier()
    mods = {s: stage_module(cfg, s, n) for s in mine}
    stages = [PipelineStage(mods[s], s, n, torch.device("cpu")) for s in mine]
    placement = "ZBVZeroBubble" if name in ("zbv", "v-half") else "Interleaved1F1B" if len(mine) > 1 else "1F1B"
    par = ParallelismConfig(pipeline_parallel_degree=p, pipeline_parallel_schedule=placement,
                            pipeline_parallel_schedule_csv=path, pipeline_parallel_microbatch_size=cfg.mbs)
    runner = _build_pipeline_schedule(parallelism=par, local_batch_size=m * cfg.mbs, stages=stages,
                                      loss_fn=lambda out, tgt: (loss_fn(out, tgt), None))
    x, y = batch(cfg, m)
    losses = []
    runner.step(*((x,) if 0 in mods else ()), **({"target": y, "losses": losses} if n - 1 in mods else {}))
    return {"type": type(runner).__name__, "losses": [v.detach() for v in losses],
            "grads": {k: q.grad.clone() for mod in mods.values() for k, q in mod.named_parameters()}}

if __name__ == "__main__":
    from megatron_zb.testing.torch_pipelining import LMConfig, reference
    m = 4
    ref_losses, ref_grads = reference(LMConfig(), m)
    for name in ("zb-1p", "zbv"):
        with tempfile.TemporaryDirectory() as d:
            res = run_distributed(partial(rank_fn, name, d, m), world_size=2, timeout=300)
        grads = {k: g for r in res for k, g in r["grads"].items()}
        losses = [v for r in res for v in r["losses"]]
        # torchtitan passes scale_grads=False: gradients are the sum over micro batches
        worst = max(((g / m - ref_grads[k]).norm() / ref_grads[k].norm()).item() for k, g in grads.items())
        lw = max(abs((a - b) / b).item() for a, b in zip(losses, ref_losses))
        print(f"{name}: {res[0]['type']}, gradients of {len(grads)} of {len(ref_grads)} parameters, worst relative "
              f"difference {worst:.2e}; losses {lw:.2e}")

"""``pretrain_gpt_zb.py``'s Trainer run in-process on ``run_distributed`` ranks (tests).

Test code, not the product's run path. :func:`in_process` runs the product's own parse, validation
and :class:`~megatron_zb.training.trainer.Trainer` on every rank of
:func:`megatron_zb.testing.run_distributed` (its forkserver has torch and megatron-core imported:
no process start-up per run) with ``--loss-log-json``, and returns rank 0's view: the logged values,
every rank's stdout, the installed schedule, the costs the run re-planned from and the vocabulary slices'
dtypes (:func:`vocab_dtypes`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["RUN_TIMEOUT", "in_process", "in_process_many", "sharded_grads", "trainer_rank", "trainer_runs",
           "vocab_dtypes"]

RUN_TIMEOUT = 240.0
"""Seconds per run (2 shared cores; a PP=4 run takes ~30 s)."""


def trainer_rank(argv: list[str], json_path: str) -> dict[str, Any]:
    """One rank of the trainer on ``argv`` (+ ``--loss-log-json json_path``): this rank's log, the
    installed schedule and the costs the run re-planned from."""
    import contextlib
    import io

    import torch.distributed as dist

    from megatron_zb.training.pretrain import parse_and_validate
    from megatron_zb.training.trainer import Trainer

    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        trainer = Trainer(parse_and_validate(argv + ["--loss-log-json", json_path], dist.get_world_size()))
        try:
            assert trainer.run() == 0
            config, planner = trainer.config, trainer.planner
            installed = None
            if planner.runtime is not None:
                installed = planner.runtime.schedule_for(config.parallel.pipeline_model_parallel_size,
                                                         config.num_microbatches)
            out = {"costs": trainer.state.schedule_costs, "installed": installed,
                   "memory_limit": config.schedule.memory_limit, "m": config.num_microbatches,
                   "vocab_dtypes": vocab_dtypes(trainer), **sharded_grads(trainer)}
        finally:
            trainer.close()
    out["log"] = log.getvalue()
    return out


def sharded_grads(trainer: Any) -> dict[str, Any]:
    """``model_state``: this rank's model-state bytes measured from storages (``ModelStateBytes`` as a dict);
    ``final_params``: its chunks' parameters after the run (``"chunk.name"`` -> a copy);
    with sharded gradients ``reduces``: per chunk, the last iteration's reduce-scatters ``(bucket, elements)``
    ``buckets``: per chunk, each bucket's elements, and ``bucket_weights``: the weights in it whose gradient W
    adds."""
    import dataclasses

    from megatron_zb.runtime.sharded_grads import sharded_chunks
    from megatron_zb.training.model_state import model_state_bytes

    out: dict[str, Any] = {"model_state": dataclasses.asdict(model_state_bytes(trainer.model.modules,
                                                                               trainer.optim.inner)),
                           "final_params": {f"{i}.{n}": p.detach().clone() for i, c in enumerate(trainer.model.modules)
                                            for n, p in c.named_parameters()}}
    found = sharded_chunks(trainer.model.modules)
    if found is not None:
        sharded = list(found.values())
        out["reduces"] = [list(s.reduce_log) for s in sharded]
        out["buckets"] = [[b.numel for b in s.buckets] for s in sharded]
        out["bucket_weights"] = [[len(b.deferred) for b in s.buckets] for s in sharded]  # weights W adds into
    return out


def vocab_dtypes(trainer: Any) -> dict[str, list[str]] | None:
    """With ``--enable-vocab-parallel``: the dtypes of the vocabulary slices' parameters, of their
    ``main_grad`` buffers (and of the chunks' parameters') and of the optimizer's main (master) copies of them (the
    parameter itself where the optimizer keeps no copy), each a sorted list of names (``"torch.bfloat16"``);
    ``None`` without."""
    slices = trainer.model.vocab_slices
    if slices is None:
        return None
    params = list(slices.parameters())
    main: dict[int, Any] = {id(p): p for p in params}
    inner = trainer.optim.inner
    for opt in getattr(inner, "chained_optimizers", [inner]):
        for model_group, main_group in zip(getattr(opt, "float16_groups", []),
                                           getattr(opt, "fp32_from_float16_groups", [])):
            main.update({id(p): m for p, m in zip(model_group, main_group) if id(p) in main})
    return {"params": sorted({str(p.dtype) for p in params}),
            "main_grad": sorted({str(p.main_grad.dtype) for p in params}),
            "chunks_main_grad": sorted({str(p.main_grad.dtype) for m in trainer.model.modules for p in m.parameters()}),
            "main_params": sorted({str(main[id(p)].dtype) for p in params})}


def in_process(tmp_path: Path, name: str, world: int, argv: list[str], *,
               timeout: float = RUN_TIMEOUT) -> dict[str, Any]:
    """The trainer on ``argv`` in ``world`` ranks, writing ``tmp_path/name/values.json``. Rank 0's
    results; ``log`` is every rank's stdout in rank order (as torchrun's log has them all);
    ``values`` the ``--loss-log-json`` file."""
    from megatron_zb.testing import run_distributed

    d = tmp_path / name
    d.mkdir(parents=True, exist_ok=True)
    ranks = run_distributed(trainer_rank, world_size=world, args=(argv, str(d / "values.json")), timeout=timeout)
    out = dict(ranks[0])
    out["log"] = "".join(r["log"] for r in ranks)
    # Read here, every rank done: the last rank rewrites the file as it goes, so a rank that
    # finished first could read an older version.
    out["values"] = json.loads((d / "values.json").read_text())
    return out


def trainer_runs(runs: list[tuple[list[str], str]]) -> list[dict[str, Any]]:
    """Several trainer runs on this rank, one after another in the same process group: :func:`trainer_rank`
    of each ``(argv, json_path)``, megatron-core's model-parallel groups destroyed after each (the next run
    creates its own, as a fresh process would)."""
    from megatron.core import parallel_state

    out = []
    for argv, json_path in runs:
        try:
            out.append(trainer_rank(argv, json_path))
        finally:
            parallel_state.destroy_model_parallel()
    return out


def in_process_many(tmp_path: Path, runs: dict[str, list[str]], world: int, *,
                    timeout: float = RUN_TIMEOUT) -> dict[str, dict[str, Any]]:
    """:func:`in_process` of every ``name -> argv`` of ``runs``, in order, in one launch of ``world`` ranks
    (one process start-up for all; ``timeout``: seconds for all of them)."""
    from megatron_zb.testing import run_distributed

    paths = {}
    for name in runs:
        (tmp_path / name).mkdir(parents=True, exist_ok=True)
        paths[name] = str(tmp_path / name / "values.json")
    ranks = run_distributed(trainer_runs, world_size=world, args=([(argv, paths[n]) for n, argv in runs.items()],),
                            timeout=timeout)
    out = {}
    for i, name in enumerate(runs):
        out[name] = dict(ranks[0][i])
        out[name]["log"] = "".join(r[i]["log"] for r in ranks)
        out[name]["model_states"] = [r[i]["model_state"] for r in ranks]  # every rank's, rank order
        out[name]["final_params"] = [r[i]["final_params"] for r in ranks]
        out[name]["values"] = json.loads(Path(paths[name]).read_text())
    return out

"""A small float64 language model run by PyTorch's own pipeline runtime (tests of the export).

:class:`TinyLM` is a whole model (embedding, ``nn.TransformerEncoderLayer`` blocks, final norm,
output layer), built the same in every process from a seed; :func:`stage_module` cuts the part of
one pipeline stage out of a copy, keeping the whole model's parameter names, so gradients compare
by name. :func:`reference` is the unpipelined step; :func:`run_rank` (one rank of a
:func:`~megatron_zb.testing.distributed.run_distributed` call) runs PyTorch's ``Schedule1F1B``
and megatron-zb schedules through ``torch.distributed.pipelining`` and returns losses and gradients.

Dropout is 0: the pipeline and the reference draw their dropout masks in different orders (the
pipeline runs microbatches stage by stage), so with dropout on the two computations would differ.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["LMConfig", "TinyLM", "batch", "reference", "run_rank", "stage_module"]


@dataclass(frozen=True)
class LMConfig:
    """Model and batch shape (microbatch size ``mbs`` samples of ``seq`` tokens)."""

    vocab: int = 32
    hidden: int = 16
    heads: int = 2
    ffn: int = 32
    layers: int = 4
    seq: int = 8
    mbs: int = 2
    seed: int = 1234
    dtype: str = "float64"  # a torch dtype's name (the benchmark of bench/torch_pipelining.py uses float32)


class TinyLM(nn.Module):
    """Embedding -> ``layers`` encoder blocks -> LayerNorm -> output layer, ``cfg.dtype``, no dropout."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        torch.manual_seed(cfg.seed)
        kw = dict(dtype=getattr(torch, cfg.dtype))
        self.emb = nn.Embedding(cfg.vocab, cfg.hidden, **kw)
        self.blocks = nn.ModuleDict({str(i): nn.TransformerEncoderLayer(
            cfg.hidden, cfg.heads, cfg.ffn, dropout=0.0, batch_first=True, **kw) for i in range(cfg.layers)})
        self.norm = nn.LayerNorm(cfg.hidden, **kw)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.emb is not None:
            x = self.emb(x)
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


def stage_module(cfg: LMConfig, stage: int, num_stages: int) -> TinyLM:
    """Stage ``stage`` of ``num_stages``: a :class:`TinyLM` holding only its blocks (the first stage
    also the embedding, the last the norm and output layer), the whole model's names and values."""
    if cfg.layers % num_stages:
        raise ValueError(f"{cfg.layers} layers do not split into {num_stages} equal stages")
    per = cfg.layers // num_stages
    mod = TinyLM(cfg)
    keep = {str(i) for i in range(stage * per, (stage + 1) * per)}
    for name in [n for n in mod.blocks if n not in keep]:
        del mod.blocks[name]
    if stage != 0:
        mod.emb = None
    if stage != num_stages - 1:
        mod.norm = mod.head = None
    return mod


def batch(cfg: LMConfig, num_microbatches: int, replica: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and targets, ``(num_microbatches * mbs, seq)`` each, from the seed (``replica``: a
    data-parallel rank's own batch; 0 is the batch of the tests without data parallelism)."""
    g = torch.Generator().manual_seed(cfg.seed + 1 + 7919 * replica)
    shape = (num_microbatches * cfg.mbs, cfg.seq)
    return torch.randint(cfg.vocab, shape, generator=g), torch.randint(cfg.vocab, shape, generator=g)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of one microbatch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def reference(cfg: LMConfig, num_microbatches: int,
              replica: int = 0) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Unpipelined: per-microbatch losses, and gradients of their mean (each microbatch's backward
    accumulated in order, then divided by the number of microbatches, as ``scale_grads`` does), on
    :func:`batch`'s ``replica``."""
    model = TinyLM(cfg)
    x, y = batch(cfg, num_microbatches, replica)
    losses = []
    for xs, ys in zip(x.chunk(num_microbatches), y.chunk(num_microbatches)):
        loss = loss_fn(model(xs), ys)
        loss.backward()
        losses.append(loss.detach())
    return losses, {n: p.grad / num_microbatches for n, p in model.named_parameters()}


def run_rank(cfg: LMConfig, runs: list[tuple[str, object, str]], num_microbatches: int) -> dict[str, dict]:
    """One rank: each run is ``(label, what, via)``: ``what`` is a megatron-zb
    :class:`~megatron_zb.schedules.ir.Schedule` loaded into ``_PipelineScheduleRuntime`` from its CSV
    file (``via="csv"``, as torchtitan does) or with
    :func:`~megatron_zb.torch_pipelining.export.prepare_runtime` (``via="actions"``), or the name of
    a PyTorch single-stage schedule class run as PyTorch builds it (``via="torch"``, e.g.
    ``"Schedule1F1B"``).

    Returns ``{label: {"losses": [...] (ranks with the last stage), "grads": {name: tensor},
    "kinds": [...]}}``; ``kinds`` are the action kinds the runtime ran on this rank (PyTorch's
    letters; empty for a PyTorch class, which runs its own loop). Label ``"refused"`` holds the
    message with which :func:`prepare_runtime` refuses this rank's stages placed 'loop'-wise for
    the first run whose schedule places them otherwise.
    """
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as ts

    from megatron_zb.torch_pipelining.export import TorchExportError, prepare_runtime, write_torch_csv

    rank, p = dist.get_rank(), dist.get_world_size()
    cpu = torch.device("cpu")
    x, y = batch(cfg, num_microbatches)
    out: dict[str, dict] = {}
    for label, what, via in runs:
        n = p if via == "torch" else what.num_stages  # type: ignore[union-attr]
        mine = [rank] if via == "torch" else what.stages_of(rank)  # type: ignore[union-attr]
        mods = {s: stage_module(cfg, s, n) for s in mine}
        stages = [PipelineStage(mods[s], s, n, cpu) for s in mine]
        if via == "torch":
            sched = getattr(ts, str(what))(stages[0], num_microbatches, loss_fn=loss_fn)
        else:
            sched = ts._PipelineScheduleRuntime(stages, num_microbatches, loss_fn=loss_fn)
            if via == "csv":
                with tempfile.TemporaryDirectory() as d:
                    path = Path(d) / f"{label}.csv"
                    write_torch_csv(what, path)  # type: ignore[arg-type]
                    sched._load_csv(str(path), format="compute_only")
            else:
                prepare_runtime(sched, what)  # type: ignore[arg-type]
        losses: list[torch.Tensor] = []
        sched.step(*((x,) if 0 in mine else ()), **({"target": y, "losses": losses} if n - 1 in mine else {}))
        ran = getattr(sched, "pipeline_order_with_comms", {}).get(rank, [])
        out[label] = {"losses": [loss.detach() for loss in losses],
                      "grads": {name: prm.grad.clone() for s in mine for name, prm in mods[s].named_parameters()},
                      "kinds": sorted({a.computation_type.value for a in ran})}
    other = next((w for _, w, via in runs if via != "torch" and w.stages_of(rank) != list(  # type: ignore[union-attr]
        range(rank, w.num_stages, p))), None)  # type: ignore[union-attr]
    if other is not None:
        n = other.num_stages  # type: ignore[union-attr]
        loop = [PipelineStage(stage_module(cfg, s, n), s, n, cpu) for s in range(rank, n, p)]
        try:
            prepare_runtime(ts._PipelineScheduleRuntime(loop, num_microbatches, loss_fn=loss_fn), other)  # type: ignore[arg-type]
        except TorchExportError as e:
            out["refused"] = {"message": str(e)}
    return out

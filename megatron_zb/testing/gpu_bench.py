"""A short real benchmark for a GPU node: megatron-core's 1F1B against zb, zb-2p and zbv.

``python -m megatron_zb.testing.gpu_bench --pp N`` runs N processes (PP = N, one GPU each with
``MEGATRON_ZB_TEST_DEVICE=cuda``, NCCL), builds a GPT sized for the GPUs (four layers per GPU;
hidden size and sequence length from the smallest GPU's memory, see :func:`model_for`) with
megatron-core's local layer spec, and times ``--iters`` iterations of each variant after
``--warmup`` (``torch.cuda.synchronize`` and a barrier around each). Prints one table: median
milliseconds per iteration, tokens per second, speed-up over megatron-core's 1F1B, and the
largest peak of CUDA memory over the ranks. ``scripts/gpu_selftest.sh`` runs it.

Cost-aware schedules (zb, zb-2p, zbv) are built with unit costs (``T_F = T_B = T_W``), not
re-planned from measured times, to keep the benchmark short. (``pretrain_gpt_zb.py`` re-plans: on
CUDA its profiling window times every action with CUDA events and synchronises once, at the
window's end -- :mod:`megatron_zb.runtime.action_timing`; that path is verified on CPU with a
mocked event only.) On CPU (the default device) the same code runs with tiny sizes
(``--hidden 32 ...``) for testing.
Nothing is downloaded: the data are random tokens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from ..schedules.ir import V_CHUNKS_PER_RANK

VARIANTS = ("megatron-1f1b", "zb", "zb-2p", "zbv")
"""What is timed: megatron-core's own 1F1B, then megatron-zb's schedules."""

__all__ = ["BenchModel", "VARIANTS", "bench_rank", "main", "model_for"]


@dataclass(frozen=True)
class BenchModel:
    """The benchmark's GPT (sizes in elements; fp32) and run lengths (iterations, microbatches)."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    micro_batch: int
    microbatches: int
    warmup: int
    iters: int

    def describe(self) -> str:
        return (f"GPT {self.layers} layers, hidden {self.hidden}, {self.heads} heads, seq {self.seq}, vocab "
                f"{self.vocab}, micro batch {self.micro_batch}, {self.microbatches} microbatches per iteration, "
                f"fp32; {self.warmup} warm-up + {self.iters} timed iterations per variant")


def model_for(*, pp: int, gpu_memory_gib: float | None) -> dict[str, int]:
    """Default sizes for ``pp`` GPUs of ``gpu_memory_gib`` each (``None``: CPU, tiny sizes).

    Four layers per GPU (zbv places two stages per GPU); hidden 2048 and sequence 1024 from
    40 GiB per GPU, else hidden 1024 and sequence 1024 -- zb-2p keeps up to 2p microbatches
    of activations (about 1.2 GiB per microbatch and GPU at hidden 2048).
    """
    if gpu_memory_gib is None:
        return dict(layers=2 * pp, hidden=32, heads=4, seq=16, vocab=64, micro_batch=1, microbatches=2 * pp)
    big = gpu_memory_gib >= 40
    return dict(layers=4 * pp, hidden=2048 if big else 1024, heads=16, seq=1024, vocab=32768, micro_batch=1,
                microbatches=4 * pp)


def _sync(device: Any) -> None:
    import torch
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def bench_rank(model: dict[str, Any]) -> dict[str, Any]:
    """One rank of the benchmark (inside :func:`~megatron_zb.testing.run_distributed`): per
    variant, the iteration times in seconds and this rank's peak CUDA memory in bytes."""
    import torch
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import get_forward_backward_func as megatron_fb

    from ..runtime import get_forward_backward_func, uninstall_routes
    from .distributed import device_from_env, init_parallel_state
    from .tiny_gpt import TinyGPT, build_chunks, forward_backward, placement_for, random_microbatches

    spec = BenchModel(**model)
    pp = dist.get_world_size()
    cfg = TinyGPT(pp=pp, num_layers=spec.layers, hidden=spec.hidden, heads=spec.heads, seq=spec.seq,
                  vocab=spec.vocab, micro_batch=spec.micro_batch, num_microbatches=spec.microbatches)
    init_parallel_state(pipeline_model_parallel_size=pp, seed=cfg.seed)
    device = device_from_env()
    data = random_microbatches(spec.microbatches, vocab=spec.vocab, micro_batch=spec.micro_batch, seq=spec.seq,
                               seed=7)
    out: dict[str, Any] = {}
    for variant in VARIANTS:
        ours = variant != "megatron-1f1b"
        chunks = build_chunks(cfg, placement_for(variant if ours else None, pp))
        mods = [c.module for c in chunks]
        if not ours:
            uninstall_routes()  # megatron-core exactly as shipped (megatron-zb's call installs them again)
        fb = get_forward_backward_func(variant) if ours else megatron_fb()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for it in range(spec.warmup + spec.iters):
            for m in mods:
                m.zero_grad(set_to_none=True)
            _sync(device)
            t0 = time.perf_counter()
            forward_backward(fb, mods, data, seq=spec.seq, micro_batch=spec.micro_batch)
            _sync(device)
            if it >= spec.warmup:
                times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        out[variant] = dict(times=times, peak_bytes=int(peak))
        del chunks, mods, fb
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def table(spec: BenchModel, pp: int, ranks: list[dict[str, Any]]) -> str:
    """The result table (one row per variant; the slowest rank's time counts per iteration)."""
    tokens = spec.microbatches * spec.micro_batch * spec.seq
    rows = []
    base = None
    for v in VARIANTS:
        per_iter = [max(r[v]["times"][i] for r in ranks) for i in range(spec.iters)]
        ms = 1e3 * statistics.median(per_iter)
        base = ms if base is None else base
        peak = max(r[v]["peak_bytes"] for r in ranks) / 2**30
        rows.append(f"| {v:<14} | {ms:10.1f} | {tokens / ms * 1e3:12.0f} | {base / ms:7.2f}x | {peak:9.2f} |")
    head = (f"PP={pp}: {spec.describe()}\n"
            "| schedule       |   ms/iter  |     tokens/s |  vs 1F1B | peak GiB |\n"
            "|----------------|------------|--------------|----------|----------|")
    return "\n".join([head] + rows)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line (see the module docstring); prints the table and returns 0."""
    import torch

    from .cli_args import pipeline_ranks_from_gpus
    from .distributed import DEVICE_ENV, run_distributed

    ap = argparse.ArgumentParser(prog="python -m megatron_zb.testing.gpu_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, default=None,
                    help="pipeline-parallel size = processes (default: the number of visible GPUs)")
    for name in ("layers", "hidden", "heads", "seq", "vocab", "micro-batch", "microbatches"):
        ap.add_argument(f"--{name}", type=int, default=None, help="override the size picked for the GPUs")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up iterations per variant (default 3)")
    ap.add_argument("--iters", type=int, default=10, help="timed iterations per variant (default 10)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="hard limit of the whole run, seconds")
    args = ap.parse_args(argv)
    cuda = os.environ.get(DEVICE_ENV, "cpu") == "cuda"
    pp = pipeline_ranks_from_gpus(args.pp)
    if pp < 2:
        print(f"gpu_bench: a pipeline needs at least 2 ranks (got --pp {pp}); nothing to compare", file=sys.stderr)
        return 2
    mem = min(torch.cuda.get_device_properties(i).total_memory for i in range(pp)) / 2**30 if cuda else None
    sizes = model_for(pp=pp, gpu_memory_gib=mem)
    for k in list(sizes):
        given = getattr(args, k)
        if given is not None:
            sizes[k] = given
    spec = BenchModel(**sizes, warmup=args.warmup, iters=args.iters)
    if spec.layers % (V_CHUNKS_PER_RANK * pp):
        print(f"gpu_bench: --layers {spec.layers} must be a multiple of 2 * PP = {V_CHUNKS_PER_RANK * pp} "
              "(zbv: two stages per rank)",
              file=sys.stderr)
        return 2
    ranks = run_distributed(bench_rank, world_size=pp, args=(asdict(spec),), timeout=args.timeout)
    print(table(spec, pp, ranks), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Pipeline p2p at production activation sizes: every schedule it can run, one iteration each.

``python -m megatron_zb.testing.p2p_stress --pp N`` runs, for every schedule of the registry
(``megatron-zb list``) that runs without the model's vocabulary slices (:func:`stress_schedule_names`;
the vocabulary-parallel forms ``*-vocab-*`` are refused by name, exit 2:
:func:`~megatron_zb.runtime.get_forward_backward_func` refuses them without vocabulary
parallelism -- ``pretrain_gpt_zb.py --enable-vocab-parallel`` runs them), or those of
``--schedules``, one forward/backward of a megatron-core GPT with one transformer layer per
pipeline stage on N processes (PP = N; on a GPU node one GPU per rank with
``MEGATRON_ZB_TEST_DEVICE=cuda`` and NCCL), through the library's highest-level entry,
:func:`megatron_zb.runtime.get_forward_backward_func` -- so it exercises whatever send/receive
issue order the runtime has. The hidden states are large: by default sequence 4096 x micro batch 1
x hidden 8192 in bf16, 64 MiB per send. NCCL buffers small messages (a few MiB) and lets a send
complete before its receive is posted; at this size a send waits for its receive, so an issue
order that only worked thanks to buffering deadlocks here.

Per schedule it reports PASS, FAIL or SKIPPED:

* first a warm-up launch (``--warmup-timeout``) starts the process pool and the process group, so
  that each schedule's time is its own;
* each schedule runs in its own processes under a hard timeout (``--timeout``): a deadlock
  becomes ``FAIL ... did not finish within T s`` naming the schedule and where each rank was
  blocked, and the next schedule still runs; the runtime's own p2p timeout (``--p2p-timeout``,
  shorter) names the rank, the action and the peer when the host sees the wait;
* an exception in any rank is a FAIL with its first line;
* consistency: the same weights and data give the same forward, so every schedule's
  per-microbatch losses must equal (relative ``1e-5``) those of the first schedule of its
  placement, and its gradient norm within ``--grad-rtol`` (default 1e-3) -- a transfer delivered
  to the wrong microbatch or stage changes them. This is a smoke check, not the bitwise parity
  of the numerical suite;
* SKIPPED: the schedule's generator cannot be imported here (e.g. CP-SAT's ``ortools`` for
  ``zb-optimal``).

The schedule is built once in the launching process (unit costs; ``m = 2 x PP`` microbatches
unless ``--microbatches``) and handed to every rank, so the exact generators solve once.
The last line is the verdict: ``p2p stress: PASS ...`` or ``p2p stress: FAIL: <schedules>``; exit
status 0 when nothing failed, 1 otherwise, 2 for a bad command line (PP below 2).

On CPU (the default device, gloo) the same code runs at tiny sizes for the tests
(``--seq 16 --hidden 32 ...``, ``tests/bench/test_gpu_selftest.py``). Nothing is downloaded: the data
are random tokens.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

__all__ = ["StressModel", "main", "run_schedule", "stress_refusal", "stress_rank", "stress_schedule_names",
           "warm_up"]

MIB = 2**20
LOSS_RTOL = 1e-5
"""Relative tolerance of the per-microbatch loss comparison (the forward does not depend on the schedule)."""


@dataclass(frozen=True)
class StressModel:
    """The stress test's GPT (sizes in elements) and data type."""

    seq: int = 4096
    hidden: int = 8192
    heads: int = 8
    ffn: int = 8192
    vocab: int = 128
    micro_batch: int = 1
    microbatches: int | None = None
    dtype: str = "bf16"

    def send_bytes(self) -> int:
        """Bytes of one activation (or its gradient) sent between stages."""
        return self.seq * self.micro_batch * self.hidden * (4 if self.dtype == "fp32" else 2)

    def send_size(self) -> str:
        n = self.send_bytes()
        return f"{n / MIB:.1f} MiB" if n >= MIB else f"{n / 1024:.1f} KiB"

    def describe(self, pp: int, m: int) -> str:
        return (f"PP={pp}: GPT, 1 transformer layer per stage, hidden {self.hidden}, {self.heads} heads, ffn "
                f"{self.ffn}, seq {self.seq}, micro batch {self.micro_batch}, vocab {self.vocab}, {self.dtype}, "
                f"{m} microbatches; {self.send_size()} per send")


def _dtype(name: str) -> Any:
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def stress_rank(model: dict[str, Any], schedule: Any, p2p_timeout: float) -> dict[str, Any]:
    """One rank (inside :func:`~megatron_zb.testing.run_distributed`): build this rank's chunks for
    the schedule's placement, run one iteration, return the losses, the gradient norm, the time and
    this rank's peak CUDA memory."""
    import torch
    import torch.distributed as dist

    from ..runtime import get_forward_backward_func
    from .distributed import device_from_env, init_parallel_state
    from .tiny_gpt import TinyGPT, build_chunks, forward_backward, random_microbatches

    spec = StressModel(**model)
    pp = dist.get_world_size()
    m = schedule.num_microbatches
    dtype = _dtype(spec.dtype)
    cfg = TinyGPT(pp=pp, num_layers=schedule.num_stages, hidden=spec.hidden, heads=spec.heads, seq=spec.seq,
                  vocab=spec.vocab, micro_batch=spec.micro_batch, num_microbatches=m,
                  config_options=dict(ffn_hidden_size=spec.ffn, params_dtype=dtype, pipeline_dtype=dtype,
                                      bf16=spec.dtype == "bf16", fp16=spec.dtype == "fp16"))
    init_parallel_state(pipeline_model_parallel_size=pp, seed=cfg.seed)
    device = device_from_env()
    t0 = time.perf_counter()
    chunks = build_chunks(cfg, list(schedule.stage_to_rank))
    build_s = time.perf_counter() - t0
    modules = [c.module for c in chunks]
    if spec.dtype != "fp32":  # as pretrain_gpt_zb.py wraps them: every parameter in 16 bits, fp32 loss
        from ..megatron_compat.training import chunk_float16_module

        modules = [chunk_float16_module(c.module.config, c.module, first=c.plan.pre_process, last=c.plan.post_process)
                   for c in chunks]
    data = random_microbatches(m, vocab=spec.vocab, micro_batch=spec.micro_batch, seq=spec.seq, seed=7)
    fb = get_forward_backward_func(schedule, timeout=p2p_timeout)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.synchronize(device)
    dist.barrier()
    t0 = time.perf_counter()
    losses = forward_backward(fb, modules, data, seq=spec.seq, micro_batch=spec.micro_batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # a GPU-side deadlock hangs here; the hard timeout reports it
    seconds = time.perf_counter() - t0
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for mod in modules:
        for p in mod.parameters():
            if p.grad is not None:
                sq += p.grad.detach().double().pow(2).sum()
    dist.all_reduce(sq)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return dict(losses=[float(d["lm loss"]) for d in losses], grad_norm=math.sqrt(float(sq)), seconds=seconds,
                build_seconds=build_s, peak_bytes=int(peak), w_deferred=fb.store.executed)


@dataclass
class Outcome:
    """One schedule's result row."""

    schedule: str
    placement: str
    status: str  # PASS, FAIL, SKIPPED
    note: str = ""
    seconds: float | None = None
    loss: float | None = None
    grad_norm: float | None = None
    peak_gib: float | None = None
    losses: list[float] | None = None


def stress_refusal(name: str) -> str | None:
    """Why the stress cannot run schedule ``name`` (the runtime's own refusal text), or ``None``."""
    from ..schedules.ir import vocab_passes_unsupported
    from ..schedules.registry import get_spec

    return vocab_passes_unsupported(name=name, vocab_parallel=get_spec(name).vocab_parallel)


def stress_schedule_names() -> list[str]:
    """Every registered schedule the stress can run, in registration order."""
    from ..schedules.registry import schedule_names

    return [n for n in schedule_names() if stress_refusal(n) is None]


def _ready(device_type: str) -> float:
    """A warm-up rank: touch the device and the process group; returns the seconds since it started."""
    import torch
    import torch.distributed as dist

    t0 = time.perf_counter()
    if device_type == "cuda":
        torch.zeros(1, device="cuda").add_(1)
    dist.barrier()
    return time.perf_counter() - t0


def warm_up(pp: int, timeout: float, threads: int) -> str:
    """Start the process pool (imports) and one process group before the schedules; one line."""
    from .distributed import DEVICE_ENV, run_distributed

    t0 = time.perf_counter()
    run_distributed(_ready, world_size=pp, args=(os.environ.get(DEVICE_ENV, "cpu"),), timeout=timeout,
                    threads=threads)
    return f"warm-up: {pp} processes and their process group ready in {time.perf_counter() - t0:.1f} s"


def run_schedule(name: str, *, spec: StressModel, pp: int, timeout: float, p2p_timeout: float,
                 rank_fn: Callable[..., dict[str, Any]] = stress_rank, threads: int | None = None) -> Outcome:
    """Build schedule ``name`` and run ``rank_fn`` (default :func:`stress_rank`) with it on ``pp`` fresh
    processes; never raises for a failed run."""
    from ..schedules.registry import build_schedule, get_spec
    from .distributed import DistributedTimeout, run_distributed

    placement = str(get_spec(name).placement)
    m = spec.microbatches or 2 * pp
    try:
        schedule = build_schedule(name, num_ranks=pp, num_microbatches=m)
    except ImportError as e:
        return Outcome(name, placement, "SKIPPED", f"its generator cannot be imported here ({e})")
    except Exception as e:  # the generator refused this (p, m)
        return Outcome(name, placement, "FAIL", f"building the schedule failed: {type(e).__name__}: {_first(e)}")
    threads = threads or max(1, (os.cpu_count() or 1) // pp)
    try:
        ranks = run_distributed(rank_fn, world_size=pp, args=(asdict(spec), schedule, p2p_timeout),
                                timeout=timeout, threads=threads)
    except DistributedTimeout as e:
        where = _blocked_at(str(e))
        return Outcome(name, placement, "FAIL", f"deadlock or hang: rank(s) {e.ranks} did not finish within "
                                                f"{timeout:g} s{where}")
    except Exception as e:
        return Outcome(name, placement, "FAIL", f"{type(e).__name__}: {_first(e)}")
    losses = next((r["losses"] for r in ranks if r["losses"]), [])
    out = Outcome(name, placement, "PASS", seconds=max(r["seconds"] for r in ranks),
                  loss=sum(losses) / len(losses) if losses else None, grad_norm=ranks[0]["grad_norm"],
                  peak_gib=max(r["peak_bytes"] for r in ranks) / 2**30, losses=losses)
    bad = [x for x in losses if not math.isfinite(x)] + ([out.grad_norm] if not math.isfinite(out.grad_norm) else [])
    if len(losses) != m or bad:
        out.status, out.note = "FAIL", f"{len(losses)} losses for {m} microbatches, non-finite values {bad}"
    return out


def _first(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else repr(e)


def _blocked_at(message: str) -> str:
    """The innermost frame of each stuck rank's stack, from a :class:`DistributedTimeout` message."""
    parts = []
    for block in message.split("--- rank ")[1:]:
        rank = block.split(" ", 1)[0]
        frames = [ln.strip() for ln in block.splitlines() if ln.strip().startswith("File ")]
        if frames:
            parts.append(f"rank {rank} at {frames[0][:160]}")
    return ("; " + "; ".join(parts)) if parts else ""


def check_consistency(rows: list[Outcome], grad_rtol: float) -> None:
    """Per placement, compare every passing schedule with the first passing one (module doc)."""
    ref: dict[str, Outcome] = {}
    for r in rows:
        if r.status != "PASS":
            continue
        base = ref.setdefault(r.placement, r)
        if base is r:
            continue
        diffs = [i for i, (a, b) in enumerate(zip(r.losses or [], base.losses or []))
                 if not math.isclose(a, b, rel_tol=LOSS_RTOL, abs_tol=0.0)]
        if diffs:
            i = diffs[0]
            r.status, r.note = "FAIL", (f"losses differ from {base.schedule}'s (same weights and data): microbatch "
                                        f"{i}: {r.losses[i]!r} vs {base.losses[i]!r} ({len(diffs)} microbatches)")
        elif not math.isclose(r.grad_norm, base.grad_norm, rel_tol=grad_rtol):
            r.status, r.note = "FAIL", (f"gradient norm {r.grad_norm:.6g} differs from {base.schedule}'s "
                                        f"{base.grad_norm:.6g} by more than {grad_rtol:g} relative")
        else:
            r.note = f"losses and grad norm equal {base.schedule}'s"


def table(rows: list[Outcome]) -> str:
    lines = ["| schedule         | placement   | result  | s/iter  | mean loss | grad norm  | peak GiB | note",
             "|------------------|-------------|---------|---------|-----------|------------|----------|-----"]
    for r in rows:
        def f(x: float | None, fmt: str) -> str:
            return format(x, fmt) if x is not None else "-"
        lines.append(f"| {r.schedule:<16} | {r.placement:<11} | {r.status:<7} | {f(r.seconds, '7.2f'):>7} | "
                     f"{f(r.loss, '9.5f'):>9} | {f(r.grad_norm, '10.5g'):>10} | {f(r.peak_gib, '8.2f'):>8} | {r.note}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    d = StressModel()
    ap = argparse.ArgumentParser(prog="python -m megatron_zb.testing.p2p_stress", description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, default=None,
                    help="pipeline-parallel size = processes (default: the number of visible GPUs)")
    ap.add_argument("--schedules", default=None,
                    help="comma-separated registry names (default: every registered one the stress can run)")
    for name in ("seq", "hidden", "heads", "ffn", "vocab", "micro-batch"):
        ap.add_argument(f"--{name}", type=int, default=getattr(d, name.replace("-", "_")),
                        help=f"default {getattr(d, name.replace('-', '_'))}")
    ap.add_argument("--microbatches", type=int, default=None, help="microbatches per iteration (default 2 x PP)")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=d.dtype, help="default bf16")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="hard limit per schedule, seconds (process start and model build included; default 300)")
    ap.add_argument("--p2p-timeout", type=float, default=None,
                    help="the runtime's limit for one transfer, seconds (default: half of --timeout)")
    ap.add_argument("--warmup-timeout", type=float, default=60.0,
                    help="hard limit of the warm-up launch before the schedules, seconds (default 60)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: CPU cores / PP)")
    ap.add_argument("--grad-rtol", type=float, default=1e-3, help="gradient-norm tolerance between schedules")
    return ap


def _schedules(arg: str | None) -> tuple[list[str], str | None]:
    """The schedules to run and, for a bad ``--schedules``, the reason (then the list is empty)."""
    from ..schedules.registry import schedule_names

    if arg is None:
        return stress_schedule_names(), None
    names = [s for s in arg.split(",") if s]
    unknown = [n for n in names if n not in schedule_names()]
    if unknown:
        return [], f"unknown schedule(s) {', '.join(unknown)}; choose from {', '.join(stress_schedule_names())}"
    refused = [(n, stress_refusal(n)) for n in names if stress_refusal(n) is not None]
    if refused:
        return [], f"cannot run {', '.join(n for n, _ in refused)}: {refused[0][1]}"
    return names, None


def main(argv: Sequence[str] | None = None) -> int:
    """Command line (see the module docstring)."""
    from .cli_args import pipeline_ranks_from_gpus
    from .distributed import DEVICE_ENV

    args = _parser().parse_args(argv)
    cuda = os.environ.get(DEVICE_ENV, "cpu") == "cuda"
    pp = pipeline_ranks_from_gpus(args.pp)
    if pp < 2:
        print(f"p2p stress: skipped: needs 2 GPUs (pipeline ranks), got --pp {pp}", file=sys.stderr)
        return 2
    names, problem = _schedules(args.schedules)
    if problem:
        print(f"p2p stress: {problem}", file=sys.stderr)
        return 2
    spec = StressModel(seq=args.seq, hidden=args.hidden, heads=args.heads, ffn=args.ffn, vocab=args.vocab,
                       micro_batch=args.micro_batch, microbatches=args.microbatches, dtype=args.dtype)
    p2p_timeout = args.p2p_timeout if args.p2p_timeout is not None else args.timeout / 2
    threads = args.threads or max(1, (os.cpu_count() or 1) // pp)
    m = spec.microbatches or 2 * pp
    print(f"p2p stress on {'CUDA, ' + os.environ.get('MEGATRON_ZB_TEST_BACKEND', 'nccl') if cuda else 'CPU, gloo'}: "
          f"{spec.describe(pp, m)}; hard timeout {args.timeout:g} s per schedule, runtime p2p timeout "
          f"{p2p_timeout:g} s; {len(names)} schedules", flush=True)
    try:
        print("  " + warm_up(pp, args.warmup_timeout, threads), flush=True)
    except Exception as e:
        print(f"p2p stress: FAIL: the warm-up launch failed: {type(e).__name__}: {_first(e)}")
        return 1
    rows = []
    for name in names:
        t0 = time.perf_counter()
        row = run_schedule(name, spec=spec, pp=pp, timeout=args.timeout, p2p_timeout=p2p_timeout, threads=threads)
        rows.append(row)
        print(f"  {name}: {row.status} in {time.perf_counter() - t0:.1f} s{': ' + row.note if row.note else ''}",
              flush=True)
    check_consistency(rows, args.grad_rtol)
    print(table(rows), flush=True)
    failed = [r.schedule for r in rows if r.status == "FAIL"]
    skipped = [r.schedule for r in rows if r.status == "SKIPPED"]
    tail = f"; skipped {', '.join(skipped)}" if skipped else ""
    size = f"{spec.send_size()} per send, PP={pp}"
    if failed:
        print(f"p2p stress: FAIL: {', '.join(failed)} ({len(failed)} of {len(rows)} schedules; {size}{tail})")
        return 1
    print(f"p2p stress: PASS: {len(rows) - len(skipped)} schedules ({size}{tail})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

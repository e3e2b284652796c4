"""Benchmark section: megatron-zb's profiled schedules beside PyTorch's built-in schedules, all run
by PyTorch's own pipeline runtime (``torch.distributed.pipelining``, PyTorch 2.13, CPU, gloo).

One run (:func:`main`: ``python -m megatron_zb.bench torch-pipelining``, or
``scripts/bench_torch_pipelining.py``), ``pp`` processes of one thread each. The model is
:class:`~megatron_zb.testing.torch_pipelining.TinyLM` in float32 (``nn.TransformerEncoderLayer``
blocks, no dropout), the same weights for every schedule, split as each schedule places its stages
(one stage per rank for ``Schedule1F1B``/``zb-1p``/``zb-2p``; two per rank, ``loop`` or ``v``, for
the others). Per schedule:

* PyTorch's classes (``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``,
  ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``; one missing from the installed torch is reported
  as absent) are built as PyTorch documents them;
* ours are built with :func:`~megatron_zb.torch_pipelining.runtime.build_pipeline` from unit costs
  (``auto`` on V-placed stages: it chooses among ``1f1b-v``, ``zbv`` and PyTorch's V orders,
  ``torch:<class>``, and is labelled with its choice after the re-plan) and re-planned once with
  :func:`~megatron_zb.torch_pipelining.profiling.profile_and_replan` (1 warm-up, ``profile_iterations``
  timed iterations), so they run from costs measured inside
  PyTorch's runtime; ``NAME@BUILTIN`` (e.g. ``zbv@ScheduleZBVZeroBubble``) re-plans ``NAME`` once more
  with the built-in's measured peak activation memory (max over ranks, measured first) as its memory
  limit, in the profile's unit (the stages' mean measured ``M_B``): ours at the built-in's memory;
* every schedule runs one warm-up step, then ``rounds`` paired rounds: each round runs every
  schedule once (the order rotated by one each round), each step between two barriers; the
  iteration time is rank 0's wall time from the first barrier to the second [ms]. Reported: the
  median over rounds, and the median over rounds of the ratio to the fastest built-in in the same
  round (paired: both ran in the same round, so the machine's load then affects both);
* peak activation memory: one more step per schedule with
  :class:`~megatron_zb.runtime.memory.ActivationMemoryTracker` counting through
  :func:`~megatron_zb.torch_pipelining.profiling.saving` (detached aliases: no reference cycles) -- the largest number of bytes of
  tensors autograd saved for backward (each storage counted once, parameters excluded) alive at the
  same time on a rank, from when a forward saves them until autograd frees them (after ``B`` for a
  fused backward, after ``W`` for a split one). Not counted: PyTorch's send/receive buffers, the
  gradients, the last stage's kept outputs themselves. Reported per rank and the maximum over ranks
  [MiB]. Every step runs with ``return_outputs=False`` (a training step needs the losses only); the
  peak is measured once more with PyTorch's default ``return_outputs=True``, with which the last
  stage keeps each microbatch's output -- and, when that output is a view (this model's 3-D output
  layer result is), the part of its autograd graph a split backward's ``W`` does not run, with
  everything it saved, until the step's outputs are dropped.

PyTorch's V orders (``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``, imported into our IR) are also
predicted by our simulator from ``auto``'s measured costs, beside their measured medians.

The measured T_F, T_I (our B) and T_W per stage of our re-planned schedules are printed too (the
profile the schedules were rebuilt from), to show where T_W differs from T_F; for ``auto`` also
T_B (fused) and every candidate's predicted iteration time and peak (in chunk ``M_B`` units of the
unit-cost memory model: the re-plan keeps ``mem_b`` in the given units).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Callable

import torch

from ..testing.torch_pipelining import LMConfig, batch, loss_fn, stage_module

__all__ = ["TorchBenchConfig", "bench_rank", "main", "report"]

BUILTINS = ("Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble",
            "ScheduleDualPipeV")
OURS = ("1f1b", "zb-1p", "zb-2p", "zbv", "v-half", "v-min", "1f1b-v", "auto", "interleaved-zb")
AUTO_STAGES = "1f1b-v"
"""``auto`` picks among the families of its stages' placement: the benchmark builds them V-placed."""


@dataclass(frozen=True)
class TorchBenchConfig:
    """One benchmark run: pipeline ranks, microbatches, paired rounds, the model, the schedules."""

    pp: int = 2
    microbatches: int = 8
    rounds: int = 7
    profile_iterations: int = 3
    model: LMConfig = field(default_factory=lambda: LMConfig(vocab=256, hidden=128, heads=4, ffn=512, layers=8,
                                                             seq=256, mbs=1, dtype="float32"))
    builtins: tuple[str, ...] = BUILTINS
    ours: tuple[str, ...] = OURS


@dataclass
class _Entry:
    label: str
    placement: str
    step: Callable[..., None]
    params: list[torch.Tensor]


def _modules(cfg: LMConfig, mine: list[int], n: int) -> tuple[dict[int, Any], list[Any]]:
    from torch.distributed.pipelining import PipelineStage
    mods = {s: stage_module(cfg, s, n) for s in mine}
    return mods, [PipelineStage(mods[s], s, n, torch.device("cpu")) for s in mine]


def _stepper(sched: Any, mods: dict[int, Any], n: int, x: torch.Tensor, y: torch.Tensor) -> Callable[..., None]:
    def step(return_outputs: bool = False) -> None:
        for mod in mods.values():
            mod.zero_grad(set_to_none=True)
        kw: dict[str, Any] = {"target": y, "losses": []} if n - 1 in mods else {}
        sched.step(*((x,) if 0 in mods else ()), return_outputs=return_outputs, **kw)
    return step


def bench_rank(bc: TorchBenchConfig) -> dict[str, Any]:
    """One rank of the benchmark (module doc); returns its times, peaks and the measured profiles."""
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules as ts

    from .progress import RoundProgress, log
    from ..schedules.torch_import import TORCH_SCHEDULES
    from ..schedules.fusion import simulate_as_run
    from ..torch_pipelining.profiling import profile_and_replan
    from ..torch_pipelining.runtime import build_pipeline, stages_for_rank

    rank, p, m = dist.get_rank(), dist.get_world_size(), bc.microbatches
    x, y = batch(bc.model, m)
    entries: list[_Entry] = []
    absent: list[str] = []
    for name in bc.builtins:
        cls = getattr(ts, name, None)
        if cls is None:
            absent.append(name)
            continue
        pl = TORCH_SCHEDULES[name].placement
        mine = [s for s, r in enumerate(pl.stage_to_rank(p, 2)) if r == rank]
        n = p * len(mine)
        mods, stages = _modules(bc.model, mine, n)
        sched = cls(stages[0] if len(stages) == 1 else stages, m, loss_fn=loss_fn)
        entries.append(_Entry(name, pl.value, _stepper(sched, mods, n, x, y),
                              [q for mod in mods.values() for q in mod.parameters()]))
    profiles: dict[str, Any] = {}
    choices: dict[str, Any] = {}
    say = log if rank == 0 else (lambda msg: None)
    matched = _builtin_peaks(entries, {o.partition("@")[2] for o in bc.ours} - {""})
    for spec in bc.ours:
        name, _, like = spec.partition("@")
        say(f"torch-pipelining: building and profiling {spec} ({bc.profile_iterations} timed iterations)")
        mine = stages_for_rank(AUTO_STAGES if name == "auto" else name, num_ranks=p, rank=rank)
        n = p * len(mine)
        mods, stages = _modules(bc.model, mine, n)
        pipe = build_pipeline(stages, name, num_microbatches=m, loss_fn=loss_fn)
        step = _stepper(pipe, mods, n, x, y)
        rep = profile_and_replan(pipe, step, iterations=bc.profile_iterations, warmup=1)
        if like:  # the built-in's measured peak as the limit, in the costs' unit (the stages' mean measured M_B)
            mean_mb = statistics.fmean(rep.bytes[("F", s)] for s in range(rep.after.num_stages))
            pipe.memory_limit = matched[like] / mean_mb
            rep.after = pipe.rebuild(rep.costs)
        label = (f"auto: {rep.after.name}" if name == "auto" else name) + (f"@{like}" if like else "")
        predicted = simulate_as_run(rep.after, rep.costs).total_time
        profiles[label] = (rep.medians_ms, rep.bytes, rep.action_overhead_ms, predicted, rep.costs)
        if pipe.candidates is not None:
            choices[label] = pipe.candidates
        entries.append(_Entry(label, pipe.placement.value, step,
                              [q for mod in mods.values() for q in mod.parameters()]))

    for e in entries:  # warm-up (PyTorch's shape inference on a class's first step)
        e.step()
    times: dict[str, list[float]] = {e.label: [] for e in entries}
    progress = RoundProgress("torch-pipelining", bc.rounds, enabled=rank == 0)
    for r in range(bc.rounds):
        k = r % len(entries)
        for e in entries[k:] + entries[:k]:
            dist.barrier()
            t0 = time.perf_counter()
            e.step()
            dist.barrier()
            times[e.label].append(1e3 * (time.perf_counter() - t0))
        progress.round(m=bc.microbatches, times_ms={e.label: times[e.label][-1] for e in entries})
    say("torch-pipelining: measuring peak activation memory (two steps per schedule)")
    peaks: dict[str, int] = {}
    peaks_outputs: dict[str, int] = {}
    for e in entries:
        for ret, into in ((False, peaks), (True, peaks_outputs)):
            into[e.label] = _peak_bytes(e, return_outputs=ret)
    return {"times": times, "peaks": peaks, "peaks_outputs": peaks_outputs, "profiles": profiles, "choices": choices, "absent": absent,
            "placement": {e.label: e.placement for e in entries}}


def _peak_bytes(e: _Entry, *, return_outputs: bool = False) -> int:
    """This rank's peak activation bytes over one step of ``e`` (the benchmark's memory step; collective)."""
    import torch.distributed as dist

    from ..runtime.memory import ActivationMemoryTracker
    from ..torch_pipelining.profiling import saving

    tracker = ActivationMemoryTracker(e.params)
    dist.barrier()
    with saving(tracker):
        e.step(return_outputs=return_outputs)
    return tracker.peak_bytes


def _builtin_peaks(entries: list[_Entry], names: set[str]) -> dict[str, float]:
    """The peak activation bytes (max over ranks) of the built-ins ``names`` among ``entries``, each
    measured as the benchmark's memory step does, after a warm-up step (collective over the ranks)."""
    import torch.distributed as dist

    unknown = names - {e.label for e in entries}
    if unknown:
        raise ValueError(f"--ours NAME@BUILTIN: {', '.join(sorted(unknown))} is not among the --builtins run")
    peaks = {}
    for e in (e for e in entries if e.label in names):
        e.step()
        peak = torch.tensor([float(_peak_bytes(e))])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        peaks[e.label] = float(peak)
    return peaks


def _builtins_predicted(bc: TorchBenchConfig, r0: dict[str, Any], med: dict[str, float]) -> list[str]:
    """The V built-ins' orders (imported into our IR) predicted by our simulator from the first V-placed
    ``auto`` profile's measured costs (overhead per action included), beside their measured medians:
    how well the cost model ranks schedules it did not build."""
    from ..schedules.simulator import simulate
    from ..schedules.torch_import import TORCH_SCHEDULES, import_torch_schedule

    costs = next((c for k, (*_, c) in r0["profiles"].items() if k.startswith("auto: ") and "@" not in k), None)
    names = [k for k in bc.builtins if k in med and TORCH_SCHEDULES[k].placement.value == "v"]
    if costs is None or not names:
        return []
    cells = []
    for k in names:
        sched = import_torch_schedule(k, num_ranks=bc.pp, num_microbatches=bc.microbatches)
        pred = simulate(sched, costs, enforce_memory=False).total_time
        cells.append(f"{k} predicted {pred:.1f} ms = {pred / med[k]:.2f} of measured")
    return ["\nPyTorch's V orders predicted by our simulator from auto's measured costs: " + "; ".join(cells)]


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def report(bc: TorchBenchConfig, results: list[dict[str, Any]]) -> str:
    """Markdown tables of one run (rank 0's times; peaks of every rank)."""
    r0 = results[0]
    labels = list(r0["times"])
    med = {k: statistics.median(v) for k, v in r0["times"].items()}
    builtins = [k for k in labels if k in bc.builtins]
    best_builtin = min(builtins, key=lambda k: med[k]) if builtins else None
    peak = {k: max(r["peaks"][k] for r in results) for k in labels}
    lines = [f"PP={bc.pp}, {bc.microbatches} microbatches, {bc.rounds} paired rounds; model {bc.model}",
             "", "| schedule | by | placement | iteration ms (median) | paired ratio to fastest built-in "
             f"({best_builtin}) | peak activation MiB (max over ranks) | per rank | with return_outputs=True |",
             "|---|---|---|---|---|---|---|---|"]
    for k in labels:
        ratio = "-"
        if best_builtin is not None:
            ratio = f"{statistics.median(a / b for a, b in zip(r0['times'][k], r0['times'][best_builtin])):.3f}"
        lines.append(f"| {k} | {'PyTorch' if k in bc.builtins else 'megatron-zb, profiled'} | {r0['placement'][k]} | "
                     f"{med[k]:.1f} | {ratio} | {_mib(peak[k])} | {', '.join(_mib(r['peaks'][k]) for r in results)} | "
                     f"{_mib(max(r['peaks_outputs'][k] for r in results))} |")
    if r0["absent"]:
        lines.append(f"\nnot in this torch: {', '.join(r0['absent'])}")
    lines += ["", "Measured inside PyTorch's runtime by profile_and_replan (ms, median; T_I: PyTorch's I, our B; "
              "T_B (fused): PyTorch's B, for a fused-backward schedule; stage 0's I does nothing and its W is the "
              "whole backward; M_B: saved bytes one F leaves, mean):", "",
              "| schedule | stage | T_F | T_I | T_W | T_B (fused) | M_B MiB | held after I (M_W / M_B) |",
              "|---|---|---|---|---|---|---|---|"]
    nan = float("nan")
    for name, (med_ms, nbytes, *_) in r0["profiles"].items():
        n = 1 + max(s for _, s in med_ms)
        for s in range(n):
            m_b = nbytes.get(("F", s), nan)
            cells = [f"{med_ms[(op, s)]:.2f}" if (op, s) in med_ms else "-" for op in ("F", "B", "W", "BW")]
            held = f"{(m_b + nbytes[('B', s)]) / m_b:.2f}" if ("B", s) in nbytes else "-"
            lines.append(f"| {name} | {s} | {' | '.join(cells)} | {_mib(m_b)} | {held} |")
    lines.append("\nThe runtime's time per compute action beyond the compute (measured iteration minus the simulator's "
                 "prediction, over the busiest rank's actions) and the re-planned schedule's predicted iteration with it: "
                 + "; ".join(f"{k} {o:.2f} ms/action, predicted {pred:.1f} ms = {pred / med[k]:.2f} of measured"
                             for k, (_, _, o, pred, _) in r0["profiles"].items() if k in med))
    lines += _builtins_predicted(bc, r0, med)
    for label, rows in r0.get("choices", {}).items():
        lines.append(f"\n{label}: candidates predicted from the measured costs (simulator, PyTorch's fused B at T_B "
                     f"(fused)): " + "; ".join(f"{n} {t:.1f} ms, peak {pk:g} M_B" for n, t, pk in rows))
    if best_builtin is not None:
        ours = [k for k in labels if k not in bc.builtins and peak[k] <= peak[best_builtin]]
        if ours:
            best = min(ours, key=lambda k: med[k])
            pairs = [a / b for a, b in zip(r0["times"][best], r0["times"][best_builtin])]
            q1, _, q3 = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else (pairs[0],) * 3
            lines.append(f"\nfastest of ours at or below {best_builtin}'s peak activation memory "
                         f"({_mib(peak[best_builtin])} MiB): {best} ({_mib(peak[best])} MiB), paired median ratio "
                         f"{statistics.median(pairs):.3f} of {best_builtin}'s iteration time (quartiles {q1:.3f}-"
                         f"{q3:.3f}; faster in {sum(x < 1 for x in pairs)} of {len(pairs)} rounds)")
        else:
            lines.append(f"\nnone of ours is at or below {best_builtin}'s peak activation memory")
    for name in ("v-half", "v-min"):
        if name in peak and "ScheduleZBVZeroBubble" in peak:
            lines.append(f"{name} / ScheduleZBVZeroBubble peak activation memory: "
                         f"{peak[name] / peak['ScheduleZBVZeroBubble']:.3f}")
    return "\n".join(lines)


DESCRIPTION = "Benchmark: megatron-zb's profiled schedules beside PyTorch's built-ins, all run by PyTorch's own"
"""The command line's description (the first line of what ``scripts/bench_torch_pipelining.py`` said)."""


def main(argv: list[str] | None = None) -> int:
    """The benchmark on ``argv`` (default ``sys.argv[1:]``): one run of :func:`bench_rank` in ``--pp``
    processes, then :func:`report`, the machine and its load. Results: docs/torch_pipelining.md."""
    from .machine import LoadSampler, machine
    from ..testing.distributed import run_distributed

    ap = argparse.ArgumentParser(description=DESCRIPTION)
    ap.add_argument("--pp", type=int, default=2, help="pipeline ranks (processes, one thread each)")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=7, help="paired rounds (every schedule once per round)")
    ap.add_argument("--layers", type=int, default=8, help="transformer layers (divisible by 2 x pp)")
    ap.add_argument("--seq", type=int, default=256, help="tokens per sample")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--builtins", default=",".join(BUILTINS),
                    help="PyTorch's schedule classes to run, comma-separated (default: all five)")
    ap.add_argument("--ours", default=",".join(OURS),
                    help="megatron-zb families (or auto) to run, comma-separated; NAME@BUILTIN: NAME re-planned with "
                         "that built-in's measured peak activation memory as its limit")
    a = ap.parse_args(argv)
    pick = {k: tuple(n for n in getattr(a, k).split(",") if n) for k in ("builtins", "ours")}
    bc = TorchBenchConfig(pp=a.pp, microbatches=a.microbatches, rounds=a.rounds, **pick)
    bc = replace(bc, model=replace(bc.model, layers=a.layers, seq=a.seq, hidden=a.hidden, ffn=4 * a.hidden))
    print(machine())
    sampler = LoadSampler()
    t0 = time.perf_counter()
    res = run_distributed(partial(bench_rank, bc), world_size=bc.pp, timeout=3600, threads=1,
                          preload=("torch", "torch.distributed", "megatron_zb"))
    print(report(bc, res))
    print(f"\n{sampler.stop()}\nwall time {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

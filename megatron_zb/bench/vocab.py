"""``python -m megatron_zb.bench vocab``: vocabulary parallelism measured on CPU (issue 24).

Runs ``pretrain_gpt_zb.py``'s own path -- :func:`~megatron_zb.training.pretrain.parse_command_line`
(the flags, their checks, the schedule) and the :class:`~megatron_zb.training.trainer.Trainer`, which
turns them into the typed ``RunConfig`` -- in-process on :func:`~megatron_zb.testing.run_distributed`
ranks (gloo, one thread each), for a GPT whose output layer dominates (default: vocabulary 65,536,
hidden 256, sequence 256: the output layer is ``V / (12h + 2s)`` = 18.3 transformer layers of
compute, :mod:`megatron_zb.planning.vocab`), with and without ``--enable-vocab-parallel``:

* ``1f1b`` / ``1f1b-vocab-1``, ``zb-h1`` / ``zb-h1-vocab-1``, and ``zbv`` / ``zbv-vocab-1`` (``zbv``
  alone while the catalogue has no ``zbv-vocab-1``: ``megatron-zb list``);
* ``megatron-1f1b-split``: megatron-core's own 1F1B (``--use-megatron-core-schedule``) with
  ``--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split``.

Per run and rank: the iteration time (median of the logged "elapsed time per iteration" from
``--measure-from`` on; rank-independent), the parameter bytes the rank holds (its chunks and, with
the flag, its vocabulary slices), and the peak resident set of the rank's process during training
above its resident set before the model was built (``VmHWM`` reset by ``/proc/self/clear_refs`` after
set-up: parameters, gradients, optimizer state, activations, communication buffers, allocator slack).
``--rounds`` rounds run every variant once each, each pair back to back (:func:`run_rounds`); the
speed-up of a pair is the median over rounds of ``t_base / t_vocab`` measured in the same round
(paired).

Beside each measured iteration: the planner's prediction (``megatron-zb plan`` with
``--enable-vocab-parallel``, :mod:`megatron_zb.planning`) for this model on a CPU "GPU" calibrated on
this machine before the rounds, in the same two-rank set-up (:func:`calibrate_rank`): matrix-product
FLOP/ms (the output layer's and a layer's GEMM shapes, weighted by their share of the model's FLOPs),
element-wise bytes/ms (``exp`` over one rank's ``[s, b, V/p]`` logits), the fastest of a few repeats
each, and the transfer time of one ``s x b x h`` activation (gloo ping-pong, used as
the latency of every point-to-point transfer and collective), nothing taken from the runs.

And beside it the prediction from each run's own profile (:func:`profile_prediction`): the profiling
window (iterations 2 to ``max(--measure-from, 5) - 1``, the first measuring activation bytes only) times
every action -- with the flag also ``IF``/``S``/``T``/``IB`` without their waits and the collectives,
docs/vocab_parallel.md -- the schedule is re-planned from those costs, and the schedule then run is
simulated under them, plus the measured time outside the schedule's actions (the optimizer step).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from .progress import heartbeat
from .progress import log as stamped

__all__ = ["VocabBenchSpec", "Variant", "bench_rank", "calibrate_rank", "main", "variants"]

MEGATRON_SPLIT = "megatron-1f1b-split"
CALIBRATION_REPEATS = 9
"""Timed repeats of each calibration kernel (the fastest counts)."""
SPLIT_FLAGS = ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
HEARTBEAT_S = 5.0
"""Seconds between the progress lines while one run (or the calibration) goes (:func:`.progress.heartbeat`)."""


@dataclass(frozen=True)
class VocabBenchSpec:
    """The benchmark's model and run (sizes in elements; ``iters`` iterations per run)."""

    num_layers: int = 4
    hidden: int = 256
    heads: int = 4
    seq: int = 256
    vocab: int = 65536
    micro_batch: int = 1
    microbatches: int = 8
    pp: int = 2
    iters: int = 7
    measure_from: int = 5
    rounds: int = 3
    timeout: float = 600.0
    position_embedding: str = "rope"

    def describe(self) -> str:
        return (f"GPT {self.num_layers} layers, hidden {self.hidden}, {self.heads} heads, seq {self.seq}, vocab "
                f"{self.vocab}, {self.position_embedding} positions, micro batch {self.micro_batch}, "
                f"{self.microbatches} microbatches, PP={self.pp}, fp32, tied embeddings, no dropout, Adam")

    def argv(self) -> list[str]:
        """``pretrain_gpt_zb.py`` flags common to every variant."""
        gbs = self.micro_batch * self.microbatches
        return ["--num-layers", str(self.num_layers), "--hidden-size", str(self.hidden), "--num-attention-heads",
                str(self.heads), "--seq-length", str(self.seq), "--max-position-embeddings", str(self.seq),
                "--vocab-size", str(self.vocab), "--position-embedding-type", self.position_embedding,
                "--tokenizer-type", "NullTokenizer", "--hidden-dropout", "0",
                "--attention-dropout", "0", "--micro-batch-size", str(self.micro_batch), "--global-batch-size",
                str(gbs), "--train-iters", str(self.iters), "--lr", "1e-4", "--mock-data", "--num-workers", "0",
                "--log-interval", "1", "--eval-iters", "0", "--eval-interval", str(10 * self.iters),
                "--distributed-backend", "gloo", "--pipeline-model-parallel-size", str(self.pp),
                "--pipeline-timeout-seconds", str(int(self.timeout)), "--distributed-timeout-minutes", "10",
                "--zero-bubble-pipeline-timers-start-iter", "2",
                "--zero-bubble-pipeline-timers-end-iter", str(max(self.measure_from, 5))]


@dataclass(frozen=True)
class Variant:
    """One measured configuration.

    Attributes:
        label: its name in the table.
        flags: ``pretrain_gpt_zb.py`` flags added to :meth:`VocabBenchSpec.argv`.
        planned: the planner's family name for its prediction.
        base: for a vocabulary-parallel variant, the label it is paired with; else ``None``.
        split: whether Megatron's embedding/loss split accounting is on (the planner's layout too).
        defer_t_weight: ``VocabParallelModel.defer_t_weight`` (T's weight gradient queued for a W; the
            ``-deferred`` variants, paired with the same schedule running it in T).
    """

    label: str
    flags: tuple[str, ...]
    planned: str
    base: str | None = None
    split: bool = False
    defer_t_weight: bool = False


def variants(pairs: Sequence[str] = ("1f1b", "zb-h1", "zbv"), *, megatron_split: bool = True,
             deferred: bool = False) -> list[Variant]:
    """Each base schedule and its ``-vocab-1`` schedule when the catalogue has it (a base whose
    vocabulary schedule is not registered runs alone, unpaired), with ``deferred`` also that schedule with
    T's weight gradient queued for a W (``<vocab>-deferred``, paired with it; not for 1F1B, whose fused
    backward has no W), then megatron-core's 1F1B with the split flags."""
    from ..schedules.registry import schedule_names

    names = set(schedule_names())
    out: list[Variant] = []
    for base in pairs:
        vocab = f"{base}-vocab-1"
        out.append(Variant(base, ("--schedule", base), base))
        if vocab in names:
            out.append(Variant(vocab, ("--schedule", vocab, "--enable-vocab-parallel"), vocab, base=base))
            if deferred and base != "1f1b":
                out.append(Variant(f"{vocab}-deferred", ("--schedule", vocab, "--enable-vocab-parallel"), vocab,
                                   base=vocab, defer_t_weight=True))
    if megatron_split:
        out.append(Variant(MEGATRON_SPLIT, ("--use-megatron-core-schedule", *SPLIT_FLAGS), "1f1b", split=True))
    return out


# ------------------------------------------------------------------------------------ inside a rank
def _status_kib(key: str) -> int:
    """``/proc/self/status``'s ``key`` (``VmRSS``, ``VmHWM``) in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def bench_rank(argv: list[str], defer_t_weight: bool = False) -> dict[str, Any]:
    """One rank of one run: parse and validate ``argv`` as ``pretrain_gpt_zb.py`` does, run the Trainer
    (``defer_t_weight``: its ``VocabParallelModel.defer_t_weight``, which no flag sets); this rank's
    iteration lines, parameter bytes, peak resident set above the start (bytes), the profile's prediction
    and report lines."""
    import contextlib
    import io

    import torch.distributed as dist

    from ..training.pretrain import parse_command_line
    from ..training.trainer import Trainer

    rss0 = _status_kib("VmRSS")
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        validated = parse_command_line(argv, world_size=dist.get_world_size())
        trainer = Trainer(validated.args, schedule=validated.schedule)
        try:
            if defer_t_weight:
                trainer.planner.vocab.defer_t_weight = True
            model = trainer.model
            params = {id(p): p for ch in model.chunks for p in ch.module.parameters()}
            if model.vocab_slices is not None:
                params.update({id(p): p for p in model.vocab_slices.parameters()})
            param_bytes = sum(p.numel() * p.element_size() for p in params.values())
            decoder_bytes = sum(p.numel() * p.element_size() for ch in model.chunks
                                for name, p in ch.module.named_parameters() if ".decoder." in f".{name}")
            with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS now (Linux >= 4.0)
                f.write("5")
            assert trainer.run() == 0
            peak = _status_kib("VmHWM")
            profiled = profile_prediction(trainer)
        finally:
            trainer.close()
    text = log.getvalue().splitlines()
    lines = [ln for ln in text if "elapsed time per iteration" in ln]
    measured = [ln.strip() for ln in text if ln.lstrip().startswith("measured ")]
    return {"param_bytes": param_bytes, "decoder_bytes": decoder_bytes, "peak_bytes": (peak - rss0) * 1024, "lines": lines,
            "profile_ms": profiled, "measured": measured}


def profile_prediction(trainer: Any) -> float | None:
    """The iteration time (ms) the run's own profile predicts: the schedule installed after the window
    (re-planned from the measured costs when cost-aware), simulated under the measured cost model (with vocabulary parallelism the
    passes' too), plus the measured time outside the schedule's actions (``step_ms``: the optimizer step,
    the gradient reduces); ``None`` without a profile (megatron-core's schedule) or without ``step_ms``."""
    from ..schedules import simulate

    planner = trainer.planner
    costs = planner.measured_costs
    if planner.runtime is None or costs is None or planner.agreed is None or planner.agreed.step_ms is None:
        return None
    config = trainer.config
    sched = planner.runtime.schedule_for(config.parallel.pipeline_model_parallel_size, config.num_microbatches)
    return simulate(sched, costs, enforce_memory=False).makespan + planner.agreed.step_ms


def calibrate_rank(spec_dict: dict[str, Any]) -> dict[str, float]:
    """This machine as the planner's hardware, measured on every rank at once (as the runs share the
    cores): GEMM FLOP/ms of the output layer's slice and of a layer's shape, element-wise bytes/ms
    (``exp`` of the slice's logits: read + write), each into a preallocated output and the fastest of
    :data:`CALIBRATION_REPEATS` (the kernel's speed while the rank has its core: the medians, with new
    output tensors, came out 3-5x slower than the runs themselves on this shared machine); one
    activation's gloo transfer in ms (ping-pong / 2, median)."""
    import torch
    import torch.distributed as dist

    spec = VocabBenchSpec(**spec_dict)
    T, h = spec.seq * spec.micro_batch, spec.hidden

    def rate(fn: Any, work: float) -> float:
        fn()
        ts = []
        for _ in range(CALIBRATION_REPEATS):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return work / (min(ts) * 1e3)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, h, generator=g)
    w_out = torch.randn(spec.vocab // spec.pp, h, generator=g)
    w_layer = torch.randn(4 * h, h, generator=g)
    o_out, o_layer = torch.empty(T, w_out.shape[0]), torch.empty(T, w_layer.shape[0])
    logits = torch.randn(T, 1, spec.vocab // spec.pp, generator=g)
    buf = torch.empty_like(logits)
    out = {"gemm_output": rate(lambda: torch.matmul(x, w_out.t(), out=o_out), 2.0 * T * h * w_out.shape[0]),
           "gemm_layer": rate(lambda: torch.matmul(x, w_layer.t(), out=o_layer), 2.0 * T * h * w_layer.shape[0]),
           "bytes": rate(lambda: torch.exp(logits, out=buf), 2.0 * logits.numel() * 4)}
    act = torch.zeros(T, h)
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    ts = []
    for _ in range(11):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(act, peer)
            dist.recv(act, peer)
        elif rank == 1:
            dist.recv(act, peer)
            dist.send(act, peer)
        ts.append((time.perf_counter() - t0) / 2 * 1e3)
    out["p2p_ms"] = statistics.median(ts[1:])
    return out


# ------------------------------------------------------------------------------------ the driver
@dataclass
class Measured:
    """One variant over the rounds: iteration ms per round, per-rank parameter and peak bytes, the load
    average before each run's pair, the iteration ms its own profile predicts per round
    (:func:`profile_prediction`), the last round's "measured ..." report lines."""

    iter_ms: list[float] = field(default_factory=list)
    param_bytes: list[int] = field(default_factory=list)
    decoder_bytes: list[int] = field(default_factory=list)
    peak_bytes: list[list[int]] = field(default_factory=list)
    loads: list[str] = field(default_factory=list)
    profile_ms: list[float] = field(default_factory=list)
    measured: list[str] = field(default_factory=list)


def _iteration_ms(lines: list[str], measure_from: int) -> float:
    from ..training.logging_utils import parse_iteration_line

    vals = [r["elapsed time per iteration (ms)"] for r in map(parse_iteration_line, lines)
            if r["iteration"] >= measure_from]
    if not vals:
        raise RuntimeError(f"no iteration line from iteration {measure_from} on")
    return statistics.median(vals)


def run_variant(spec: VocabBenchSpec, v: Variant) -> dict[str, Any]:
    """One run of ``v`` on ``spec.pp`` ranks: ``{"iter_ms", "param_bytes": [per rank], "peak_bytes": [...]}``."""
    from ..testing import run_distributed

    ranks = run_distributed(bench_rank, world_size=spec.pp, args=(spec.argv() + list(v.flags), v.defer_t_weight),
                            timeout=spec.timeout)
    lines = [ln for r in ranks for ln in r["lines"]]
    return {"iter_ms": _iteration_ms(lines, spec.measure_from), "param_bytes": [r["param_bytes"] for r in ranks],
            "decoder_bytes": [r["decoder_bytes"] for r in ranks],
            "peak_bytes": [r["peak_bytes"] for r in ranks], "profile_ms": ranks[0]["profile_ms"],
            "measured": ranks[0]["measured"]}


def predict(spec: VocabBenchSpec, calib: dict[str, float], vs: Sequence[Variant]) -> dict[str, float]:
    """The planner's iteration time (ms) of every variant on the calibrated CPU (module doc)."""
    from ..planning.hardware import resolve_hardware
    from ..planning.model import make_model, make_parallel
    from ..planning.planner import plan
    from ..planning.vocab import output_layer_in_layers

    out_layers = output_layer_in_layers(vocab_size=spec.vocab, hidden_size=spec.hidden, seq_length=spec.seq)
    share = out_layers / (out_layers + spec.num_layers)  # FLOP share of the output layer
    flops_per_ms = 1.0 / (share / calib["gemm_output"] + (1 - share) / calib["gemm_layer"])
    hw = resolve_hardware(tflops=flops_per_ms / 1e9, memory_gib=16, hbm_gbs=calib["bytes"] / 1e6, tp_gbs=1.0,
                          p2p_gbps=1e6, p2p_latency_ms=calib["p2p_ms"], mfu=1.0, hbm_efficiency=1.0)
    model = make_model(num_layers=spec.num_layers, hidden_size=spec.hidden, num_attention_heads=spec.heads,
                       seq_length=spec.seq, micro_batch_size=spec.micro_batch, vocab_size=spec.vocab,
                       precision="fp32", hidden_dropout=0.0, attention_dropout=0.0,
                       position_embedding_type=spec.position_embedding, max_position_embeddings=spec.seq)
    out: dict[str, float] = {}
    for split in sorted({v.split for v in vs}):
        par = make_parallel(model, pp=spec.pp, num_microbatches=spec.microbatches,
                            account_for_embedding_in_pipeline_split=split, account_for_loss_in_pipeline_split=split)
        names = sorted({v.planned for v in vs if v.split == split})
        res = plan(model=model, parallel=par, hardware=hw, schedules=names, enable_vocab_parallel=True)
        fams = {f.name: f for f in res.families}
        for v in vs:
            f = fams.get(v.planned)
            if v.split == split and f is not None and f.status == "ok":
                out[v.label] = f.iteration_time_ms
    return out


def _units(vs: Sequence[Variant]) -> list[list[Variant]]:
    """The variants grouped as they run back to back: each base with its vocabulary variant (and that one's
    ``-deferred`` variant), others alone."""
    units: list[list[Variant]] = []
    for v in vs:
        if v.base is not None and units and any(u.label == v.base for u in units[-1]):
            units[-1].append(v)
        else:
            units.append([v])
    return units


def wait_for_load(limit: float | None, max_wait_s: float, *, log: Any = sys.stderr) -> str:
    """Wait (up to ``max_wait_s`` seconds) until the 1-minute load average is below ``limit``; the
    load average (``/proc/loadavg``'s three numbers) when it returns."""
    t0 = time.perf_counter()
    while True:
        with open("/proc/loadavg") as f:
            load = f.read().split()[:3]
        if limit is None or float(load[0]) < limit or time.perf_counter() - t0 >= max_wait_s:
            return " ".join(load)
        stamped(f"vocab bench: load average {load[0]} >= {limit:g}, waiting", stream=log)
        time.sleep(20)


def run_rounds(spec: VocabBenchSpec, vs: Sequence[Variant], *, wait_load: float | None = None,
               max_wait_s: float = 0.0, log: Any = sys.stderr) -> dict[str, Measured]:
    """``spec.rounds`` rounds; in each, every pair runs back to back (base first in odd rounds, the
    vocabulary variant first in even ones), the order of the pairs rotated by one each round. Before
    each pair: :func:`wait_for_load` with ``wait_load`` / ``max_wait_s``. On ``log``: a line per run, and
    while it runs one every :data:`HEARTBEAT_S` seconds (:func:`.progress.heartbeat`)."""
    got = {v.label: Measured() for v in vs}
    units = _units(vs)
    for r in range(spec.rounds):
        k = r % len(units)
        for unit in units[k:] + units[:k]:
            load = wait_for_load(wait_load, max_wait_s, log=log)
            for v in (unit if r % 2 == 0 else unit[::-1]):
                t0 = time.perf_counter()
                with heartbeat(f"vocab bench: round {r + 1}/{spec.rounds} {v.label}", every_s=HEARTBEAT_S, stream=log):
                    res = run_variant(spec, v)
                m = got[v.label]
                m.iter_ms.append(res["iter_ms"])
                m.param_bytes = res["param_bytes"]
                m.decoder_bytes = res["decoder_bytes"]
                m.peak_bytes.append(res["peak_bytes"])
                m.loads.append(load)
                if res["profile_ms"] is not None:
                    m.profile_ms.append(res["profile_ms"])
                m.measured = res["measured"]
                stamped(f"vocab bench: round {r + 1}/{spec.rounds} {v.label}: {res['iter_ms']:.1f} ms/iteration "
                        f"(run {time.perf_counter() - t0:.0f} s, load average before the pair {load})", stream=log)
    return got


def _mib(x: float) -> str:
    return f"{x / 2**20:.1f}"


def report(spec: VocabBenchSpec, vs: Sequence[Variant], got: dict[str, Measured],
           predicted: dict[str, float]) -> list[str]:
    """The table and the acceptance lines (markdown, as docs/vocab_parallel.md records them)."""
    lines = ["| variant | iter ms (median of rounds) | predicted ms | predicted / measured | profile-predicted ms "
             "(median of rounds) | profile-predicted / measured | throughput vs pair (paired median) | "
             "param MiB per rank | param max/min | outside the transformer blocks MiB per rank | peak RSS growth MiB per rank |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    speedup: dict[str, float] = {}
    for v in vs:
        m = got[v.label]
        t = statistics.median(m.iter_ms)
        pred = predicted.get(v.label)
        pair = "-"
        if v.base is not None:
            ratios = [b / x for b, x in zip(got[v.base].iter_ms, m.iter_ms)]
            speedup[v.label] = statistics.median(ratios)
            pair = f"{speedup[v.label]:.2f}x {v.base}"
        peaks = [max(p[i] for p in m.peak_bytes) for i in range(spec.pp)]
        prof = statistics.median(m.profile_ms) if m.profile_ms else None
        lines.append(f"| {v.label} | {t:.0f} | {'-' if pred is None else f'{pred:.0f}'} | "
                     f"{'-' if pred is None else f'{pred / t:.2f}'} | {'-' if prof is None else f'{prof:.0f}'} | "
                     f"{'-' if prof is None else f'{prof / t:.2f}'} | {pair} | "
                     f"{' / '.join(_mib(b) for b in m.param_bytes)} | "
                     f"{max(m.param_bytes) / min(m.param_bytes):.4f} | "
                     f"{' / '.join(_mib(b - d) for b, d in zip(m.param_bytes, m.decoder_bytes))} | "
                     f"{' / '.join(_mib(b) for b in peaks)} |")
    lines.append("")
    bases = {v.label: v.base for v in vs}
    for name, x in speedup.items():
        lines.append(f"{name}: {x:.2f}x the throughput of {bases[name]} (paired median over {spec.rounds} rounds)")
    if "zbv-vocab-1" in got and MEGATRON_SPLIT in got:
        ratios = [b / x for b, x in zip(got[MEGATRON_SPLIT].iter_ms, got["zbv-vocab-1"].iter_ms)]
        lines.append(f"zbv-vocab-1: {statistics.median(ratios):.2f}x the throughput of {MEGATRON_SPLIT}")
    for v in vs:
        if v.base is not None:
            rest = {b - d for b, d in zip(got[v.label].param_bytes, got[v.label].decoder_bytes)}
            lines.append(f"{v.label}: parameters outside the transformer blocks equal on every rank: "
                         + (f"yes ({rest.pop()} bytes each)" if len(rest) == 1 else f"no ({sorted(rest)} bytes)"))
    off = [v.label for v in vs if v.label in predicted
           and abs(predicted[v.label] / statistics.median(got[v.label].iter_ms) - 1) > 0.10]
    lines.append("simulator within 10% of every measured iteration: " + ("yes" if not off else
                                                                        f"no ({', '.join(off)})"))
    off = [v.label for v in vs if got[v.label].profile_ms and abs(
        statistics.median(got[v.label].profile_ms) / statistics.median(got[v.label].iter_ms) - 1) > 0.10]
    lines.append("simulator from each run's own profile within 10% of every measured iteration it predicts: "
                 + ("yes" if not off else f"no ({', '.join(off)})"))
    for v in vs:
        if got[v.label].measured:
            lines += [f"{v.label}, last round's profile (rank 0's report):"] + [
                f"    {ln}" for ln in got[v.label].measured]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (the only place with an argparse namespace); prints the table."""
    d = VocabBenchSpec()
    p = argparse.ArgumentParser(prog="python -m megatron_zb.bench vocab", description=__doc__.split("\n\n")[0])
    for name in ("num_layers", "hidden", "heads", "seq", "vocab", "micro_batch", "microbatches", "pp", "iters",
                 "measure_from", "rounds"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name),
                       help=f"default {getattr(d, name)}")
    p.add_argument("--timeout", type=float, default=d.timeout, help=f"seconds per run (default {d.timeout:g})")
    p.add_argument("--position-embedding-type", dest="position_embedding", default=d.position_embedding,
                   choices=("rope", "learned_absolute"), help=f"Megatron-LM's flag (default {d.position_embedding}: no "
                                                              "position-embedding table, so every rank's parameters "
                                                              "with the flag are its slices and its layers)")
    p.add_argument("--schedules", default="1f1b,zb-h1,zbv",
                   help="base schedules, each run with and without its -vocab-1 schedule (default 1f1b,zb-h1,zbv; a "
                        "base whose -vocab-1 schedule is not registered is left out)")
    p.add_argument("--wait-load", type=float, default=None, metavar="X",
                   help="before each pair, wait for a 1-minute load average below X (default: do not wait)")
    p.add_argument("--max-wait", type=float, default=600.0, metavar="S",
                   help="seconds to wait for --wait-load at most, per pair (default 600)")
    p.add_argument("--deferred", action="store_true",
                   help="also run each ZB-H1/ZB-V vocabulary schedule with T's weight gradient queued for a W "
                        "(VocabParallelModel.defer_t_weight), paired with it")
    p.add_argument("--no-megatron-split", action="store_true",
                   help=f"leave out {MEGATRON_SPLIT} (megatron-core's 1F1B with {' '.join(SPLIT_FLAGS)})")
    a = p.parse_args(argv)
    spec = VocabBenchSpec(**{k: getattr(a, k) for k in asdict(d)})
    if not 1 <= spec.measure_from <= spec.iters:
        p.error(f"--measure-from {spec.measure_from} must be in 1..--iters {spec.iters}")
    vs = variants([s.strip() for s in a.schedules.split(",") if s.strip()], megatron_split=not a.no_megatron_split,
                  deferred=a.deferred)
    if not vs:
        p.error("no variant to run")
    from ..testing import run_distributed

    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"vocab bench: {spec.describe()}; {len(vs)} variants x {spec.rounds} rounds; load average {load}")
    with heartbeat("vocab bench: calibration", every_s=HEARTBEAT_S):
        ranks = run_distributed(calibrate_rank, world_size=spec.pp, args=(asdict(spec),), timeout=spec.timeout)
    calib = {k: statistics.median(r[k] for r in ranks) for k in ranks[0]}
    print("calibration (median over ranks): " + ", ".join(f"{k} {v:.4g}" for k, v in calib.items())
          + " (FLOP/ms, FLOP/ms, bytes/ms, ms)")
    predicted = predict(spec, calib, vs)
    got = run_rounds(spec, vs, wait_load=a.wait_load, max_wait_s=a.max_wait)
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print("\n".join(report(spec, vs, got, predicted)))
    print(f"load average at the end: {load}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

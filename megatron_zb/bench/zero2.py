"""``python -m megatron_zb.bench zero2``: sharded gradients (ZeRO-2) measured on CPU (issue 42).

Runs ``pretrain_gpt_zb.py``'s own path (:func:`~megatron_zb.training.pretrain.parse_command_line` and the
:class:`~megatron_zb.training.trainer.Trainer`) in-process on :func:`~megatron_zb.testing.run_distributed`
ranks (gloo, one thread each) at PP=2 x DP=2 with bf16 parameters, the greedy zero-bubble schedule and
megatron-core's distributed optimizer with its overlapped reduce and gather:

* ``distributed optimizer``: the whole gradient buffer (``--data-parallel-sharding-strategy no_shard``);
* ``optim_grads K=k``: sharded gradients with W groups of ``k`` micro batches, for each ``k`` of ``--groups``.

Per run: the iteration time (median of the logged "elapsed time per iteration" from ``--measure-from`` on),
each rank's model-state bytes measured from its storages (:func:`~megatron_zb.training.model_state.model_state_bytes`:
parameters, gradients, optimizer state), and with sharded gradients the reduce-scatters per bucket in the last
iteration. ``--rounds`` rounds run every variant once each; a variant's time ratio is the median over rounds
of its time over the distributed optimizer's in the same round (paired). Progress: a line per run and a
heartbeat while one goes. First, untimed: the planner's prediction per variant and its recommended ``K``
(:mod:`.zero2_predict`, from a profile of the baseline and a measured reduce-scatter), printed beside the
measured times.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from .progress import heartbeat
from .progress import log as stamped

__all__ = ["Zero2Spec", "bench_rank", "main", "variants"]

BASELINE = "distributed optimizer"
HEARTBEAT_S = 5.0


@dataclass(frozen=True)
class Zero2Spec:
    """The benchmark's model and run (sizes in elements; ``microbatches`` per data-parallel rank)."""

    num_layers: int = 8
    hidden: int = 256
    heads: int = 8
    seq: int = 128
    vocab: int = 1024
    micro_batch: int = 1
    microbatches: int = 8
    bucket_size: int = 262144
    iters: int = 8
    measure_from: int = 4
    rounds: int = 2
    groups: tuple[int, ...] = (1, 2, 4, 8)
    timeout: float = 900.0

    def describe(self) -> str:
        return (f"GPT {self.num_layers} layers, hidden {self.hidden}, {self.heads} heads, seq {self.seq}, vocab "
                f"{self.vocab}, untied, bf16; PP=2 x DP=2, {self.microbatches} micro batches of {self.micro_batch} "
                f"per data-parallel rank, buckets of {self.bucket_size} elements, {self.iters} iterations "
                f"(timed from {self.measure_from})")

    def argv(self) -> list[str]:
        return ["--num-layers", str(self.num_layers), "--hidden-size", str(self.hidden),
                "--num-attention-heads", str(self.heads), "--seq-length", str(self.seq),
                "--tokenizer-type", "NullTokenizer", "--vocab-size", str(self.vocab - 1),
                "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--bf16",
                "--micro-batch-size", str(self.micro_batch),
                "--global-batch-size", str(self.micro_batch * self.microbatches * 2),
                "--train-iters", str(self.iters), "--lr", "1e-4", "--mock-data", "--num-workers", "0",
                "--log-interval", "1", "--eval-iters", "0", "--distributed-backend", "gloo",
                "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer", "--overlap-grad-reduce",
                "--overlap-param-gather", "--ddp-bucket-size", str(self.bucket_size), "--enable-zero-bubble",
                "--zero-bubble-pipeline-timers-start-iter", str(self.iters + 1),
                "--zero-bubble-pipeline-timers-end-iter", str(self.iters + 2)]


def variants(spec: Zero2Spec) -> dict[str, list[str]]:
    """Variant name -> its flags beyond :meth:`Zero2Spec.argv` (the baseline first)."""
    out = {BASELINE: []}
    for k in spec.groups:
        out[f"optim_grads K={k}"] = ["--data-parallel-sharding-strategy", "optim_grads",
                                     "--zero-bubble-wgrad-group", str(k)]
    return out


def bench_rank(argv: list[str]) -> dict[str, Any]:
    """One rank of one run: its iteration lines, model-state bytes and (sharded) reduce-scatters per bucket."""
    import contextlib
    import io

    import torch.distributed as dist

    from ..runtime.sharded_grads import sharded_chunks
    from ..training.model_state import model_state_bytes
    from ..training.pretrain import parse_command_line
    from ..training.trainer import Trainer

    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        validated = parse_command_line(argv, world_size=dist.get_world_size())
        trainer = Trainer(validated.args, schedule=validated.schedule)
        try:
            assert trainer.run() == 0
            state = asdict(model_state_bytes(trainer.model.modules, trainer.optim.inner))
            found = sharded_chunks(trainer.model.modules)
            reduces = None
            if found is not None:
                counts = [sum(1 for b, _ in s.reduce_log if b == i)
                          for s in found.values() for i in range(len(s.buckets))]
                reduces = (min(counts), max(counts), len(counts))
        finally:
            trainer.close()
    lines = [ln for ln in log.getvalue().splitlines() if "elapsed time per iteration" in ln]
    return {"state": state, "reduces": reduces, "lines": lines,
            "schedule": validated.schedule if dist.get_rank() == 0 else None}


def _iteration_ms(lines: list[str], first: int) -> float:
    import re

    times = {int(m.group(1)): float(m.group(2)) for ln in lines
             if (m := re.search(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)", ln))}
    return statistics.median(t for i, t in times.items() if i >= first)


def prediction(spec: Zero2Spec, workdir: str) -> list[Any]:
    """The planner's rows (:mod:`.zero2_predict`): an untimed baseline run with ``--profile-out``, then the
    data-parallel reduce-scatter measured."""
    from ..testing import run_distributed
    from .zero2_predict import measure_reduce_scatter, predict

    path = f"{workdir}/zero2_profile.json"
    flags = ["--zero-bubble-pipeline-timers-start-iter", "2", "--zero-bubble-pipeline-timers-end-iter",
             str(spec.iters), "--profile-out", path]
    with heartbeat("zero2: profiling the distributed optimizer's run (untimed)", every_s=HEARTBEAT_S):
        ranks = run_distributed(bench_rank, world_size=4, args=(spec.argv() + flags,), timeout=spec.timeout)
        reduce_ms = run_distributed(measure_reduce_scatter, world_size=4, args=(spec.bucket_size,),
                                    timeout=spec.timeout)[0]
    stamped(f"zero2: reduce-scatter over 2 ranks: {reduce_ms[0]:.3f} ms (1 element), {reduce_ms[1]:.3f} ms "
            f"({spec.bucket_size} fp32 elements)")
    return predict(path, ranks[0]["schedule"], bucket_elements=spec.bucket_size, groups=spec.groups,
                   reduce_ms=reduce_ms)


def run(spec: Zero2Spec) -> dict[str, dict[str, Any]]:
    """Every variant, ``spec.rounds`` times (paired per round); per variant its results."""
    from ..testing import run_distributed

    base = spec.argv()
    found: dict[str, dict[str, Any]] = {name: {"ms": [], "ratio": []} for name in variants(spec)}
    for r in range(spec.rounds):
        times: dict[str, float] = {}
        for name, flags in variants(spec).items():
            with heartbeat(f"zero2 round {r + 1}/{spec.rounds}: {name}", every_s=HEARTBEAT_S):
                ranks = run_distributed(bench_rank, world_size=4, args=(base + flags,), timeout=spec.timeout)
            times[name] = _iteration_ms(next(x["lines"] for x in ranks if x["lines"]), spec.measure_from)
            found[name]["ms"].append(times[name])
            found[name]["states"] = [x["state"] for x in ranks]
            found[name]["reduces"] = ranks[0]["reduces"]
            stamped(f"zero2 round {r + 1}/{spec.rounds}: {name} {times[name]:.1f} ms per iteration")
        for name in found:
            found[name]["ratio"].append(times[name] / times[BASELINE])
    return found


def table(spec: Zero2Spec, found: dict[str, dict[str, Any]], predicted: list[Any]) -> str:
    """The Markdown table of the results, with the planner's predicted iteration time per variant."""
    rows = ["| variant | iteration (ms, median) | time / distributed optimizer (paired median) | model state per "
            "parameter, bytes (max over ranks) | gradient bytes (max over ranks) | reduce-scatters per bucket | "
            "planner's prediction (ms) | predicted / measured |",
            "|---|---|---|---|---|---|---|---|"]
    pred = {BASELINE if r.k is None else f"optim_grads K={r.k}": r.iteration_time_ms for r in predicted}
    for name, v in found.items():
        states = v["states"]
        per_param = max((s["params"] + s["grads"] + s["optimizer"]) / s["num_params"] for s in states)
        grads = max(s["grads"] for s in states)
        red = v["reduces"]
        reduces = "1 (at the end)" if red is None else (f"{red[0]}" if red[0] == red[1] else f"{red[0]}-{red[1]}")
        ms = statistics.median(v["ms"])
        rows.append(f"| {name} | {ms:.1f} | {statistics.median(v['ratio']):.3f} | "
                    f"{per_param:.2f} | {grads} | {reduces} | {pred[name]:.1f} | {pred[name] / ms:.3f} |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_zb.bench zero2", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=Zero2Spec.rounds, help="paired rounds (default %(default)s)")
    p.add_argument("--groups", type=int, nargs="+", default=list(Zero2Spec.groups),
                   help="W group sizes K to run (each must divide --microbatches; default %(default)s)")
    p.add_argument("--microbatches", type=int, default=Zero2Spec.microbatches,
                   help="micro batches per data-parallel rank (default %(default)s)")
    p.add_argument("--num-layers", type=int, default=Zero2Spec.num_layers, help="(default %(default)s)")
    p.add_argument("--hidden", type=int, default=Zero2Spec.hidden, help="(default %(default)s)")
    p.add_argument("--iters", type=int, default=Zero2Spec.iters, help="iterations per run (default %(default)s)")
    p.add_argument("--measure-from", type=int, default=Zero2Spec.measure_from,
                   help="first timed iteration (default %(default)s)")
    a = p.parse_args(argv)
    spec = Zero2Spec(rounds=a.rounds, groups=tuple(a.groups), microbatches=a.microbatches, num_layers=a.num_layers,
                     hidden=a.hidden, iters=a.iters, measure_from=a.measure_from)
    stamped(f"zero2: {spec.describe()}; {len(variants(spec))} variants x {spec.rounds} rounds")
    import tempfile

    from ..planning.sharded import choose_group
    with tempfile.TemporaryDirectory() as workdir:
        predicted = prediction(spec, workdir)
    found = run(spec)
    pick = choose_group(predicted)
    print(f"Sharded gradients on CPU: {spec.describe()}\n\n{table(spec, found, predicted)}\n\n"
          f"planner's recommendation among K = {', '.join(map(str, spec.groups))}: "
          f"{'none fits' if pick is None else f'K={pick.k}'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The torch-pipelining benchmark (``megatron_zb/bench/torch_pipelining.py``) end to end on 2 gloo
processes at a tiny size: every schedule asked for is run, measured and reported. Its times are not
checked (performance lives in the benchmark's own runs, docs/torch_pipelining.md); what is checked
is that the run and the report cover what the docs read from them."""

from __future__ import annotations

import math
from functools import partial

import pytest

pytest.importorskip("torch.distributed.pipelining")

from megatron_zb.bench.torch_pipelining import TorchBenchConfig, bench_rank, report  # noqa: E402
from megatron_zb.testing.distributed import run_distributed  # noqa: E402
from megatron_zb.testing.torch_pipelining import LMConfig  # noqa: E402


def test_the_benchmark_runs_every_schedule_and_reports_the_bar():
    """4 microbatches (``ScheduleDualPipeV`` builds from m = 2p), 2 rounds, 1 profiled iteration: each
    built-in and each of ours (``auto``, and ``auto`` re-planned at ``ScheduleDualPipeV``'s measured
    memory) has a time per round and a peak on every rank; ``auto`` compared PyTorch's V orders among
    its candidates; the report has the rows, the V built-ins' predictions and the bar's line."""
    bc = TorchBenchConfig(pp=2, microbatches=4, rounds=2, profile_iterations=1,
                          model=LMConfig(dtype="float32"), builtins=("ScheduleZBVZeroBubble", "ScheduleDualPipeV"),
                          ours=("auto", "auto@ScheduleDualPipeV"))
    res = run_distributed(partial(bench_rank, bc), world_size=2, timeout=300, threads=1,
                          preload=("torch", "torch.distributed", "megatron_zb"))
    r0 = res[0]
    labels = list(r0["times"])
    assert labels[:2] == ["ScheduleZBVZeroBubble", "ScheduleDualPipeV"] and len(labels) == 4
    assert labels[2].startswith("auto: ") and labels[3].startswith("auto: ") and labels[3].endswith("@ScheduleDualPipeV")
    assert all(len(t) == 2 and all(x > 0 and math.isfinite(x) for x in t) for t in r0["times"].values())
    assert all(r["peaks"][k] > 0 for r in res for k in labels)
    assert list(r0["choices"]) == labels[2:]
    for rows in r0["choices"].values():
        assert {"1f1b-v", "zbv", "torch:ScheduleZBVZeroBubble", "torch:ScheduleDualPipeV"} == {n for n, _, _ in rows}
    text = report(bc, res)
    assert all(f"| {k} |" in text for k in labels)
    assert "PyTorch's V orders predicted by our simulator" in text and "ScheduleDualPipeV predicted" in text
    assert "'s peak activation memory" in text  # the bar's line: ours at or below the fastest built-in's memory

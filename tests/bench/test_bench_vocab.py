"""Smoke test of ``python -m megatron_zb.bench vocab`` (megatron_zb/bench/vocab.py) at a tiny size.

Structure only (no timing is asserted: performance lives in the benchmark, docs/vocab_parallel.md):
both sides of the 1F1B pair run through ``pretrain_gpt_zb.py``'s parse and Trainer on two gloo
ranks, the table has its columns and a row per variant with a measured iteration, a prediction,
per-rank parameter bytes (and those outside the transformer blocks: equal on every rank with the flag) and peak memory, the prediction from the run's own profile (with the
vocabulary passes' measured costs), and the paired speed-up line.
"""

from __future__ import annotations

import re

from megatron_zb.bench.__main__ import BENCHMARKS
from megatron_zb.bench.vocab import main as vocab_main
from megatron_zb.bench.vocab import variants

TINY = ["--num-layers", "2", "--hidden", "32", "--heads", "4", "--seq", "16", "--vocab", "512", "--microbatches",
        "4", "--iters", "4", "--measure-from", "4", "--rounds", "1", "--schedules", "1f1b", "--no-megatron-split"]


def test_variants_pair_each_base_with_its_registered_vocab_schedule():
    vs = variants(["1f1b", "zb-h1"])
    labels = [v.label for v in vs]
    assert labels[:4] == ["1f1b", "1f1b-vocab-1", "zb-h1", "zb-h1-vocab-1"]
    assert labels[-1] == "megatron-1f1b-split"
    assert {v.label: v.base for v in vs}["zb-h1-vocab-1"] == "zb-h1"
    assert "--enable-vocab-parallel" in dict((v.label, v.flags) for v in vs)["1f1b-vocab-1"]
    deferred = variants(["1f1b", "zbv"], megatron_split=False, deferred=True)
    assert [(v.label, v.base, v.defer_t_weight) for v in deferred] == [
        ("1f1b", None, False), ("1f1b-vocab-1", "1f1b", False), ("zbv", None, False), ("zbv-vocab-1", "zbv", False),
        ("zbv-vocab-1-deferred", "zbv-vocab-1", True)]  # 1F1B's fused backward has no W to defer into


def test_bench_vocab_tiny_prints_both_sides(capsys):
    assert BENCHMARKS["vocab"].module == "megatron_zb.bench.vocab"  # its --help: tests/bench/test_bench.py
    assert vocab_main(TINY) == 0
    out = capsys.readouterr().out
    header = next(ln for ln in out.splitlines() if ln.startswith("| variant |"))
    assert header.count("|") == 12
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]]
            for ln in out.splitlines() if ln.startswith("| 1f1b")}
    assert set(rows) == {"1f1b", "1f1b-vocab-1"}
    for name, cells in rows.items():
        measured, predicted, ratio, profiled, profiled_ratio, _, params, spread, outside, peaks = cells
        assert float(measured) > 0 and float(predicted) > 0 and float(ratio) > 0, (name, cells)
        assert float(profiled) > 0 and float(profiled_ratio) > 0, (name, cells)  # the run's own profile
        assert len(params.split(" / ")) == 2 and len(peaks.split(" / ")) == 2, (name, cells)
        assert float(spread) >= 1.0 and len(outside.split(" / ")) == 2
    assert rows["1f1b-vocab-1"][5].endswith("x 1f1b")
    assert re.search(r"^1f1b-vocab-1: \d+\.\d\dx the throughput of 1f1b", out, re.M)
    # rope (the default): with the flag every rank holds the same parameters besides its layers -- its slice
    assert re.search(r"^1f1b-vocab-1: parameters outside the transformer blocks equal on every rank: yes \(\d+ bytes each\)",
                     out, re.M)
    assert "simulator within 10% of every measured iteration:" in out
    assert "simulator from each run's own profile within 10% of every measured iteration it predicts:" in out
    assert "    measured vocabulary passes per rank (ms, without their waits): T_IF=[" in out

"""Building blocks of the benchmark section ``dp`` (megatron_zb.bench.dp).

The section itself runs 8 processes for about a minute on a quiet machine (several under load),
too long for the suite; ``python scripts/benchmark.py --quick --sections dp`` runs it.
"""

from __future__ import annotations

import pytest
import torch

import megatron_zb  # noqa: F401  (CPU shim)
from megatron_zb.bench.dp import DPBenchSpec, DPStage, dp_prediction, fit_reduce
from megatron_zb.bench.emulated import SleepClock
from megatron_zb.runtime.wgrad_store import WeightGradStore


def test_fit_reduce_through_two_sizes():
    # 10 ms for 4e6 bytes and 3.25 ms for 1e6: slope 6.75 ms / 3e6 B, latency 10 - 9 = 1 ms
    lat, bw = fit_reduce(10.0, 3.25, 4e6, 1e6)
    assert lat == pytest.approx(1.0) and bw == pytest.approx(4e6 / 9.0)
    assert fit_reduce(10.0, 12.0, 4e6, 1e6) == (0.0, pytest.approx(4e5))  # noise: one bandwidth
    with pytest.raises(ValueError, match="two different sizes"):
        fit_reduce(1.0, 1.0, 1e6, 1e6)


def test_prediction_buckets_as_megatron_core_makes_them():
    """4 weights per rank's share: zb's stage 0 has 4 buckets, every other stage one; on the V
    stage 0 has 2 (its chunk holds 2 weights) and rank 0's second chunk one. 4 bytes per rank at
    1 byte/ms with 0.5 ms per collective: rank 0 of zb reduces 4 x 0.5 + 4 = 6 ms, rank 1 4.5 ms;
    without overlap all of it comes after the rank's compute."""
    spec = DPBenchSpec(t_f=0.001, t_b=0.001, t_w=0.001)
    for name, counts, totals in (("zb", [4, 1, 1, 1], [6.0, 4.5, 4.5, 4.5]), ("zbv", [3, 2, 2, 2], [5.5, 5, 5, 5])):
        pred = dp_prediction(name, spec, t_f=1.0, t_b=1.0, t_w=1.0, t_comm=0.0, grad_bytes=4.0, latency=0.5,
                             bandwidth=1.0)
        assert [len(r.buckets) for r in pred.overlapped] == counts
        assert [r.total for r in pred.serial] == pytest.approx(totals)
        assert [r.exposed for r in pred.serial] == pytest.approx(totals)
        assert pred.hideable >= 0 and pred.time_serial == pytest.approx(max(
            r.compute_end + t for r, t in zip(pred.serial, totals)))


def test_stage_defers_one_w_entry_per_weight_last_weight_first():
    """B queues one entry per weight (last first) and hands DDP a placeholder gradient flagged as
    already in main_grad; W adds 1 into each main_grad."""
    stage = DPStage(stage=0, num_stages=1, num_weights=3, numel=5, t_f=0.0, t_b=0.0, t_w=0.0, shape=(2, 1, 4),
                    clock=SleepClock(enabled=False), config=None)
    for w in stage.weights:
        w.main_grad = torch.zeros_like(w)
    store, order = WeightGradStore(), []
    loss = stage()
    with store.deferring(0, 0):
        loss.backward()
    assert all(w.grad_added_to_main_grad and w.grad is not None for w in stage.weights)
    for fn, params in store._queues[(0, 0)]:
        order.append(next(i for i, w in enumerate(stage.weights) if w is params[0]))
    assert order == [2, 1, 0]
    assert all(float(w.main_grad.sum()) == 0 for w in stage.weights)
    assert store.run(0, 0) == 3
    assert all(torch.equal(w.main_grad, torch.ones(5)) for w in stage.weights)
    with pytest.raises(RuntimeError, match="split backward"):
        stage().backward()

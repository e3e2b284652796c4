"""Building blocks of the benchmark section ``dp`` (megatron_zb.bench.dp).

The section itself runs 8 processes for about a minute on a quiet machine (several under load),
too long for the suite; ``python scripts/benchmark.py --quick --sections dp`` runs it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import megatron_zb  # noqa: F401  (CPU shim)
from megatron_zb.bench.dp import DPBenchSpec, DPStage, bench_costs, fit_reduce, reduce_model
from megatron_zb.bench.dp_report import DPFigures, dp_prediction, rank_figures
from megatron_zb.bench.emulated import SleepClock
from megatron_zb.runtime.wgrad_store import WeightGradStore
from megatron_zb.schedules.dp_reduce import RankReduce
from megatron_zb.schedules.ir import Op
from megatron_zb.schedules.registry import build_schedule


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
    unit = {Op.F: 1.0, Op.B: 1.0, Op.W: 1.0}
    for name, counts, totals in (("zb", [4, 1, 1, 1], [6.0, 4.5, 4.5, 4.5]), ("zbv", [3, 2, 2, 2], [5.5, 5, 5, 5])):
        model = reduce_model(name, spec, grad_bytes=4.0, latency=0.5, bandwidth=1.0)
        sched = build_schedule(name, num_ranks=4, num_microbatches=8, costs=bench_costs(name, spec, t_comm=0.0))
        pred = dp_prediction(sched, durations=unit, t_comm=0.0, model=model)
        assert [len(r.buckets) for r in pred.overlapped] == counts
        assert [r.total for r in pred.serial] == pytest.approx(totals)
        assert [r.exposed for r in pred.serial] == pytest.approx(totals)
        assert pred.hideable >= 0 and pred.time_serial == pytest.approx(max(
            r.compute_end + t for r, t in zip(pred.serial, totals)))


def _record(compute_end: float, synced: float, launches: tuple[float, ...] = ()) -> dict:
    return dict(start=0.0, end=synced, compute_end=compute_end, synced=synced,
                launches=[(0, i, t) for i, t in enumerate(launches)])


def test_rank_figures_pair_off_and_on_of_the_same_round():
    """Seconds in, ms out; two data-parallel replicas per round. The group's exposed reduce runs
    from its later compute end to its later sync: round 1 off 1.100 - 1.000 = 100 ms (replica
    2 ended its compute at 0.990 and waited), on 2.040 - 2.000 = 40; round 2 200 and 180; round
    3 110 and 30. Hidden = median of the paired differences (60, 20, 80 -> 60), not the
    difference of the medians (110 - 40 = 70). Lead = the group's compute end - the later
    replica's first launch: 2.000 - 1.960 = 40, 4.000 - 3.990 = 10, 6.000 - 5.970 = 30 -> 30.
    Predicted: serial 90 exposed, overlapped 30 (hideable 60); the first bucket ready 25 ms
    before the compute ended."""
    rounds = [([_record(1.0, 1.100), _record(0.990, 1.099)],
               [_record(2.0, 2.040, (1.95,)), _record(1.998, 2.039, (1.96,))]),
              ([_record(3.0, 3.200), _record(3.0, 3.200)],
               [_record(4.0, 4.180, (3.99, 3.995)), _record(4.0, 4.180, (3.985,))]),
              ([_record(5.0, 5.110), _record(4.9, 5.105)],
               [_record(6.0, 6.030, (5.97,)), _record(5.95, 6.030, (5.9,))])]
    off = RankReduce(rank=0, compute_end=100.0, buckets=[(0, 100.0, 100.0, 190.0)])
    on = RankReduce(rank=0, compute_end=100.0, buckets=[(0, 75.0, 75.0, 100.0), (0, 100.0, 100.0, 130.0)])
    f = rank_figures(0, rounds, off, on)
    assert f.exposed_off == pytest.approx(110.0) and f.exposed_on == pytest.approx(40.0)
    assert f.hidden == pytest.approx(60.0) and f.hidden_range == pytest.approx((20.0, 80.0))
    assert (f.predicted_off, f.predicted_on, f.hideable) == pytest.approx((90.0, 30.0, 60.0))
    assert f.lead == pytest.approx(30.0) and f.predicted_lead == pytest.approx(25.0)
    assert f.target == pytest.approx(60.0)   # no in-run figure: the start-up fit's
    # rank 1: nothing hideable at the in-run speed; its -10 ms change is reported apart
    figs = DPFigures(name="zbv", reduce_tf=1.0, reduce_ms=90.0, off=0.0, on=0.0, predicted_off=0.0, predicted_on=0.0,
                     ranks=[dataclasses.replace(f, hideable_in_run=100.0),
                            dataclasses.replace(f, rank=1, hidden=-10.0, hideable_in_run=0.0)])
    assert (figs.hidden, figs.others, figs.hideable_in_run, figs.hideable) == pytest.approx((60.0, -10.0, 100.0, 120.0))
    assert figs.fraction == pytest.approx(0.6) and figs.verdict(t_f=30.0) == "PASS"
    assert dataclasses.replace(figs, ranks=[dataclasses.replace(f, hideable_in_run=130.0)]).verdict(t_f=30.0) == "FAIL"
    assert dataclasses.replace(figs, ranks=[dataclasses.replace(f, hideable_in_run=2.0)]).verdict(t_f=30.0) == "-"


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

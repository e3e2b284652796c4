"""The profiling window's numbers for the vocabulary-parallel passes (docs/vocab_parallel.md, "The flag"):
``T``'s deferred weight gradients taken out of the ``W``'s that run them, ``t_collective`` from the
forward barriers, and the :class:`~megatron_zb.schedules.costs.VocabCosts` the re-plan
uses -- every expected value worked by hand from the given times. The end-to-end run (a real window on 2
gloo ranks, the re-planned schedule installed) is ``tests/runtime/test_vocab_runtime.py``'s pretrain test."""

from __future__ import annotations

import pytest

from megatron_zb.runtime.action_timing import ActionTiming
from megatron_zb.schedules import Action, Op
from megatron_zb.training.profiling import ActionProfile, AgreedProfile, collective_ms, cost_model


def _rank1_iteration() -> ActionTiming:
    """One iteration of rank 1 (plain placement, p = 2: stage 1), microbatch 0, seconds. The collectives
    (and their waits) are program steps between the actions; the W ran T's weight gradient (3 ms) and the
    forward barrier of microbatch 0 took 4 ms, both timed with ``ActionTiming.interval`` (here set by hand)."""
    timing = ActionTiming()
    timing.records = [(Action(Op.F, 0, 1), 0.000, 0.004), (Action(Op.S, 0, 1), 0.006, 0.010),
                      (Action(Op.T, 0, 1), 0.015, 0.020), (Action(Op.B, 0, 1), 0.021, 0.025),
                      (Action(Op.W, 0, 1), 0.025, 0.030), (Action(Op.IB, 0, 1), 0.031, 0.032)]
    timing.host_intervals.update({("TW", 1, 0): 0.003, ("C0", 0): 0.004})
    return timing


def test_ts_weight_gradient_is_taken_out_of_the_w_that_ran_it():
    profile = ActionProfile()
    profile.add(_rank1_iteration(), elapsed=0.032)
    ms = profile.medians_ms()
    want = {("F", 1): 4.0, ("S", 1): 4.0, ("T", 1): 5.0, ("B", 1): 4.0, ("W", 1): 2.0, ("IB", 1): 1.0,
            ("TW", 1): 3.0}  # TW: T's weight gradient per W of stage 1 (one W ran 3 ms of it)
    assert ms == pytest.approx(want)
    assert profile.busy == pytest.approx(0.020)  # the actions' own 20 ms: T's W part counted apart
    assert profile.barriers == [{0: 0.004}]


def test_t_collective_is_the_median_of_the_shortest_barrier_over_the_ranks():
    # per microbatch the rank that reached the barrier last waits only for the collectives: min over ranks
    rank0 = [{0: 0.004, 1: 0.001}, {0: 0.006}]
    rank1 = [{0: 0.002, 1: 0.003}, {0: 0.005}]
    assert collective_ms([rank0, rank1]) == pytest.approx(2.0)  # median of 2, 1, 5 ms
    assert collective_ms([[], []]) is None


def test_the_cost_model_holds_the_measured_vocabulary_costs():
    costs_ms = {("F", 0): 2.0, ("F", 1): 3.0, ("B", 0): 2.5, ("B", 1): 3.5, ("W", 0): 1.0, ("W", 1): 1.5,
                ("IF", 0): 0.2, ("IF", 1): 0.3, ("S", 0): 4.0, ("S", 1): 5.0, ("T", 0): 6.0, ("T", 1): 7.0,
                ("IB", 0): 0.4, ("IB", 1): 0.5, ("TW", 1): 2.0}
    agreed = AgreedProfile(costs_ms=costs_ms, t_comm=0.1, idle_fraction=[0.0, 0.0], iterations=1,
                           action_overhead_ms=0.25, t_collective=0.75)
    costs = cost_model(agreed, num_stages=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                       max_pending_microbatches=None, num_ranks=2)
    v = costs.vocab
    assert list(v.t_if) == pytest.approx([0.45, 0.55]) and list(v.t_s) == pytest.approx([4.25, 5.25])
    assert list(v.t_t) == pytest.approx([6.25, 7.25]) and list(v.t_ib) == pytest.approx([0.65, 0.75])
    assert v.t_collective == 0.75 and v.mem_s == 0.0
    assert list(costs.t_w) == pytest.approx([1.25, 3.75])  # stage 1's W also runs T's weight gradient (2 ms each)
    assert list(costs.t_f) == pytest.approx([2.25, 3.25])
    without = cost_model(agreed, num_stages=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                         max_pending_microbatches=None)  # not a vocabulary-parallel run
    assert without.vocab is None and list(without.t_w) == pytest.approx([1.25, 1.75])
    missing = AgreedProfile(costs_ms={k: c for k, c in costs_ms.items() if k != ("IB", 1)}, t_comm=0.1,
                            idle_fraction=[0.0, 0.0], iterations=1)
    assert cost_model(missing, num_stages=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                      max_pending_microbatches=None, num_ranks=2).vocab is None  # IB of rank 1 not timed

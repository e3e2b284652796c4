"""Vocabulary parallelism for the searched families (schedules/generators/vocab_family.py): ``zb``, ``zb-1p``,
``zb-2p`` (greedy, plain placement) and ``v-half``, ``v-min`` (V placement), each ``-vocab-1`` and ``-vocab-2``:
valid (the IR's validators, validate_vocab included; lowering), in the order the runtime needs, within
the family's limit plus ``extra`` microbatches, and timed against hand-worked bounds. No torch."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_zb.cli import main
from megatron_zb.planning.vocab import base_family
from megatron_zb.schedules import CostModel, Op, ScheduleError, lower, simulate
from megatron_zb.schedules.costs import VocabCosts
from megatron_zb.schedules.generators.baselines import one_f_one_b_order
from megatron_zb.schedules.generators.vocab import deepen, place_vocab_passes
from megatron_zb.schedules.ir import B, F, Placement, W, make_schedule, plain_placement, v_placement, validate
from megatron_zb.schedules.lowering import check_lowered
from megatron_zb.schedules.registry import build_schedule, get_spec, vocab_schedule_names

BASES = {"zb": Placement.PLAIN, "zb-1p": Placement.PLAIN, "zb-2p": Placement.PLAIN, "v-half": Placement.V,
         "v-min": Placement.V}
NAMES = {f"{b}-vocab-{v}": (b, 3 - v) for b in BASES for v in (1, 2)}   # name -> (base family, barriers)
VC = VocabCosts(t_if=0.05, t_s=0.5, t_t=0.5, t_ib=0.05, t_collective=0.1)
PLAIN = CostModel(mem_w=0.0, vocab=VC)
"""Unit transformer stages (T_F = T_B = T_W = 1, M_B = 1, M_W = 0); each rank's slice: IF 0.05, S 0.5,
T 0.5, IB 0.05 (1.1 per microbatch), collectives 0.1."""
V = CostModel(t_f=0.5, t_b=0.5, t_w=0.5, mem_b=0.5, mem_w=0.0, vocab=VC)
"""The same model on the V: a chunk is half a plain stage (one microbatch's share of a rank M = 1)."""


def _costs(name: str, **kw) -> CostModel:
    base = PLAIN if BASES[NAMES[name][0]] is Placement.PLAIN else V
    return replace(base, **kw)


def test_registered_and_paired_with_their_family():
    for name, (base, barriers) in NAMES.items():
        spec = get_spec(name)
        assert spec.vocab_parallel and spec.split_backward and spec.placement is BASES[base], name
        assert name in vocab_schedule_names() and base_family(name) == base   # the planner's pairing
    zb, zb_1p = (build_schedule(n, num_ranks=4, num_microbatches=8, costs=PLAIN) for n in ("zb-vocab-1", "zb-1p-vocab-1"))
    assert zb.ranks == zb_1p.ranks                           # zb-1p is zb at zb's default limit (p M_B)


def test_deepen_by_hand():
    """1F1B's order deepened by k is 1F1B with k more warm-up forwards (1f1b-vocab's base); a V rank's
    two chunks move by k microbatches each (p=1: stages 0 and 1 on the one rank, m=3, k=1)."""
    for p, m, k in ((4, 8, 1), (3, 12, 2), (2, 2, 1)):
        got = deepen(one_f_one_b_order(p, m, warmup=[p - r for r in range(p)]), k)
        assert got == one_f_one_b_order(p, m, warmup=[p - r + k for r in range(p)]), (p, m, k)
    row = [F(0, 0), F(0, 1), B(0, 1), W(0, 1), B(0, 0), F(1, 0), F(1, 1), B(1, 1), B(1, 0), F(2, 0), F(2, 1),
           B(2, 1), B(2, 0), W(1, 1), W(2, 1), W(0, 0), W(1, 0), W(2, 0)]
    # before B(0,1) the base ran one forward of each stage: now two of each (F1 of both chunks moved up)
    want = [F(0, 0), F(0, 1), F(1, 0), F(1, 1), B(0, 1), W(0, 1), B(0, 0), F(2, 0), F(2, 1), B(1, 1), B(1, 0),
            B(2, 1), B(2, 0), W(1, 1), W(2, 1), W(0, 0), W(1, 0), W(2, 0)]
    assert deepen([row], 1) == [want]


def test_validity_order_and_passes():
    from megatron_zb.runtime.vocab_runtime import check_vocab_schedule

    for name, (base, barriers) in NAMES.items():
        costs = _costs(name)
        for p, m in ((2, 4), (3, 5)):
            s = build_schedule(name, num_ranks=p, num_microbatches=m, costs=costs)
            want = v_placement(p) if BASES[base] is Placement.V else plain_placement(p)
            assert s.stage_to_rank == want and s.vocab_barriers == barriers
            validate(s)                                        # the IR's rules, validate_vocab included
            check_vocab_schedule(s)                            # first stage's B, last stage's F in order
            for r, acts in enumerate(s.ranks):
                for op in (Op.IF, Op.S, Op.T, Op.IB):
                    assert [(a.mb, a.stage) for a in acts if a.op is op] == [(i, r) for i in range(m)], (name, p, r)
            low = lower(s)
            check_lowered(low)
            assert low.compute_only().ranks == s.ranks
            simulate(s, costs)                                 # raises on a deadlock


@pytest.mark.parametrize("base", BASES)
def test_peak_is_the_familys_plus_extra_microbatches(base):
    """The module docstring: at most the base family's peak (and its limit) plus ``extra`` microbatches
    (M = 1 here), ``extra <= barriers``, plus ``mem_s`` per S in flight; for M_W = 0 and 1 M_B."""
    for mem_w in (0.0, 1.0):
        for p, m in ((2, 4), (3, 12)):
            costs = _costs(f"{base}-vocab-1", mem_w=mem_w * _costs(f"{base}-vocab-1").mem_b)
            fam = build_schedule(base, num_ranks=p, num_microbatches=m, costs=costs)
            fam_peak = simulate(fam, costs).peak_memory
            for variant in (1, 2):
                name = f"{base}-vocab-{variant}"
                s = build_schedule(name, num_ranks=p, num_microbatches=m, costs=costs)
                extra = s.meta["extra_warmup"]
                assert 0 <= extra <= NAMES[name][1]
                peaks = simulate(s, costs).peak_memory
                assert max(peaks) <= fam.meta["memory_limit"] + extra + 1e-9, (name, mem_w, p, m)
                assert all(a <= b + extra + 1e-9 for a, b in zip(peaks, fam_peak)), (name, mem_w, p, m)
    name = f"{base}-vocab-1"
    with_s = _costs(name, vocab=VocabCosts(t_collective=0.1, mem_s=0.25))
    s = build_schedule(name, num_ranks=4, num_microbatches=8, costs=with_s)
    fam = build_schedule(base, num_ranks=4, num_microbatches=8, costs=with_s)
    assert max(simulate(s, with_s).peak_memory) <= fam.meta["memory_limit"] + s.meta["extra_warmup"] + 0.25 * 8


def test_explicit_limit_caps_the_whole_peak():
    for name, limit in (("zb-2p-vocab-1", 5.0), ("v-half-vocab-2", 3.0)):
        costs = _costs(name)
        s = build_schedule(name, num_ranks=4, num_microbatches=8, costs=costs, memory_limit=limit)
        assert max(simulate(s, costs).peak_memory) <= limit, name
    with pytest.raises(ScheduleError, match="memory_limit"):           # below the family's minimum
        build_schedule("zb-vocab-1", num_ranks=4, num_microbatches=8, costs=PLAIN, memory_limit=0.5)


@pytest.mark.parametrize("name", ["zb-vocab-1", "zb-vocab-2", "zb-2p-vocab-1"])
def test_explicit_limit_leaves_room_for_the_slices_in_flight(name):
    """M_W = M_B = 1 (a microbatch holds its 1 from F until its W) and ``mem_s`` = 0.5: a base built at
    ``X - extra x M`` holds ``X - extra`` microbatches at its peak, ``extra`` more deepened, and a slice's S
    in flight beside them makes 4.5 > X = 4 for every ``extra`` (the rule before ``k x mem_s``: "below the
    least peak"); a base at least one ``mem_s`` lower leaves the room, and ``X`` is met."""
    costs = _costs(name, mem_w=1.0, vocab=replace(VC, mem_s=0.5))
    s = build_schedule(name, num_ranks=2, num_microbatches=8, costs=costs, memory_limit=4.0)
    assert max(simulate(s, costs).peak_memory) <= 4.0
    assert s.meta["base_memory_limit"] <= 4.0 - s.meta["extra_warmup"] - 0.5


def test_makespan_against_hand_worked_bounds():
    """p=4, m=16. Every rank's work per microbatch is 3 + 1.1 = 4.1 (plain; on the V 6 chunk actions of
    0.5), so no schedule ends before 16 x 4.1 = 65.6: the vocabulary families end within 6% (greedy) /
    10% (V) of it. Without vocabulary parallelism the last plain stage carries the output layer (all 4
    slices' S and T: T_F = T_B = 3) and ends no earlier than 16 x (3 + 3 + 1) = 112 (the V's rank 0: 16 x
    7.2 = 115.2): over 1.5x longer. The extra warm-up pays: the family's order with the passes but no
    extra microbatch (extra = 0) is at least 3% longer (greedy: over 20%)."""
    p, m = 4, 16
    heavy = {Placement.PLAIN: CostModel(t_f=[1.2, 1, 1, 3], t_b=[1, 1, 1, 3], t_w=[1.2, 1, 1, 1], mem_w=0.0),
             Placement.V: CostModel(t_f=[0.6] + [0.5] * 6 + [2.5], t_b=[0.5] * 7 + [2.5], t_w=[0.6] + [0.5] * 7,
                                    mem_b=0.5, mem_w=0.0)}
    for base, placement in BASES.items():
        if base == "zb-1p":
            continue                                            # zb's order at zb's default limit
        costs = _costs(f"{base}-vocab-1")
        without = simulate(build_schedule(base, num_ranks=p, num_microbatches=m, costs=heavy[placement]),
                           heavy[placement]).makespan
        s2r = v_placement(p) if placement is Placement.V else plain_placement(p)
        fam = build_schedule(base, num_ranks=p, num_microbatches=m, costs=costs)
        for variant, barriers in ((1, 2), (2, 1)):
            name = f"{base}-vocab-{variant}"
            got = simulate(build_schedule(name, num_ranks=p, num_microbatches=m, costs=costs), costs).makespan
            assert 65.6 <= got <= (1.06 if placement is Placement.PLAIN else 1.16) * 65.6, (name, got)
            assert without >= 112 and without > 1.5 * got, (name, without, got)
            no_extra = make_schedule(num_microbatches=m, stage_to_rank=s2r, vocab_barriers=barriers,
                                     ranks=place_vocab_passes(fam.ranks, s2r, m, costs, barriers))
            gain = 1.2 if placement is Placement.PLAIN else 1.03
            assert simulate(no_extra, costs).makespan > gain * got, name
    one = simulate(build_schedule("1f1b-vocab-1", num_ranks=p, num_microbatches=m, costs=PLAIN), PLAIN).makespan
    two = simulate(build_schedule("zb-2p-vocab-1", num_ranks=p, num_microbatches=m, costs=PLAIN), PLAIN).makespan
    assert two < 0.95 * one                                     # ZB-2p's zero bubble survives the passes


def test_small_shapes_are_deadlock_free():
    """p = 1..3, m = 1, p + 1 and 2p + 1, M_W = M_B, uneven pass costs with S memory: every family builds and simulates
    (``zb-1p``: ``zb``'s order at ``zb``'s default limit, left out)."""
    vc = VocabCosts(t_if=0.05, t_s=0.4, t_t=0.6, t_ib=0.05, t_collective=0.2, mem_s=0.1)
    for name in NAMES:
        if name.startswith("zb-1p"):
            continue
        costs = _costs(name, t_comm=0.1, mem_w=_costs(name).mem_b, vocab=vc)
        for p in range(1, 4):
            for m in (1, p + 1, 2 * p + 1):
                simulate(build_schedule(name, num_ranks=p, num_microbatches=m, costs=costs), costs)


def test_cli_builds_them(capsys):
    for name in ("zb-2p-vocab-1", "v-min-vocab-2"):
        assert main(["schedule", "--schedule", name, "--pp", "2", "--microbatches", "4"]) == 0
        assert "S output layer forward" in capsys.readouterr().out

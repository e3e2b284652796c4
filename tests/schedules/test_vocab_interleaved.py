"""Interleaved 1F1B and interleaved ZB with vocabulary parallelism (``interleaved-1f1b-vocab-1/2``,
``interleaved-zb-vocab-1/2``; schedules/generators/vocab_interleaved.py): Megatron's virtual-pipeline
placement with every rank's IF/S/T/IB, valid (the IR's validators, lowering), deadlock-free in the
simulator, the extra warm-up's gain and its memory, and the planner's pairing. No torch."""

from __future__ import annotations

import pytest

from megatron_zb.planning.vocab import base_family
from megatron_zb.schedules import CostModel, Op, ScheduleError, lower, simulate
from megatron_zb.schedules.costs import VocabCosts
from megatron_zb.schedules.ir import Placement, interleaved_placement, make_schedule, validate
from megatron_zb.schedules.lowering import check_lowered
from megatron_zb.schedules.registry import build_schedule, get_spec

NAMES = {"interleaved-1f1b-vocab-1": 2, "interleaved-1f1b-vocab-2": 1, "interleaved-zb-vocab-1": 2,
         "interleaved-zb-vocab-2": 1}  # name -> all-reduce barriers
COSTS = CostModel(t_f=1.0, t_b=1.2, t_w=0.7, t_comm=0.1, mem_b=1.0, mem_w=0.5,
                  vocab=VocabCosts(t_if=0.05, t_s=0.4, t_t=0.6, t_ib=0.05, t_collective=0.2, mem_s=0.1))
DOCS = CostModel(t_f=0.5, t_b=0.5, t_w=0.5, mem_b=0.5, mem_w=0.25,
                 vocab=VocabCosts(t_if=0.05, t_s=0.5, t_t=0.5, t_ib=0.05, t_collective=0.1))
"""docs/vocab_parallel_schedules.md's costs with the model in 8 chunks of half a plain stage (p=4, v=2)."""


@pytest.mark.parametrize("name", NAMES)
def test_every_small_shape_is_valid_and_deadlock_free(name):
    """p = 1..4, v = 2 and 3, m = 1..2p+1 (incomplete microbatch groups included): the IR's rules, every
    pass once per (microbatch, rank) in microbatch order, each transformer action once, the first stage's
    backwards and the last stage's forwards in microbatch order (the runtime's broadcasts), lowering, and
    the simulator (raises on a deadlock)."""
    spec = get_spec(name)
    assert spec.placement is Placement.INTERLEAVED and spec.vocab_parallel
    assert spec.split_backward == ("-zb-" in name) and base_family(name) in ("interleaved-1f1b", "interleaved-zb")
    for p, v in [(1, 2), (2, 2), (3, 2), (4, 2), (2, 3)]:
        for m in range(1, 2 * p + 2):
            s = build_schedule(name, num_ranks=p, num_microbatches=m, costs=COSTS, num_chunks=v)
            assert s.stage_to_rank == interleaved_placement(p, v) and s.vocab_barriers == NAMES[name]
            validate(s)
            for r, acts in enumerate(s.ranks):
                for op in (Op.IF, Op.S, Op.T, Op.IB):
                    assert [(a.mb, a.stage) for a in acts if a.op is op] == [(i, r) for i in range(m)]
                for stage in range(r, p * v, p):
                    ops = (Op.F, Op.B, Op.W) if spec.split_backward else (Op.F, Op.BW)
                    for op in ops:
                        assert sorted(a.mb for a in acts if a.op is op and a.stage == stage) == list(range(m))
            first = [a.mb for a in s.ranks[0] if a.stage == 0 and a.op in (Op.B, Op.BW)]
            last = [a.mb for a in s.ranks[p - 1] if a.stage == p * v - 1 and a.op is Op.F]
            assert first == last == list(range(m)), (name, p, v, m)
            if m == p + 1:
                check_lowered(lower(s))
            assert simulate(s, COSTS).makespan > 0


def test_the_extra_warm_up_pays_and_what_it_holds():
    """Simulated, p=4, m=16, v=2, the docs' costs: Megatron's interleaved warm-up with the passes placed
    (extra = 0, the best ZB delay) is more than 10% longer than the generator's choice, which is within 3% of
    the busiest rank's work (16 x (3 + 1.1) = 65.6, as ZB-V's) for the ZB pair; each rank holds its base
    order's peak (interleaved 1F1B's, in stage M_B: rank r 5.5 - r) plus ``extra`` chunks (0.5 each), plus
    what a delayed W keeps (interleaved ZB: at most M_W = 0.25 per delayed W)."""
    from megatron_zb.schedules.generators.baselines import interleaved_1f1b_order
    from megatron_zb.schedules.generators.interleaved_zb import split_with_delay
    from megatron_zb.schedules.generators.vocab import place_vocab_passes
    from megatron_zb.schedules.ir import Schedule

    p, m, v, s2r = 4, 16, 2, interleaved_placement(4, 2)
    for name, b in NAMES.items():
        s = build_schedule(name, num_ranks=p, num_microbatches=m, costs=DOCS, num_chunks=v)
        res = simulate(s, DOCS)
        extra = s.meta["extra_warmup"]
        assert 1 <= extra <= b, (name, extra)
        bases = [interleaved_1f1b_order(p, m, v, 0)]
        if "-zb-" in name:
            bases = [split_with_delay(Schedule(m, s2r, bases[0], "x"), d) for d in ([0] * p, list(range(p)))]
            assert res.makespan <= 1.03 * 65.6, (name, res.makespan)
        without = min(simulate(make_schedule(num_microbatches=m, stage_to_rank=s2r, vocab_barriers=b,
                                             ranks=place_vocab_passes(o, s2r, m, DOCS, b)), DOCS).makespan
                      for o in bases)
        assert without > 1.1 * res.makespan, (name, without, res.makespan)
        for r, peak in enumerate(res.peak_memory):
            base = 5.5 - r + 0.5 * extra
            if "-zb-" in name:
                assert base <= peak <= base + 0.25 * v * r, (name, r, peak)
            else:
                assert peak == base, (name, r, peak)


def test_explicit_limit_and_refusals():
    """A limit keeps only the candidates that fit (the least extra warm-up and no W delay at the least);
    below every candidate it is refused naming the least peak."""
    from megatron_zb.schedules.generators.vocab_interleaved import vocab_interleaved

    free = build_schedule("interleaved-zb-vocab-1", num_ranks=4, num_microbatches=8, costs=DOCS)
    tight = build_schedule("interleaved-zb-vocab-1", num_ranks=4, num_microbatches=8, costs=DOCS, memory_limit=5.5)
    assert tight.meta["extra_warmup"] == 0 and max(simulate(tight, DOCS).peak_memory) <= 5.5
    assert simulate(tight, DOCS).makespan > simulate(free, DOCS).makespan
    with pytest.raises(ScheduleError, match="memory_limit 5 is below the least peak of interleaved-1f1b-vocab-2 "
                                            r"\(5.5, Megatron's interleaved warm-up\)"):
        build_schedule("interleaved-1f1b-vocab-2", num_ranks=4, num_microbatches=8, costs=DOCS, memory_limit=5.0)
    with pytest.raises(ScheduleError, match="variant must be 1"):
        vocab_interleaved(num_ranks=2, num_microbatches=2, variant=3)


def test_planner_pairs_them_with_their_base():
    """``megatron-zb plan --enable-vocab-parallel``: each interleaved vocabulary family is planned and
    reported beside its base family (2 chunks per rank at PP=2)."""
    from megatron_zb.planning.hardware import resolve_hardware
    from megatron_zb.planning.model import make_model, make_parallel
    from megatron_zb.planning.planner import plan

    model = make_model(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=1,
                       vocab_size=1000, precision="fp32")
    hw = resolve_hardware(tflops=0.001, memory_gib=16, hbm_gbs=1000, tp_gbs=1, p2p_gbps=8, p2p_latency_ms=0.5,
                          mfu=1.0, hbm_efficiency=1.0)
    names = ["interleaved-1f1b", "interleaved-zb", "interleaved-1f1b-vocab-1", "interleaved-zb-vocab-2"]
    res = plan(model=model, parallel=make_parallel(model, pp=2, num_microbatches=4), hardware=hw, schedules=names,
               enable_vocab_parallel=True)
    got = {f.name: f for f in res.families}
    assert all(got[n].status == "ok" for n in names), {n: got[n].reason for n in names}
    assert got["interleaved-1f1b-vocab-1"].vocab_base == "interleaved-1f1b"
    assert got["interleaved-zb-vocab-2"].vocab_base == "interleaved-zb" and got["interleaved-zb"].vocab_base is None
    assert got["interleaved-zb-vocab-2"].chunks == 2


def test_docs_table_rows():
    """docs/vocab_parallel_schedules.md's simulated comparison, interleaved rows (p=4, m=16, v=2: chunks of
    half a plain stage): with the passes, makespan and per-rank peak (stage M_B) as the table states (rank r:
    interleaved 1F1B's 5.5 - r plus ``extra`` chunks); without them (the embedding on chunk 0, the output
    layer on chunk 7 of rank 3, as the table's ``zbv`` row) interleaved 1F1B and ZB are over 1.5x longer."""
    rows = {"interleaved-1f1b-vocab-1": (70.2, [6.5, 5.5, 4.5, 3.5]), "interleaved-1f1b-vocab-2": (70.2, [6, 5, 4, 3]),
            "interleaved-zb-vocab-1": (67.25, [6, 5.25, 4.5, 3.75]),
            "interleaved-zb-vocab-2": (67.15, [6, 5.25, 4.5, 3.75])}
    for name, (makespan, peaks) in rows.items():
        res = simulate(build_schedule(name, num_ranks=4, num_microbatches=16, costs=DOCS, num_chunks=2), DOCS)
        assert res.makespan == pytest.approx(makespan) and res.peak_memory == pytest.approx(peaks), name
    last = CostModel(t_f=[0.7] + [0.5] * 6 + [2.5], t_b=[0.5] * 7 + [2.5], t_w=[0.7] + [0.5] * 7, mem_b=0.5,
                     mem_w=0.25)
    for name, makespan in (("interleaved-1f1b", 118.1), ("interleaved-zb", 112.5)):
        res = simulate(build_schedule(name, num_ranks=4, num_microbatches=16, costs=last, num_chunks=2), last)
        assert res.makespan == pytest.approx(makespan) and makespan > 1.5 * rows[name + "-vocab-1"][0], name

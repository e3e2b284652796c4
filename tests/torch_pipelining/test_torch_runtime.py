"""megatron-zb schedules built for the user's stages and re-planned inside PyTorch's runtime
(megatron_zb.torch_pipelining.runtime and .profiling), on 2 gloo processes.

PyTorch 2.13's own ``_PipelineScheduleRuntime`` runs every step; the expected losses and gradients
come from the unpipelined float64 model (``testing.torch_pipelining.reference``), and the re-planned
schedule is judged by PyTorch's ``_validate_schedule``, lowering and simulator
(``export.torch_lowering``). Dropout is off (testing/torch_pipelining.py says why).
"""

from __future__ import annotations

import math
import time
from functools import partial

import pytest

pytest.importorskip("torch.distributed.pipelining")

import torch  # noqa: E402
from torch.distributed.pipelining import schedules as ts  # noqa: E402

from megatron_zb.schedules.costs import CostModel  # noqa: E402
from megatron_zb.schedules.registry import build_schedule  # noqa: E402
from megatron_zb.testing.distributed import run_distributed  # noqa: E402
from megatron_zb.testing.torch_pipelining import LMConfig, reference  # noqa: E402
from megatron_zb.schedules.ir import B, F, Placement, Schedule, W  # noqa: E402
from megatron_zb.schedules.fusion import fuse_adjacent  # noqa: E402
from megatron_zb.schedules.simulator import simulate  # noqa: E402
from megatron_zb.schedules.torch_import import import_torch_schedule  # noqa: E402
from harness.torch_runtime import api_rank, fsdp_rank  # noqa: E402
from megatron_zb.torch_pipelining.choice import choose_schedule, placement_of  # noqa: E402
from megatron_zb.torch_pipelining.export import TorchExportError, torch_lowering  # noqa: E402
from megatron_zb.torch_pipelining.profiling import action_overhead_ms  # noqa: E402
from megatron_zb.torch_pipelining.runtime import runtime_costs, stages_for_rank  # noqa: E402

M = 4
RTOL = 1e-12
"""Relative tolerance against the unpipelined model, per tensor (norm of the difference / norm of the
reference): the pipeline sums the microbatches' gradients in its own order and scales by 1/m in
place, float64 rounding of which is ~m * 2.2e-16 relative; a lost or doubled microbatch is O(1/m)."""


def _check(result: dict, ref_losses: list, ref_grads: dict, label: str) -> None:
    grads = {k: g for r in result for k, g in r["grads"].items()}
    losses = [v for r in result for v in r["losses"]]
    assert set(grads) == set(ref_grads), label
    assert len(losses) == M and all(torch.allclose(a, b, rtol=RTOL, atol=0) for a, b in zip(losses, ref_losses)), label
    for k, g in grads.items():
        assert (g - ref_grads[k]).norm() <= RTOL * ref_grads[k].norm(), (label, k)


@pytest.fixture(scope="module")
def api_results() -> list:
    """One 2-process run for the API tests below (one process start for both)."""
    t0 = time.perf_counter()
    res = run_distributed(partial(api_rank, LMConfig(), M, ("zb-1p", "zbv"), "zbv", True), world_size=2,
                          timeout=240, preload=("torch", "torch.distributed", "megatron_zb"))
    print(f"distributed part, 2 processes: {time.perf_counter() - t0:.1f} s")
    return res


def test_build_profile_replan_and_refusals_on_2_processes(api_results):
    """``build_pipeline`` runs zb-1p and zbv; ``profile_and_replan`` measures every stage inside the
    runtime and reloads a re-planned zbv that PyTorch validates and that still computes the same
    step; DDP-wrapped and compiled stage modules are refused in one line."""
    cfg = LMConfig()
    res = api_results
    ref_losses, ref_grads = reference(cfg, M)
    for name in ("zb-1p", "zbv"):
        _check([r[name] for r in res], ref_losses, ref_grads, name)

    rep = [r["replan"] for r in res]
    assert rep[0]["medians"] == rep[1]["medians"] and rep[0]["after"] == rep[1]["after"]  # agreed on every rank
    medians, after = rep[0]["medians"], rep[0]["after"]
    n = after.num_stages
    assert n == 4 and all(r["loaded"] for r in rep)
    for s in range(n):  # measured inside the runtime, I and W apart on every stage
        assert {("F", s), ("B", s), ("W", s)} <= set(medians), s
        assert rep[0]["t_w"][s] > 0 and medians[("W", s)] > 0
    # PyTorch's I frees none of what F saved (runtime_costs' mem_w = mem_b) on every stage but the last,
    # whose I frees what the loss saved (its log-softmax of the logits), not more than half
    nbytes = rep[0]["bytes"]
    assert rep[1]["bytes"] == nbytes
    assert all(nbytes[("F", s)] > 0 for s in range(n))
    assert [nbytes[("B", s)] for s in range(n - 1)] == [0.0] * (n - 1), nbytes
    assert -0.5 * nbytes[("F", n - 1)] <= nbytes[("B", n - 1)] < 0, nbytes
    mem_w, mem_b = rep[0]["mem_w"], rep[0]["mem_b"]  # measured_costs' mem_b and mem_w follow
    assert mem_w[:-1] == mem_b[:-1] and 0.5 * mem_b[-1] <= mem_w[-1] < mem_b[-1]
    # mem_b: the stages' measured M_B relative to each other, in the given unit (unit costs: mean 1);
    # the loss stage, which also saves the logits, the largest
    assert sum(mem_b) == pytest.approx(n, rel=1e-12)
    for s in range(n):
        assert mem_b[s] / mem_b[0] == pytest.approx(nbytes[("F", s)] / nbytes[("F", 0)], rel=1e-12), s
    assert mem_b[-1] == max(mem_b) > mem_b[1]
    # stage 0's quirk, measured: PyTorch's I on stage 0 computes nothing, its W the whole backward
    assert medians[("B", 0)] < 0.25 * medians[("W", 0)]
    assert medians[("B", 0)] < 0.25 * min(medians[("B", s)] for s in range(1, n))
    for r in rep:  # every timed iteration ran every (op, stage) of that rank once per microbatch,
        # and each stage's REDUCE_GRAD once
        assert {v for (op, _), v in r["samples"].items() if op != "R"} == {2 * M}
        assert {v for (op, _), v in r["samples"].items() if op == "R"} == {2}
    assert after.num_stages == 4 and rep[0]["dp_reduce"] is None  # no FSDP: no reduce modelled
    lowered = torch_lowering(after)  # PyTorch's _validate_schedule, lowering and simulator
    assert any(a.computation_type == ts.BACKWARD_INPUT for acts in lowered.values() for a in acts)
    _check([r["step"] for r in rep], ref_losses, ref_grads, "zbv after re-planning")

    for r, res_r in enumerate(res):
        msgs = res_r["refused"]
        assert set(msgs) == {"ddp", "compiled", "compiled_in_place"}, msgs
        assert all("\n" not in v for v in msgs.values())
        assert msgs["ddp"].startswith(f"stage {r}'s module is wrapped in DistributedDataParallel")
        assert "pytorch issue 144530" in msgs["ddp"] and "fused-backward schedule (1f1b" in msgs["ddp"]
        for label in ("compiled", "compiled_in_place"):
            assert msgs[label].startswith(f"stage {r}'s module is compiled (torch.compile)")
            assert "pass the module uncompiled" in msgs[label]


def test_fsdp2_on_a_2x2_cpu_mesh():
    """FSDP2 (``fully_shard``) stages over a data-parallel pair, pipelined by PyTorch's runtime with
    our zb-1p and zbv (4 gloo processes: 2 pipeline ranks x 2 replicas, each replica its own batch):
    losses per replica and gradients -- the mean of the two replicas' unpipelined gradients --
    as the unpipelined float64 model computes them; the re-planned zbv's costs hold FSDP's
    reduce as their data-parallel reduce: each stage's gradient bytes (its parameters x 8 bytes,
    counted on the unsharded modules), one bucket, overlapped, at the bandwidth of the measured
    REDUCE_GRAD calls. Each stage module is sharded as one unit; blocks sharded one by one are
    refused on every rank (PyTorch 2.13 loses or corrupts their gradients under a split backward)."""
    cfg = LMConfig()
    res = run_distributed(partial(fsdp_rank, cfg, M, ("zb-1p", "zbv"), "zbv"), world_size=4, timeout=300,
                          preload=("torch", "torch.distributed", "megatron_zb"))
    refs = [reference(cfg, M, replica=d) for d in (0, 1)]
    mean_grads = {k: (refs[0][1][k] + refs[1][1][k]) / 2 for k in refs[0][1]}
    for name in ("zb-1p", "zbv"):
        for d in (0, 1):
            mine = [r for r in res if r["dp"] == d]
            losses = [v for r in mine for v in r[name]["losses"]]
            assert len(losses) == M and all(torch.allclose(a, b, rtol=RTOL, atol=0)
                                            for a, b in zip(losses, refs[d][0])), (name, d)
            grads = {k: g for r in mine for k, g in r[name]["grads"].items()}
            assert set(grads) == set(mean_grads), name
            for k, g in grads.items():
                assert (g - mean_grads[k]).norm() <= RTOL * mean_grads[k].norm(), (name, d, k)
    rep = [r["replan"] for r in res]
    assert all(r["loaded"] for r in rep)
    assert all(r["after"].ranks == rep[0]["after"].ranks for r in rep)  # one schedule, every replica
    assert all(r["no_dp_group"].startswith("the stages are FSDP-sharded") and "data_parallel_group=" in r["no_dp_group"]
               for r in res)
    model = rep[0]["dp_reduce"]
    assert model is not None and all(r["dp_reduce"] == model for r in rep)
    params = {s: c for r in rep for s, c in r["stage_params"].items()}
    assert sorted(params) == [0, 1, 2, 3]
    assert list(model.stage_bytes) == [8.0 * params[s] for s in range(4)]  # float64 gradients
    assert model.bucket_bytes is None and model.overlap and model.latency == 0
    r_ms = [rep[0]["medians"][("R", s)] for s in range(4)]
    assert model.bandwidth == pytest.approx(sum(model.stage_bytes) / sum(r_ms), rel=1e-12)
    for d in (0, 1):  # the re-planned schedule still computes the same step
        mine = [r["replan"]["step"] for r in res if r["dp"] == d]
        assert all(torch.allclose(a, b, rtol=RTOL, atol=0)
                   for a, b in zip([v for r in mine for v in r["losses"]], refs[d][0]))
        for k, g in {k: g for r in mine for k, g in r["grads"].items()}.items():
            assert (g - mean_grads[k]).norm() <= RTOL * mean_grads[k].norm(), ("after re-planning", d, k)
    # every rank refuses: pipeline rank 1's ranks (their blocks sharded one by one) naming their stage,
    # the others naming the pipeline rank that refused
    msgs = [r["refused"] for r in res]
    assert all(m is not None and "\n" not in m and "fully_shard each stage's module as one unit" in m for m in msgs)
    own = "stage 1's module has fully_shard-ed submodules (blocks.2"
    assert sorted(m.startswith(own) for m in msgs) == [False, False, True, True], msgs
    assert all(m.startswith(own) or m.startswith("pipeline rank 1: " + own) for m in msgs), msgs


def test_auto_measures_split_and_fused_backwards_and_chooses_on_2_processes(api_results):
    """``build_pipeline(..., "auto")`` on V-placed stages: one step; ``profile_and_replan`` times the
    loaded order once with every backward split (PyTorch's I, W) and once fused (its B), so every
    stage has T_F, T_I, T_W and T_B (fused) and the measured costs' ``t_bw`` is the fused medians;
    the choice after it is the best-predicted candidate, agreed on both ranks, and still computes
    the unpipelined model's losses and gradients."""
    cfg = LMConfig()
    res = [r["auto"] for r in api_results]
    ref_losses, ref_grads = reference(cfg, M)
    _check([r["first"] for r in res], ref_losses, ref_grads, "auto")
    _check([r["step"] for r in res], ref_losses, ref_grads, "auto after re-planning")
    r0 = res[0]
    assert res[1]["chosen"] == r0["chosen"] and res[1]["candidates"] == r0["candidates"]
    assert {name for name, _, _ in r0["candidates"]} == {"1f1b-v", "zbv", "torch:ScheduleZBVZeroBubble",
                                                          "torch:ScheduleDualPipeV"}
    assert r0["chosen"][1] == r0["candidates"][0][0]  # the least predicted makespan
    medians = r0["medians"]
    o = r0["overhead"]  # the runtime's time per action beyond the compute, in every cost
    assert o >= 0 and res[1]["overhead"] == o and len(r0["step_ms"]) == 2 and min(r0["step_ms"]) > 0
    for s in range(4):
        assert {("F", s), ("B", s), ("W", s), ("BW", s)} <= set(medians), s
        assert r0["t_bw"][s] == pytest.approx(max(medians[("BW", s)], 1e-6) + o, rel=1e-12)
        assert r0["t_f"][s] == pytest.approx(max(medians[("F", s)], 1e-6) + o, rel=1e-12)
    for r in res:  # one timed iteration per form: F in both, I and W in the split one, B in the fused one
        assert {op: n for (op, _), n in r["samples"].items() if op != "R"} == {"F": 2 * M, "B": M, "W": M, "BW": M}


def test_choose_schedule_weighs_what_splitting_costs():
    """Per chunk T_F = 1, T_I = 1, T_W = 1 (hand): with the fused backward as dear as I + W
    (``t_bw = 2``) the V's zero-bubble ``zbv`` wins; with it half of that (``t_bw = 1``) every rank's
    split work alone, 8 microbatches x 2 chunks x 3 = 48, exceeds ``1f1b-v``'s predicted iteration,
    so ``1f1b-v`` wins. PyTorch's ``ScheduleDualPipeV`` order holds 5 ``M_B`` against the default limit of
    4 (``1f1b-v``'s peak) and is never chosen. Candidates over the limit are not chosen; stages that fit no placement are refused."""
    p, m = 2, 8
    kw = dict(num_ranks=p, num_microbatches=m)
    dear = CostModel(t_f=1.0, t_b=1.0, t_w=1.0, t_bw=2.0, mem_b=1.0, mem_w=1.0)
    cheap = CostModel(t_f=1.0, t_b=1.0, t_w=1.0, t_bw=1.0, mem_b=1.0, mem_w=1.0)
    s, rows = choose_schedule(Placement.V, costs=dear, **kw)
    t = {n: time for n, time, _ in rows}  # PyTorch's ZBV order ties (equal costs: its design point); ours first
    assert s.name == "zbv" and rows[0][0] == "zbv" and t["zbv"] == t["torch:ScheduleZBVZeroBubble"] < t["1f1b-v"]
    s, rows = choose_schedule(Placement.V, costs=cheap, **kw)
    assert s.name == "1f1b-v" and rows[0][1] < 48 and {a.op.value for _, _, a in s.actions()} == {"F", "BW"}
    assert simulate(s, cheap).total_time == rows[0][1] and rows[-1][:2] == ("torch:ScheduleDualPipeV", math.inf)
    # plain placement: 1f1b's peak (p microbatches) is the default limit; zb-2p's 2p is not a candidate
    s, rows = choose_schedule(Placement.PLAIN, costs=dear, **kw)
    assert {r[0] for r in rows} == {"1f1b", "zb-h1", "zb-1p"} and all(r[2] <= p for r in rows)
    assert s.name != "1f1b"  # zero bubble beats 1F1B when splitting costs nothing
    assert placement_of([1, 2], 4, 2, 1) is Placement.V and placement_of([1, 3], 4, 2, 1) is Placement.INTERLEAVED
    assert placement_of([1], 2, 2, 1) is Placement.PLAIN
    with pytest.raises(TorchExportError, match=r"rank 1 holds stages \[2\] of 4 on 2 ranks, which no placement"):
        placement_of([2], 4, 2, 1)


# Costs measured inside PyTorch's runtime at hidden 384 (docs/torch_pipelining.md, 2026-11-28 06:03 UTC,
# ``auto: zbv@ScheduleZBVZeroBubble``) [ms]: T_F, T_I, T_W, T_B (fused) per stage, 0.75 ms per action.
MEASURED_384 = CostModel(t_f=[11.05, 11.10, 10.91, 11.54], t_b=[0.02, 13.06, 13.05, 14.26],
                         t_w=[22.64, 10.45, 10.70, 12.74], t_bw=[23.32, 22.03, 22.62, 23.56],
                         mem_b=[1.0, 1.0, 1.0, 1.224], mem_w=[1.0, 1.0, 1.0, 1.163]
                         ).with_action_overhead(0.75, split_backward=True)


@pytest.mark.parametrize("m", [2, 4, 8])
def test_auto_is_never_predicted_slower_than_pytorchs_own_v_order(m):
    """At ``ScheduleZBVZeroBubble``'s own simulated peak as the limit, with measured costs, ``auto``'s
    choice is predicted no slower than PyTorch's order, neither as PyTorch's class runs it (every I and
    W two actions) nor as our export would write it unchanged (each I directly followed by its W fused).
    With 8 microbatches that order, fused where free and split where faster, beats our families
    (predicted 0.957 of the class against ``zbv`` 0.974 and ``1f1b-v`` 0.988), so ``auto`` runs it; with
    2, our cost-aware ``zbv`` is predicted at least 5% faster than the class (0.933).
    ``ScheduleDualPipeV`` is a candidate only where PyTorch builds it (m >= 2p)."""
    order = import_torch_schedule("ScheduleZBVZeroBubble", num_ranks=2, num_microbatches=m)
    as_class = simulate(order, MEASURED_384, enforce_memory=False).total_time
    fused = simulate(fuse_adjacent(order), MEASURED_384, enforce_memory=False)
    s, rows = choose_schedule(Placement.V, num_ranks=2, num_microbatches=m, costs=MEASURED_384,
                              memory_limit=fused.max_peak_memory)
    assert rows[0][1] <= min(as_class, fused.total_time) * (1 + 1e-12) and rows[0][0] == s.name
    assert ("torch:ScheduleDualPipeV" in {r[0] for r in rows}) == (m >= 4)
    if m == 8:
        assert s.name == "torch:ScheduleZBVZeroBubble" and s.meta["torch_class"] == "ScheduleZBVZeroBubble"
        assert all(t > rows[0][1] for n, t, _ in rows if n in ("zbv", "1f1b-v"))
    if m == 2:
        assert s.name == "zbv" and rows[0][1] <= 0.95 * as_class


def test_action_overhead_by_hand():
    """T_F = T_I = T_W = 1 ms (hand), one stage, one microbatch. Split (F, I, W: 3 actions) the
    simulator predicts 3 ms; a measured 3.6 ms leaves 0.2 ms per action. Fused (F, B: 2 actions, B at
    t_b + t_w = 2) it predicts 3 ms too; 3.6 ms leaves 0.3. Both forms timed: their mean, 0.25.
    Faster than predicted: 0, not negative."""
    one = Schedule(1, [0], [[F(0, 0), B(0, 0), W(0, 0)]])
    costs = CostModel(t_f=1.0, t_b=1.0, t_w=1.0)
    assert action_overhead_ms([(one, False)], [3.6], costs) == pytest.approx(0.2)
    assert action_overhead_ms([(one, True)], [3.6], costs) == pytest.approx(0.3)
    assert action_overhead_ms([(one, False), (one, True)], [3.6, 3.6], costs) == pytest.approx(0.25)
    assert action_overhead_ms([(one, False)], [2.0], costs) == 0.0


def test_stage0_quirk_in_the_cost_model():
    costs = CostModel(t_f=[1.0, 1.0, 1.0], t_b=[2.0, 2.0, 2.0], t_w=[0.5, 0.5, 0.5], mem_b=4.0, mem_w=1.0)
    rc = runtime_costs(costs, 3)
    assert rc.t_b[0] == pytest.approx(2.5e-6, rel=1e-12) and rc.t_b[0] + rc.t_w[0] == pytest.approx(2.5, rel=1e-12)
    assert list(rc.t_b[1:]) == [2.0, 2.0] and list(rc.t_w[1:]) == [0.5, 0.5] and list(rc.t_f) == [1.0] * 3
    assert list(rc.mem_w) == [4.0] * 3 and list(rc.mem_b) == [4.0] * 3  # PyTorch's I frees nothing
    # a fused backward's own time is kept: PyTorch's B on stage 0 is its whole backward as elsewhere
    assert runtime_costs(CostModel(t_bw=[2.0, 2.2, 2.4]), 3).t_bw == [2.0, 2.2, 2.4]
    # the schedule built from it is one PyTorch's runtime accepts
    torch_lowering(build_schedule("zb-1p", num_ranks=3, num_microbatches=6, costs=rc))


def test_stages_for_rank_follows_the_placement():
    assert stages_for_rank("zb-1p", num_ranks=4, rank=1) == [1]
    assert stages_for_rank("zbv", num_ranks=4, rank=1) == [1, 6]
    assert stages_for_rank("interleaved-zb", num_ranks=4, rank=1, num_chunks=3) == [1, 5, 9]


def test_saving_keeps_no_graph_alive_and_leaves_gradients_unchanged():
    """``profiling.saving`` counts what autograd saves without the reference cycles of a pack hook
    returning the tensor itself: after a partial backward (as PyTorch's W runs one) and dropping the
    graph, nothing but the inputs the caller holds stays counted; with ``ActivationMemoryTracker.saving()`` the nodes that saved their
    own outputs stay alive. Gradients with ``saving`` are bitwise those without any hook."""
    from megatron_zb.runtime.memory import ActivationMemoryTracker
    from megatron_zb.testing.torch_pipelining import TinyLM, batch, loss_fn
    from megatron_zb.torch_pipelining.profiling import saving

    cfg = LMConfig()
    x, y = batch(cfg, 1)
    plain = TinyLM(cfg)
    loss_fn(plain(x), y).backward()
    model = TinyLM(cfg)
    tracker = ActivationMemoryTracker(model.parameters())
    with saving(tracker):
        loss = loss_fn(model(x), y)
    assert tracker.current_bytes > 0
    loss.backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters()))
    held = x.nbytes + y.nbytes  # the token ids and targets, saved by the embedding and the loss, alive here
    assert tracker.current_bytes <= held

    for ctx, left in ((saving, False), (lambda t: t.saving(), True)):
        model = TinyLM(cfg)
        tracker = ActivationMemoryTracker(model.parameters())
        with ctx(tracker):
            loss = loss_fn(model(x), y)
        torch.autograd.grad(loss, [model.head.weight])  # only the output layer's part of the graph
        del loss
        assert (tracker.current_bytes > held) == left, (left, tracker.current_bytes)

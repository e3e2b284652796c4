"""The zero-bubble runtime on real megatron-core GPT chunks, real gloo processes.

Every schedule's loss and gradients (bare ``param.grad``, no DDP) are compared bitwise with
megatron-core's own 1F1B (``forward_backward_pipelining_without_interleaving``), or for V and
interleaved placements with the unpipelined model, on the same weights and data. The DDP /
optimizer / precision / fusion combinations of every family are cells of the compatibility
matrix (tests/runtime/test_compat_matrix.py).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

import megatron_zb  # noqa: F401  (CPU shim)
from megatron_zb.runtime.p2p import WaitPolicy
from megatron_zb.testing import run_distributed
from megatron_zb.testing.tiny_gpt import TinyGPT, assert_bitwise_equal, run_step

PP2_SCHEDULES = ["1f1b", "zb-h1", "zb-h2", "zb", "zb-2p"]


def _assert_same(ref: dict, got: dict, *, what: str) -> None:
    """Losses and every gradient (every rank's copy, see TinyGPT.merge) bitwise equal."""
    assert_bitwise_equal(ref, got, what=what)


@pytest.fixture(scope="module")
def pp2_reference() -> dict:
    return TinyGPT.merge(run_distributed(partial(run_step, TinyGPT(pp=2), schedule=None), world_size=2, timeout=90))


@pytest.mark.parametrize("schedule", PP2_SCHEDULES)
def test_pp2_schedules_match_megatron_1f1b_bitwise(pp2_reference, schedule):
    got = TinyGPT.merge(run_distributed(partial(run_step, TinyGPT(pp=2), schedule=schedule), world_size=2,
                                        timeout=90))
    _assert_same(pp2_reference, got, what=schedule)
    if schedule != "1f1b":
        assert got["w_deferred"] > 0, "the split-backward schedule must have deferred weight gradients to W"


def test_pp4_schedules_match_megatron_1f1b_bitwise():
    cfg = TinyGPT(pp=4, num_microbatches=8)
    ref = TinyGPT.merge(run_distributed(partial(run_step, cfg, schedule=None), world_size=4, timeout=120))
    for schedule in ("zb-h1", "zb-2p"):
        got = TinyGPT.merge(run_distributed(partial(run_step, cfg, schedule=schedule), world_size=4, timeout=120))
        _assert_same(ref, got, what=f"PP=4 {schedule}")


@pytest.mark.parametrize("schedule,k", [("zb", 2), ("zb-h1", 4)])
def test_weight_gradient_groups_run_layer_major_and_match_megatron_1f1b_bitwise(pp2_reference, schedule, k):
    """``wgrad_group=k``: each stage's W's run in groups of ``k`` micro batches (of 4), layer-major
    (:meth:`~megatron_zb.runtime.wgrad_store.WeightGradStore.run_group`). Every parameter still receives its
    micro batches in order, so losses and gradients stay bitwise megatron-core 1F1B's; every W entry ran."""
    got = TinyGPT.merge(run_distributed(partial(run_step, TinyGPT(pp=2), schedule=schedule, wgrad_group=k),
                                        world_size=2, timeout=90))
    _assert_same(pp2_reference, got, what=f"{schedule} in W groups of {k}")
    ungrouped = TinyGPT.merge(run_distributed(partial(run_step, TinyGPT(pp=2), schedule=schedule), world_size=2,
                                              timeout=90))
    assert got["w_deferred"] == ungrouped["w_deferred"] > 0


def test_stage_outputs_are_pseudo_freed_as_megatron_core_requires():
    """Megatron-LM always sets ``deallocate_pipeline_outputs`` (TinyGPT's config does too, through
    ``cpu_gpt_config``): megatron-core's ``backward_step`` then asserts that every stage output was
    pseudo-freed before its backward. With the flag off the outputs are kept; both match
    megatron-core's 1F1B run with the same setting, on the plain placement and on the V tip."""
    from megatron_zb.model import cpu_gpt_config

    assert cpu_gpt_config(num_layers=1, hidden_size=8, num_attention_heads=1).deallocate_pipeline_outputs
    off = TinyGPT(pp=2, config_options={"deallocate_pipeline_outputs": False})
    ref = TinyGPT.merge(run_distributed(partial(run_step, off, schedule=None), world_size=2, timeout=90))
    got = TinyGPT.merge(run_distributed(partial(run_step, off, schedule="zb"), world_size=2, timeout=90))
    _assert_same(ref, got, what="zb without deallocate_pipeline_outputs")
    ref1 = TinyGPT.merge(run_distributed(partial(run_step, TinyGPT(pp=1, config_options=off.config_options),
                                                 schedule=None), world_size=1, timeout=90))
    got = TinyGPT.merge(run_distributed(partial(run_step, off, schedule="zbv"), world_size=2, timeout=90))
    _assert_same(ref1, got, what="zbv without deallocate_pipeline_outputs")


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_tp2_pp2_matches_megatron_1f1b(sequence_parallel):
    """TP all-reduce (or SP reduce-scatter) in B; the W pass re-gathers SP inputs."""
    cfg = TinyGPT(pp=2, tp=2, sequence_parallel=sequence_parallel)
    ref = TinyGPT.merge(run_distributed(partial(run_step, cfg, schedule=None), world_size=4, timeout=120))
    got = TinyGPT.merge(run_distributed(partial(run_step, cfg, schedule="zb-h2"), world_size=4, timeout=120))
    _assert_same(ref, got, what=f"TP=2 SP={sequence_parallel} zb-h2")


# DP=2 with DDP and the optimizer step, and gradient_accumulation_fusion against megatron-core's
# unfused path, are cells of the compatibility matrix for every family (tests/runtime/test_compat_matrix.py:
# dp2-ddp, dp2-distopt, wgrad-fusion columns), which compares gradients and parameters bitwise.


def _forward_only(cfg: TinyGPT, schedule: str | None) -> dict:
    """Forward-only on this rank: the losses, and whether anything computed a gradient."""
    from megatron_zb.testing.tiny_gpt import build, forward_backward

    chunks, modules = build(cfg, schedule)
    if schedule is None:
        from megatron.core.pipeline_parallel import get_forward_backward_func
        fb = get_forward_backward_func()
    else:
        from megatron_zb.runtime import get_forward_backward_func
        fb = get_forward_backward_func(schedule)
    losses = forward_backward(fb, modules, cfg.microbatches(), seq=cfg.seq, micro_batch=cfg.micro_batch,
                              forward_only=True)
    params = [p for c in chunks for p in c.module.parameters()]
    store = getattr(fb, "store", None)
    return {"losses": [float(d["lm loss"]) for d in losses], "num_params": len(params),
            "with_grad": sum(p.grad is not None for p in params),
            "w_executed": None if store is None else store.executed,
            "w_pending": None if store is None else store.pending()}


def test_forward_only_every_schedule(pp2_reference):
    """Forward-only: megatron-core's losses, no parameter gets a gradient, no W is queued or run."""
    cfg = TinyGPT(pp=2)
    want = [float(x) for x in pp2_reference["losses"]]
    assert len(want) == cfg.num_microbatches
    for schedule in PP2_SCHEDULES:
        ranks = run_distributed(partial(_forward_only, cfg, schedule), world_size=2, timeout=90)
        assert ranks[0]["losses"] == [] and ranks[1]["losses"] == want, schedule
        for r in ranks:
            assert r["num_params"] > 0 and r["with_grad"] == 0, (schedule, r)
            assert r["w_executed"] == 0 and not r["w_pending"], (schedule, r)


def _zb_h1_pp2():
    from megatron_zb.schedules.generators.handcrafted import zb_h1

    return zb_h1(num_ranks=2, num_microbatches=4)


def test_schedule_missing_a_w_is_rejected_before_running():
    from megatron_zb.schedules import ScheduleError

    bad = _zb_h1_pp2()
    bad.ranks[1] = [a for a in bad.ranks[1] if not (a.op == "W" and a.mb == 3)]
    with pytest.raises(ScheduleError, match=r"rank 1 lacks W\(mb=3, stage=1\)"):
        run_distributed(partial(run_step, TinyGPT(pp=2), schedule=bad), world_size=2, timeout=60)


def test_missing_w_is_caught_by_the_weight_gradient_store():
    from megatron_zb.runtime import WeightGradStoreError

    bad = _zb_h1_pp2()
    bad.ranks[1] = [a for a in bad.ranks[1] if not (a.op == "W" and a.mb == 3)]
    with pytest.raises(WeightGradStoreError, match=r"pending for \(stage 1, microbatch 3\)"):
        run_distributed(partial(run_step, TinyGPT(pp=2), schedule=bad, validate=False), world_size=2, timeout=60)


def test_lost_send_times_out_naming_rank_action_and_peer():
    import time

    from megatron_zb.runtime import PipelineTimeoutError
    from megatron_zb.schedules import lower

    bad = lower(_zb_h1_pp2())
    bad.ranks[0] = [a for a in bad.ranks[0] if not (a.op == "SEND_F" and a.mb == 3)]
    t0 = time.monotonic()
    with pytest.raises(PipelineTimeoutError, match=r"pipeline rank 1: receive for RECV_F\(mb=3, stage=0, peer=0\) "
                                                    r"with peer rank 0 did not complete within 3 s"):
        run_distributed(partial(run_step, TinyGPT(pp=2), schedule=bad, validate=False, timeout=3.0),
                        world_size=2, timeout=60)
    assert time.monotonic() - t0 < 40


def test_activation_memory_follows_the_simulator():
    """Measured bytes of saved activations: ZB-H1 as 1F1B, ZB-H2 about (2p-1)/p of it (PP=2, m=4)."""
    cfg = TinyGPT(pp=2)
    peaks = {}
    for schedule in ("1f1b", "zb-h1", "zb-h2"):
        got = TinyGPT.merge(run_distributed(partial(run_step, cfg, schedule=schedule, track_memory=True),
                                            world_size=2, timeout=90))
        peaks[schedule] = got["peak_bytes"]
    print("measured activation peaks per rank (bytes):", peaks)
    assert max(peaks["zb-h1"]) <= 1.05 * max(peaks["1f1b"])
    ratio = peaks["zb-h2"][0] / peaks["1f1b"][0]  # rank 0 holds 2p-1 = 3 microbatches instead of p = 2
    assert 1.3 <= ratio <= 1.6, ratio


def _patched_megatron_step(cfg: TinyGPT) -> dict:
    """An unmodified megatron-core call site after megatron_zb.patch_megatron()."""
    import megatron_zb

    megatron_zb.patch_megatron("zb-h1")
    try:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from megatron_zb.runtime import ZeroBubbleForwardBackward

        out = run_step(cfg, schedule=None)  # run_step calls megatron-core's get_forward_backward_func()
        assert isinstance(get_forward_backward_func(), ZeroBubbleForwardBackward)
        return out
    finally:
        megatron_zb.unpatch_megatron()


def test_patch_megatron_routes_an_unmodified_loop(pp2_reference):
    got = TinyGPT.merge(run_distributed(partial(_patched_megatron_step, TinyGPT(pp=2)), world_size=2, timeout=90))
    _assert_same(pp2_reference, got, what="patched megatron-core")
    assert got["w_deferred"] > 0


@pytest.fixture(scope="module")
def pp1_reference() -> dict:
    """The same model and data without pipelining (megatron-core's forward_backward_no_pipelining)."""
    return TinyGPT.merge(run_distributed(partial(run_step, TinyGPT(pp=1), schedule=None), world_size=1, timeout=90))


@pytest.mark.parametrize("wait_policy", [None, "stream"], ids=["host-waits", "nccl-stream-waits"])
@pytest.mark.parametrize("schedule", ["zbv", "v-half", "v-min"])
def test_v_schedules_match_the_unpipelined_model(pp1_reference, schedule, wait_policy):
    """V placement: rank 0 holds the first and the last stage (embedding and loss); activations and
    gradients travel both ways between the rank pair, matched by order -- with gloo's host waits and
    with NCCL's wait policy (``Work.wait()`` without a timeout plus the watchdog, run here on gloo)."""
    policy = None if wait_policy is None else WaitPolicy(wait_policy)
    got = TinyGPT.merge(run_distributed(partial(run_step, TinyGPT(pp=2), schedule=schedule,
                                                wait_policy=policy), world_size=2, timeout=90))
    _assert_same(pp1_reference, got, what=schedule)
    assert got["w_deferred"] > 0


def test_v_schedule_in_weight_gradient_groups_matches_the_unpipelined_model(pp1_reference):
    """ZB-V with its W's in groups of 2 (two stages per rank, each grouped on its own): bitwise the
    unpipelined model, as ZB-V ungrouped is."""
    got = TinyGPT.merge(run_distributed(partial(run_step, TinyGPT(pp=2), schedule="zbv", wgrad_group=2),
                                        world_size=2, timeout=90))
    _assert_same(pp1_reference, got, what="zbv in W groups of 2")
    assert got["w_deferred"] > 0


def test_fused_v_schedule_matches_the_unpipelined_model(pp1_reference):
    """``1f1b-v`` (V placement, every backward fused: no W deferred) in megatron-zb's own runtime,
    as ``pretrain_gpt_zb.py --schedule 1f1b-v`` runs it."""
    got = TinyGPT.merge(run_distributed(partial(run_step, TinyGPT(pp=2), schedule="1f1b-v"), world_size=2, timeout=90))
    _assert_same(pp1_reference, got, what="1f1b-v")
    assert got["w_deferred"] == 0


def test_v_schedule_pp4_and_interleaved_zb(pp1_reference):
    cfg = TinyGPT(pp=4, num_microbatches=8)
    ref = TinyGPT.merge(run_distributed(partial(run_step, TinyGPT(pp=1, num_microbatches=8), schedule=None),
                                        world_size=1, timeout=90))
    stream = WaitPolicy.STREAM
    for schedule, policy in (("zbv", None), ("zbv", stream), ("interleaved-zb", None), ("interleaved-1f1b", stream)):
        got = TinyGPT.merge(run_distributed(partial(run_step, cfg, schedule=schedule, wait_policy=policy),
                                            world_size=4, timeout=120))
        _assert_same(ref, got, what=f"PP=4 {schedule} (wait_policy={policy})")


def test_v_half_and_v_min_activation_memory_follow_the_simulator():
    """PP=4, m=8: measured peak bytes of V-Half / V-Min relative to ZB-V track the simulator's ratio."""
    from megatron_zb.schedules import CostModel, simulate
    from megatron_zb.schedules.registry import build_schedule

    cfg = TinyGPT(pp=4, num_microbatches=8)
    measured, predicted = {}, {}
    for schedule in ("zbv", "v-half", "v-min"):
        got = TinyGPT.merge(run_distributed(partial(run_step, cfg, schedule=schedule, track_memory=True),
                                            world_size=4, timeout=120))
        measured[schedule] = max(got["peak_bytes"][1:])  # rank 0 also holds the embedding and the loss
        sim = simulate(build_schedule(schedule, num_ranks=4, num_microbatches=8), CostModel())
        predicted[schedule] = max(sim.peak_memory[1:])
    print("measured peak bytes:", measured, "predicted (chunk M_B):", predicted)
    for schedule in ("v-half", "v-min"):
        want = predicted[schedule] / predicted["zbv"]
        got = measured[schedule] / measured["zbv"]
        assert got == pytest.approx(want, rel=0.15), (schedule, got, want)
        assert got < 0.9


def test_forwards_out_of_microbatch_order_get_their_own_data(pp2_reference):
    """A stage whose forwards run out of microbatch order still feeds each its own micro batch."""
    from megatron_zb.schedules import validate
    from megatron_zb.schedules.ir import F

    sched = _zb_h1_pp2()
    r0 = sched.ranks[0]
    i2, i3 = r0.index(F(2, 0)), r0.index(F(3, 0))
    r0[i2], r0[i3] = r0[i3], r0[i2]  # rank 0 now runs F(3) before F(2)
    validate(sched)
    got = TinyGPT.merge(run_distributed(partial(run_step, TinyGPT(pp=2), schedule=sched), world_size=2, timeout=90))
    _assert_same(pp2_reference, got, what="out-of-order forwards")

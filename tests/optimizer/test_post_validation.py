"""Optimizer post-validation (megatron_zb.optimizer) against megatron-core's synchronous step.

Distributed tests train a tiny GPT (4 layers, hidden 32, 2 heads, seq 16, vocab 64, micro batch 2,
4 microbatches) wired as ``pretrain_gpt_zb.py`` wires it (megatron-core's DDP and
``get_megatron_optimizer`` through ``training/wiring.py``; the ranks: ``tests/harness/pv_harness.py``)
with megatron-core's 1F1B schedule (``forward_backward_pipelining_without_interleaving``) three
times in the same ranks: with
megatron's synchronous ``optimizer.step()`` (the reference), and wrapped in
``PostValidationOptimizer`` in exact and in in-place mode. A low ``clip_grad`` makes clipping
fire on some iterations and an inf is written into one stage's gradients at chosen iterations;
every run must take the same decisions, and the results must be bitwise equal (exact) or equal
within 1e-6 relative (in-place; fp32 -- see ``test_inplace_mixed_precision_*`` for bf16/fp16).
Each test also asserts that rollbacks actually happened, so that it cannot pass vacuously.
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any

import pytest
import torch

import megatron_zb  # noqa: F401  (installs the CPU shim)
from megatron_zb.optimizer import (
    PostValidationError,
    PostValidationOptimizer,
    check_adam_invertible,
    invert_adam_step_,
)
from megatron_zb.optimizer.rollback import ExactSnapshot, InPlaceRecord, group_hyperparams
from megatron_zb.testing import init_parallel_state, run_distributed

from harness.pv_harness import (MICRO_BATCH, MICROBATCHES, SEED, SEQ, build, forward_step, inject_inf,
                                            microbatches, relative_difference, run_modes)


# ====================================================================== single-process: Adam inversion
def _adam_run(cls: type, *, steps: int, seed: int = 0, **kw: Any):
    """A param trained ``steps`` steps on random grads; returns (param, optimizer, generator)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(64, 8, generator=g))
    opt = cls([p], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, **kw)
    for _ in range(steps):
        p.grad = torch.randn(p.shape, generator=g) * (0.1 + torch.rand(1, generator=g))
        opt.step()
    return p, opt, g


ADAM_VARIANTS = [
    pytest.param(torch.optim.AdamW, dict(weight_decay=0.1), id="adamw-wd"),
    pytest.param(torch.optim.Adam, dict(weight_decay=0.1), id="adam-l2"),
    pytest.param(torch.optim.Adam, dict(weight_decay=0.0), id="adam"),
    pytest.param(torch.optim.AdamW, dict(weight_decay=0.1, maximize=True), id="adamw-maximize"),
]


def _step_and_invert(cls, kw, prior_steps: int, grad_scale: float):
    """(param and state before, after invert) around one step with a grad of ``grad_scale`` x
    the usual size; also returns the grad and the post-step moments."""
    p, opt, g = _adam_run(cls, steps=prior_steps, **kw)
    before_p = p.detach().clone()
    before_state = copy.deepcopy(opt.state[p]) if prior_steps else {}
    p.grad = torch.randn(p.shape, generator=g) * grad_scale
    record, hp = InPlaceRecord.capture(opt), group_hyperparams(opt)
    opt.step()
    assert relative_difference(p.detach(), before_p) > 1e-4  # the step moved the param
    post = {k: v.clone() for k, v in opt.state[p].items()}
    record.invert(hp)
    return p, opt, before_p, before_state, post


@pytest.mark.parametrize("cls,kw", ADAM_VARIANTS)
@pytest.mark.parametrize("prior_steps", [0, 1, 7])
def test_invert_adam_step_restores_previous_state(cls, kw, prior_steps):
    """A step with a gradient of the usual size is undone within 1e-6 relative."""
    p, opt, before_p, before_state, _ = _step_and_invert(cls, kw, prior_steps, grad_scale=0.5)
    assert relative_difference(p.detach(), before_p) <= 1e-6
    if prior_steps == 0:
        assert len(opt.state[p]) == 0  # lazily created state removed: exactly as before the step
    else:
        assert opt.state[p]["step"].item() == before_state["step"].item()
        assert relative_difference(opt.state[p]["exp_avg"], before_state["exp_avg"]) <= 1e-6
        assert relative_difference(opt.state[p]["exp_avg_sq"], before_state["exp_avg_sq"]) <= 1e-6


@pytest.mark.parametrize("cls,kw", ADAM_VARIANTS)
@pytest.mark.parametrize("prior_steps", [1, 7])
def test_invert_adam_step_error_bound_for_a_dominant_gradient(cls, kw, prior_steps):
    """A gradient spike (30x) dominates the new moments: the recovered moments then carry the
    forward update's rounding of the *post-step* values (the documented bound), elementwise."""
    p, opt, before_p, before_state, post = _step_and_invert(cls, kw, prior_steps, grad_scale=30.0)
    eps = torch.finfo(torch.float32).eps
    b1, b2 = 0.9, 0.999
    assert relative_difference(p.detach(), before_p) <= 1e-6
    m, v = opt.state[p]["exp_avg"].double(), opt.state[p]["exp_avg_sq"].double()
    m0, v0 = before_state["exp_avg"].double(), before_state["exp_avg_sq"].double()
    m1, v1 = post["exp_avg"].double(), post["exp_avg_sq"].double()
    g = p.grad.double().abs() + 0.1 * p.detach().double().abs()  # weight decay folded in for Adam-L2
    assert ((m - m0).abs() <= eps * ((m1.abs() + g) / b1 + m0.abs())).all()
    assert ((v - v0).abs() <= eps * ((v1 + (1 - b2) * g * g + b2 * v0) / b2 + v0)).all()
    # ... and the bound is not vacuous: relative to the old moment the error is visible here.
    assert relative_difference(opt.state[p]["exp_avg_sq"], before_state["exp_avg_sq"]) > 1e-7


@pytest.mark.parametrize("cls,kw", ADAM_VARIANTS)
def test_invert_then_redo_with_clipped_grads_matches_direct_step(cls, kw):
    """Eager step with g, invert, redo with 0.3*g == stepping with 0.3*g directly (1e-6 relative)."""
    p, opt, g = _adam_run(cls, steps=5, **kw)
    ref_p = copy.deepcopy(p)
    ref_opt = cls([ref_p], **kw)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # (load_state_dict would share the tensors)
    grad = torch.randn(p.shape, generator=g)
    p.grad = grad.clone()
    record, hp = InPlaceRecord.capture(opt), group_hyperparams(opt)
    opt.step()
    record.invert(hp)
    p.grad.mul_(0.3)
    opt.step()
    ref_p.grad = grad * 0.3
    ref_opt.step()
    assert relative_difference(p.detach(), ref_p.detach()) <= 1e-6
    for key in ("exp_avg", "exp_avg_sq"):
        assert relative_difference(opt.state[p][key], ref_opt.state[ref_p][key]) <= 1e-6
    assert opt.state[p]["step"].item() == ref_opt.state[ref_p]["step"].item() == 6


def test_invert_uses_the_steps_hyperparameters():
    """Inverting with a later lr (what an LR scheduler sets) is wrong: the step's values are needed."""
    p, opt, g = _adam_run(torch.optim.AdamW, steps=3, weight_decay=0.1)
    before = p.detach().clone()
    p.grad = torch.randn(p.shape, generator=g)
    hp = group_hyperparams(opt)
    opt.step()
    wrong = [dict(hp[0], lr=hp[0]["lr"] * 0.5)]
    trial = copy.deepcopy((p, opt.state[p]))
    invert_adam_step_(trial[0], p.grad, trial[1], wrong[0])
    assert relative_difference(trial[0].detach(), before) > 1e-4
    invert_adam_step_(p, p.grad, opt.state[p], hp[0])
    assert relative_difference(p.detach(), before) <= 1e-6


def test_exact_snapshot_restores_bitwise():
    p, opt, g = _adam_run(torch.optim.AdamW, steps=4, weight_decay=0.1)
    fresh = torch.nn.Parameter(torch.ones(3))  # no state yet: restore must remove what step() creates
    opt.add_param_group({"params": [fresh]})
    before = (p.detach().clone(), copy.deepcopy(opt.state[p]))
    p.grad, fresh.grad = torch.randn(p.shape, generator=g), torch.ones(3)
    snap = ExactSnapshot.capture(opt)
    assert snap.nbytes == (64 * 8 * 3 + 1) * 4 + 3 * 4  # param + exp_avg + exp_avg_sq + step, and the fresh param
    opt.step()
    snap.restore()
    assert torch.equal(p, before[0]) and torch.equal(fresh, torch.ones(3))
    assert all(torch.equal(opt.state[p][k], before[1][k]) for k in before[1])
    assert len(opt.state[fresh]) == 0


def test_check_adam_invertible_rejects_unsupported():
    p = torch.nn.Parameter(torch.zeros(2))
    check_adam_invertible(torch.optim.AdamW([p]))
    with pytest.raises(NotImplementedError, match="amsgrad"):
        check_adam_invertible(torch.optim.Adam([p], amsgrad=True))
    with pytest.raises(NotImplementedError, match="exact mode"):
        check_adam_invertible(torch.optim.SGD([p], lr=0.1))


# ====================================================================== distributed checks
def _assert_close(a: Any, b: Any, *, exact: bool, what: str, rtol: float = 1e-6) -> None:
    if exact:
        if torch.is_tensor(a):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{what}: not bitwise equal"
        else:
            assert a == b, f"{what}: {a!r} != {b!r}"
        return
    if torch.is_tensor(a):
        assert a.shape == b.shape, what
        r = relative_difference(a.float(), b.float())
        assert r <= rtol, f"{what}: relative difference {r:.3g} > {rtol:g}"
    elif isinstance(a, float) and isinstance(b, float):
        assert math.isclose(a, b, rel_tol=rtol, abs_tol=0.0), f"{what}: {a!r} vs {b!r}"
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


def _compare(ref: dict, got: dict, *, exact: bool, rank: int, rtol: float = 1e-6, mode: str = "") -> None:
    where = f"{mode} rank {rank}"
    assert len(got["results"]) == len(ref["results"])
    for it, (a, b) in enumerate(zip(got["results"], ref["results"])):
        assert a[0] == b[0], f"{where} iteration {it}: update_successful {a[0]} != {b[0]}"
        for k in (1, 2):
            if b[k] is None or a[k] is None:
                assert a[k] is b[k], f"{where} iteration {it}: step() value {k}: {a[k]!r} vs {b[k]!r}"
            elif k == 2 and not exact:
                # A count of exact zeros: a grad element can cancel to 0.0 in one run and not in
                # another whose params differ by round-off.
                assert abs(a[k] - b[k]) <= 2, f"{where} iteration {it}: num_zeros_in_grad {a[k]} vs {b[k]}"
            else:
                _assert_close(float(a[k]), float(b[k]), exact=exact, rtol=rtol, what=f"{where} it {it} result[{k}]")
    assert got["scales"] == ref["scales"], f"{where}: loss scales differ"
    assert got["final_scale"] == ref["final_scale"]
    _assert_close(got["lrs"], ref["lrs"], exact=True, what=f"{where} lrs")
    assert len(got["losses"]) == len(ref["losses"])
    for it, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
        _assert_close(a, b, exact=exact, rtol=rtol, what=f"{where} loss of iteration {it}")
    for i, (a, b) in enumerate(zip(got["params"], ref["params"])):
        _assert_close(a, b, exact=exact, rtol=rtol, what=f"{where} model param {i}")
    assert len(got["optimizer"]) == len(ref["optimizer"])
    for i, (a, b) in enumerate(zip(got["optimizer"], ref["optimizer"])):
        _assert_close(a, b, exact=exact, rtol=rtol, what=f"{where} optimizer tensor {i}")


def _expected_path(results: list[tuple], spec: dict) -> tuple[list[bool], list[bool], list[bool]]:
    """Replay the documented heuristic on the reference results: per iteration, (eager?, clipped?, skipped?)."""
    warmup, clean, clip = spec.get("warmup", 2), spec.get("clean", 1), spec["clip_grad"]
    eager, clipped, skipped = [], [], []
    sync_until_clean, streak = False, 0
    for it, r in enumerate(results):
        eager.append(it >= warmup and not sync_until_clean)
        skipped.append(not r[0])
        clipped.append(bool(r[0]) and r[1] is not None and clip / (r[1] + 1e-6) < 1.0)
        if clipped[-1] or skipped[-1]:
            streak, sync_until_clean = 0, clean > 0
        else:
            streak += 1
            sync_until_clean = sync_until_clean and streak < clean
    return eager, clipped, skipped


def _check_run(spec: dict, world_size: int, modes=("sync", "exact", "inplace"), *, timeout: float = 150.0,
               inplace_rtol: float = 1e-6) -> list[dict]:
    out = run_distributed(run_modes, world_size=world_size, args=(spec, modes), timeout=timeout)
    for rank, runs in enumerate(out):
        ref = runs["sync"]
        for mode in modes[1:]:
            if mode == "lockstep":
                assert not runs[mode]["problems"], f"lockstep rank {rank}: {runs[mode]['problems']}"
                assert runs[mode]["max_step_rel"] <= 1e-6, f"lockstep rank {rank}: {runs[mode]['per_step']}"
            else:
                _compare(ref, runs[mode], exact=(mode == "exact"), rank=rank, rtol=inplace_rtol, mode=mode)
    # The eager/synchronous choice follows the documented heuristic, and the test is not vacuous:
    # clipping fired on eager iterations (rolled back, or proven locally), inf/nan was rolled back.
    eager, clipped, skipped = _expected_path(out[0]["sync"]["results"], spec)
    eager_clips = sum(e and c for e, c in zip(eager, clipped))
    eager_skips = sum(e and s for e, s in zip(eager, skipped))
    assert 0 < sum(clipped) < len(clipped), f"clipping should fire on some iterations, not all: {clipped}"
    assert eager_clips > 0, "no eager iteration needed clipping: nothing to roll back"
    for mode in modes[1:]:
        counters = [runs[mode]["counters"] for runs in out]
        for c in counters:
            assert c.eager_steps == sum(eager) >= 8 and c.sync_steps == len(eager) - sum(eager), (c, eager)
            assert c.clipped_iterations == sum(clipped) and c.skipped_iterations == sum(skipped), c
            assert c.clip_rollbacks + c.local_clip_syncs == eager_clips, (c, eager_clips)
            assert c.inf_rollbacks <= eager_skips and c.rollbacks == c.clip_rollbacks + c.inf_rollbacks, c
        assert sum(c.clip_rollbacks for c in counters) > 0, f"{mode}: no clip rollback happened: {counters}"
        if spec.get("inject"):
            assert eager_skips > 0 and sum(c.inf_rollbacks for c in counters) > 0, f"{mode}: no inf rollback: {counters}"
    return out


# ---------------------------------------------------------------------- the distributed tests
FP32_MODES = ("sync", "exact", "inplace", "lockstep")
MIXED_MODES = ("sync", "exact", "lockstep")  # end-to-end in-place bf16/fp16 runs drift by bf16 round-off


def test_pp2_fp32_adamw():
    """FP32Optimizer (fp32 params, no loss scaler, AdamW): clip rollbacks; in-place within 1e-6."""
    _check_run(dict(pp=2, precision="fp32", dist_opt=False, clip_grad=0.75), world_size=2, modes=FP32_MODES)


def test_pp4_fp32_adam_l2():
    """PP=4, torch Adam with L2 weight decay (decoupled_weight_decay=False), three clean iterations
    required after each clip."""
    _check_run(dict(pp=4, precision="fp32", dist_opt=False, adamw=False, clip_grad=0.75, clean=3), world_size=4,
               modes=FP32_MODES)


def test_pp2_fp16_dynamic_loss_scale_inf_and_checkpoint():
    """fp16 with megatron's dynamic loss scaler: natural overflows and an inf written into stage 1's
    grads twice in a row (hysteresis 2: the scale backs off); a checkpoint taken while the
    rollback of the first one is pending saves what the synchronous run saves."""
    spec = dict(pp=2, precision="fp16", dist_opt=False, clip_grad=0.75, inject=((25, 1), (26, 1)), checkpoint_at=25)
    out = _check_run(spec, world_size=2, modes=MIXED_MODES)
    _check_checkpoint(out, ("exact",))


def test_pp2_bf16_constant_loss_scale_inf():
    """bf16 with a constant loss scale (megatron then checks for inf/nan too): inf in stage 0."""
    _check_run(dict(pp=2, precision="bf16", dist_opt=False, clip_grad=0.75, loss_scale=1.0, inject=((11, 0),)),
               world_size=2, modes=MIXED_MODES)


def test_pp2_dp2_distributed_optimizer_inf_and_checkpoint():
    """PP=2 x DP=2 with the distributed optimizer (fp32 main-param shards, constant loss scale so
    that inf/nan is checked): the inf lies in one DP rank's shard only, both must skip together;
    a checkpoint is taken while its rollback is pending."""
    spec = dict(pp=2, precision="fp32", dist_opt=True, clip_grad=0.4, loss_scale=1.0, inject=((20, 1),),
                checkpoint_at=20)
    out = _check_run(spec, world_size=4, modes=FP32_MODES)
    _check_checkpoint(out, ("exact", "inplace"))
    for mode in ("exact", "inplace"):
        stage1 = [runs[mode] for runs in out if runs[mode]["pp_rank"] == 1]
        assert sorted(r["owns_inf"][20] for r in stage1) == [False, True]  # one DP shard holds the inf ...
        for r in stage1:  # ... yet both DP ranks skipped at once (the stage agreement), neither stepped
            [rep] = [x for x in r["reports"] if x[0] == 20]
            assert rep[2] and not rep[3] and rep[4] is False, rep


def test_pp2_fp32_eager_every_iteration():
    """No warm-up and no synchronous fallback (clean_iters_required=0): every step is eager,
    clipping fires on most; some stages prove it locally and step correctly at once
    (``sync_on_local_clip``), the others roll back."""
    spec = dict(pp=2, precision="fp32", dist_opt=False, clip_grad=0.6, warmup=0, clean=0)
    out = _check_run(spec, world_size=2, modes=("sync", "exact", "lockstep"))
    assert sum(runs["exact"]["counters"].local_clip_syncs for runs in out) > 0


def test_pp2_bf16_bare_optimizer_without_clipping():
    """A bare Float16OptimizerWithFloat16Params (not chained; clip_grad=0, no zero counting): its
    own step() conventions (grad_norm 0.0, num_zeros 0) and the inf/nan skip."""
    spec = dict(pp=2, precision="bf16", dist_opt=False, clip_grad=0.0, loss_scale=1.0, log_zeros=False,
                inject=((9, 1),), warmup=1, clean=1, iters=16)
    out = run_distributed(run_modes, world_size=2, args=(spec, ("sync-bare", "exact-bare")), timeout=120)
    for rank, runs in enumerate(out):
        ref, got = runs["sync-bare"], runs["exact-bare"]
        _compare(ref, got, exact=True, rank=rank, mode="exact-bare")
        assert ref["results"][9] == (False, None, None)
        assert all(r == (True, 0.0, 0) for i, r in enumerate(ref["results"]) if i != 9), ref["results"]
        assert got["counters"].eager_steps == 14 and got["counters"].skipped_iterations == 1
        assert got["counters"].inf_rollbacks == (1 if got["pp_rank"] == 0 else 0)


def _misuse(case: str) -> str:
    """One way of using the wrapper wrongly; returns what this rank saw."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

    init_parallel_state(pipeline_model_parallel_size=2, seed=SEED)
    spec = dict(pp=2, precision="fp32", dist_opt=False, clip_grad=0.75)
    ddp, gpt, inner, _ = build(spec)
    opt = PostValidationOptimizer(inner, exact=False, warmup_iters=0, timeout=1.0 if case == "timeout" else 30.0)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()

    def iteration(it):
        ddp.zero_grad_buffer()
        forward_backward_pipelining_without_interleaving(
            forward_step_func=forward_step, data_iterator=microbatches(it, 0), model=[ddp], num_microbatches=MICROBATCHES,
            seq_length=SEQ, micro_batch_size=MICRO_BATCH)

    iteration(0)
    if case == "inf-after-zeroed-grads" and pp_rank == 1:
        inject_inf(gpt, inner)
    if case == "timeout" and pp_rank == 1:
        time.sleep(3.0)  # the last stage is late: the first stage's wait must give up after 1 s
    opt.step()
    try:
        if case == "timeout":
            opt.begin_iteration()
        elif case == "step-twice":
            iteration(1)
            opt.step()
        elif case == "inf-after-zeroed-grads":
            ddp.zero_grad_buffer()  # wrong order: the in-place rollback needs these grads
            opt.begin_iteration()
    except PostValidationError as e:
        seen = f"{type(e).__name__}: {e}"
    else:
        seen = "ok"
    if case == "timeout":
        while opt._pending is not None and not opt._pending.norm_work.is_completed():
            time.sleep(0.05)  # let the late rank's collective finish before leaving
    return seen


@pytest.mark.parametrize("case", ["timeout", "step-twice", "inf-after-zeroed-grads"])
def test_misuse_is_reported(case):
    seen = run_distributed(_misuse, world_size=2, args=(case,), timeout=60)
    if case == "timeout":
        assert seen[0].startswith("PostValidationTimeout") and "iteration 0" in seen[0], seen
    elif case == "step-twice":
        assert all(s.startswith("PostValidationError") and "begin_iteration()" in s for s in seen), seen
    else:
        # stage 0 stepped eagerly and must invert its step, but its grads are gone; stage 1 saw the
        # inf itself and skipped, nothing to undo.
        assert seen[0].startswith("PostValidationError") and "gradients changed" in seen[0], seen
        assert seen[1] == "ok", seen


def _check_checkpoint(out: list[dict], modes: tuple[str, ...]) -> None:
    for rank, runs in enumerate(out):
        ref = runs["sync"]["checkpoint"]
        for mode in modes:
            got = runs[mode]["checkpoint"]
            assert got["was_pending"], f"rank {rank} {mode}: nothing was pending at checkpoint time"
            for key in ("state_dict", "sharded"):
                assert len(got[key]) == len(ref[key])
                for i, (a, b) in enumerate(zip(got[key], ref[key])):
                    if torch.is_tensor(b):
                        _assert_close(a, b, exact=(mode == "exact"), what=f"rank {rank} {mode} {key} leaf {i}")
                    else:
                        assert a == b, f"rank {rank} {mode} {key} leaf {i}: {a!r} != {b!r}"
    # The inf was in the last stage: stage 0 had stepped eagerly and rolled back inside state_dict().
    assert all(runs[m]["checkpoint"]["rolled_back"] for runs in out if runs["sync"]["pp_rank"] == 0 for m in modes)

"""Optimizer post-validation (megatron_zb.optimizer) against megatron-core's synchronous step.

Distributed tests train a tiny GPT (4 layers, hidden 32, 2 heads, seq 16, vocab 64, micro batch 2,
4 microbatches) with megatron-core's own DDP, ``get_megatron_optimizer`` and 1F1B schedule
(``forward_backward_pipelining_without_interleaving``) three times in the same ranks: with
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

NUM_LAYERS, HIDDEN, HEADS, SEQ, VOCAB, MICRO_BATCH, MICROBATCHES = 4, 32, 2, 16, 64, 2, 4
ITERS = 32
SEED = 1234


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


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative difference ||a - b|| / ||b|| (L2 over the tensor; the absolute norm if b is zero)."""
    scale = b.double().norm().item()
    diff = (a.double() - b.double()).norm().item()
    return diff / scale if scale else diff


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
    assert _rel(p.detach(), before_p) > 1e-4  # the step moved the param
    post = {k: v.clone() for k, v in opt.state[p].items()}
    record.invert(hp)
    return p, opt, before_p, before_state, post


@pytest.mark.parametrize("cls,kw", ADAM_VARIANTS)
@pytest.mark.parametrize("prior_steps", [0, 1, 7])
def test_invert_adam_step_restores_previous_state(cls, kw, prior_steps):
    """A step with a gradient of the usual size is undone within 1e-6 relative."""
    p, opt, before_p, before_state, _ = _step_and_invert(cls, kw, prior_steps, grad_scale=0.5)
    assert _rel(p.detach(), before_p) <= 1e-6
    if prior_steps == 0:
        assert len(opt.state[p]) == 0  # lazily created state removed: exactly as before the step
    else:
        assert opt.state[p]["step"].item() == before_state["step"].item()
        assert _rel(opt.state[p]["exp_avg"], before_state["exp_avg"]) <= 1e-6
        assert _rel(opt.state[p]["exp_avg_sq"], before_state["exp_avg_sq"]) <= 1e-6


@pytest.mark.parametrize("cls,kw", ADAM_VARIANTS)
@pytest.mark.parametrize("prior_steps", [1, 7])
def test_invert_adam_step_error_bound_for_a_dominant_gradient(cls, kw, prior_steps):
    """A gradient spike (30x) dominates the new moments: the recovered moments then carry the
    forward update's rounding of the *post-step* values (the documented bound), elementwise."""
    p, opt, before_p, before_state, post = _step_and_invert(cls, kw, prior_steps, grad_scale=30.0)
    eps = torch.finfo(torch.float32).eps
    b1, b2 = 0.9, 0.999
    assert _rel(p.detach(), before_p) <= 1e-6
    m, v = opt.state[p]["exp_avg"].double(), opt.state[p]["exp_avg_sq"].double()
    m0, v0 = before_state["exp_avg"].double(), before_state["exp_avg_sq"].double()
    m1, v1 = post["exp_avg"].double(), post["exp_avg_sq"].double()
    g = p.grad.double().abs() + 0.1 * p.detach().double().abs()  # weight decay folded in for Adam-L2
    assert ((m - m0).abs() <= eps * ((m1.abs() + g) / b1 + m0.abs())).all()
    assert ((v - v0).abs() <= eps * ((v1 + (1 - b2) * g * g + b2 * v0) / b2 + v0)).all()
    # ... and the bound is not vacuous: relative to the old moment the error is visible here.
    assert _rel(opt.state[p]["exp_avg_sq"], before_state["exp_avg_sq"]) > 1e-7


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
    assert _rel(p.detach(), ref_p.detach()) <= 1e-6
    for key in ("exp_avg", "exp_avg_sq"):
        assert _rel(opt.state[p][key], ref_opt.state[ref_p][key]) <= 1e-6
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
    assert _rel(trial[0].detach(), before) > 1e-4
    invert_adam_step_(p, p.grad, opt.state[p], hp[0])
    assert _rel(p.detach(), before) <= 1e-6


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


# ====================================================================== distributed harness
def _forward_step(data_iterator, model):
    tokens, labels, position_ids = next(data_iterator)
    output = model(tokens, position_ids, None, labels=labels)

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def _data(iteration: int, dp_rank: int):
    for mb in range(MICROBATCHES):
        g = torch.Generator().manual_seed(10_000 * iteration + 100 * dp_rank + mb)
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g)
        yield tokens, labels, torch.arange(SEQ).unsqueeze(0).expand(MICRO_BATCH, SEQ)


def _build(spec: dict):
    """Model (DDP-wrapped chunk of this pp rank), the GPTModel, megatron optimizer and LR scheduler."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core import parallel_state
    from megatron.core.transformer.module import Float16Module

    from megatron_zb.model import build_gpt_chunks, cpu_gpt_config

    prec = spec["precision"]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[prec]
    cfg = cpu_gpt_config(num_layers=NUM_LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, hidden_dropout=0.0,
                         attention_dropout=0.0, add_bias_linear=spec.get("bias", False), bf16=prec == "bf16",
                         fp16=prec == "fp16", params_dtype=dtype,
                         pipeline_dtype=dtype)
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    [chunk] = build_gpt_chunks(config=cfg, vocab_size=VOCAB, max_sequence_length=SEQ, stage_to_rank=list(range(pp)),
                               seed=SEED)
    gpt = chunk.module
    module = gpt if prec == "fp32" else Float16Module(gpt.config, gpt)
    ddp = DistributedDataParallel(
        config=gpt.config, module=module,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                 use_distributed_optimizer=spec["dist_opt"]))
    opt_cfg = OptimizerConfig(
        optimizer="adam", lr=spec.get("lr", 3e-3), min_lr=3e-4, weight_decay=0.05, clip_grad=spec["clip_grad"],
        decoupled_weight_decay=spec.get("adamw", True), bf16=prec == "bf16", fp16=prec == "fp16",
        use_distributed_optimizer=spec["dist_opt"], loss_scale=spec.get("loss_scale"),
        initial_loss_scale=spec.get("initial_loss_scale", 2.0 ** 16), loss_scale_window=spec.get("loss_scale_window", 4),
        hysteresis=2, min_loss_scale=1.0, log_num_zeros_in_grad=spec.get("log_zeros", True))
    opt = get_megatron_optimizer(opt_cfg, [ddp], use_gloo_process_groups=False)
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=opt_cfg.lr, min_lr=opt_cfg.min_lr, lr_warmup_steps=4,
                                    lr_decay_steps=ITERS, lr_decay_style="cosine", start_wd=0.02, end_wd=0.1,
                                    wd_incr_steps=ITERS, wd_incr_style="linear")
    gpt.config.finalize_model_grads_func = finalize_model_grads
    gpt.config.no_sync_func = ddp.no_sync
    return ddp, gpt, opt, sched


def _optimizer_tensors(opt) -> list[torch.Tensor]:
    """Main params and Adam state of every part, in a fixed order (copies)."""
    out = []
    for part in opt.chained_optimizers:
        if part.optimizer is None:
            continue
        for group in part.optimizer.param_groups:
            for p in group["params"]:
                out.append(p.detach().clone())
                st = part.optimizer.state.get(p, {})
                for k in sorted(st):
                    out.append(st[k].detach().clone() if torch.is_tensor(st[k]) else torch.tensor(float(st[k])))
    return out


def _state_tensors(obj) -> list[Any]:
    """Every leaf of a (sharded) state dict in traversal order: tensors (ShardedTensor data) and scalars."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase, ShardedTensor

    out: list[Any] = []

    def walk(x):
        if isinstance(x, LocalNonpersistentObject):
            walk(x.unwrap())
        elif isinstance(x, ShardedTensor):
            out.append(x.key)
            out.append(x.data.detach().clone())
        elif isinstance(x, ShardedBase):
            out.append(getattr(x, "key", type(x).__name__))
            data = getattr(x, "data", None)
            if data is not None:
                walk(data)
        elif torch.is_tensor(x):
            out.append(x.detach().clone())
        elif isinstance(x, dict):
            pad = x.get("padding")
            if isinstance(pad, LocalNonpersistentObject) and pad.unwrap() is True:
                out.append("padding")  # the distributed optimizer's uninitialised (torch.empty) gaps
                return
            for k in sorted(x, key=str):
                out.append(str(k))
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        else:
            out.append(x)

    walk(obj)
    return out


def _inject_inf(gpt, inner) -> bool:
    """Write inf into the first gradient element of this stage's largest parameter (every DP rank
    does, as after a real overflow). Returns whether this rank's optimizer owns that element
    (with the distributed optimizer exactly one DP rank's shard holds it)."""
    name, param = max(gpt.named_parameters(), key=lambda kv: kv[1].numel())
    param.main_grad.view(-1)[0] = float("inf")
    part = inner.chained_optimizers[0]
    if not hasattr(part, "_get_model_param_range_map"):
        return True
    try:
        return part._get_model_param_range_map(param)["param"].start == 0
    except KeyError:  # no part of this param is in this rank's shard
        return False


def _train(spec: dict, mode: str) -> dict:
    """Train ITERS iterations in ``mode`` ("sync", "exact", "inplace"); return the trace."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

    torch.manual_seed(SEED)
    ddp, gpt, inner, sched = _build(spec)
    mode, bare = mode.removesuffix("-bare"), mode.endswith("-bare")
    opt = inner.chained_optimizers[0] if bare else inner  # "-bare": the megatron optimizer without its chain
    if mode != "sync":
        opt = PostValidationOptimizer(opt, exact=(mode == "exact"), warmup_iters=spec.get("warmup", 2),
                                      clean_iters_required=spec.get("clean", 1), timeout=60.0)
    gpt.config.grad_scale_func = opt.scale_loss
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    results: dict[int, tuple] = {}
    losses, scales, lrs, reports, checkpoint, owns_inf = [], [], [], [], None, {}

    def record(report):
        results[report.iteration] = tuple(report.result)
        reports.append((report.iteration, report.clipped, report.found_inf, report.rolled_back,
                        report.provisional.update_successful))
        if report.changed and not report.result.update_successful:
            sched.step(increment=-1)  # the loop advanced the schedule on the provisional success

    if mode != "sync":
        opt.register_validation_hook(record)

    t0 = time.perf_counter()
    for it in range(spec.get("iters", ITERS)):
        if mode != "sync":
            opt.begin_iteration()
        scales.append(opt.get_loss_scale().item())
        lrs.append(opt.param_groups[0]["lr"])
        ddp.zero_grad_buffer()
        opt.zero_grad()
        out = forward_backward_pipelining_without_interleaving(
            forward_step_func=_forward_step, data_iterator=_data(it, dp_rank), model=[ddp],
            num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=MICRO_BATCH)
        if out:
            losses.append(torch.stack([o["lm loss"] for o in out]).mean().item())
        if (it, pp_rank) in spec.get("inject", ()):
            owns_inf[it] = _inject_inf(gpt, inner)
        result = opt.step()
        if mode == "sync" or not opt.pending:  # final now (synchronous or locally proven clipping)
            results[it] = tuple(result)
        if result[0]:
            sched.step(increment=1)
        if it == spec.get("checkpoint_at"):
            was_pending = mode != "sync" and opt.pending
            sd = opt.state_dict()
            # (megatron-core 0.16.1's default distributed-optimizer format is broken; Megatron-LM passes this)
            ssd = opt.sharded_state_dict(gpt.sharded_state_dict(),
                                         metadata={"distrib_optim_sharding_type": "dp_reshardable"})
            checkpoint = {"was_pending": was_pending, "rolled_back": bool(was_pending and opt.last_report.rolled_back),
                          "state_dict": _state_tensors(sd), "sharded": _state_tensors(ssd)}
    if mode != "sync":
        opt.finalize()
    elapsed = time.perf_counter() - t0
    return {
        "results": [results[i] for i in sorted(results)], "losses": losses, "scales": scales, "lrs": lrs,
        "final_scale": opt.get_loss_scale().item(),
        "params": [p.detach().clone() for p in gpt.parameters()],
        "optimizer": _optimizer_tensors(inner),
        "counters": None if mode == "sync" else opt.counters(), "reports": reports,
        "checkpoint": checkpoint, "elapsed": elapsed, "pp_rank": pp_rank, "dp_rank": dp_rank, "owns_inf": owns_inf,
    }


@torch.no_grad()
def _copy_training_state(src_gpt, src_opt, dst_gpt, dst_opt) -> None:
    """Make the destination model + megatron optimizer bitwise equal to the source."""
    for a, b in zip(src_gpt.parameters(), dst_gpt.parameters()):
        b.copy_(a)
    for pa, pb in zip(src_opt.chained_optimizers, dst_opt.chained_optimizers):
        if pa.optimizer is None:
            continue
        for ga, gb in zip(pa.optimizer.param_groups, pb.optimizer.param_groups):
            for qa, qb in zip(ga["params"], gb["params"]):
                qb.copy_(qa)
                sa = pa.optimizer.state.get(qa, {})
                if sa:
                    pb.optimizer.state[qb] = {k: v.clone() for k, v in sa.items()}
                else:
                    pb.optimizer.state.pop(qb, None)
        if getattr(pa, "grad_scaler", None) is not None:
            pb.grad_scaler.load_state_dict(copy.deepcopy(pa.grad_scaler.state_dict()))


def _lockstep_diffs(ref_gpt, ref_opt, gpt, opt) -> tuple[float, list[str]]:
    """Largest relative difference of main params / optimizer state, and the model params that
    differ by more than one ulp of their dtype."""
    worst, bad = 0.0, []
    for a, b in zip(_optimizer_tensors(opt), _optimizer_tensors(ref_opt)):
        worst = max(worst, _rel(a, b))
    for (name, a), b in zip(gpt.named_parameters(), ref_gpt.parameters()):
        a, b = a.detach(), b.detach()
        if a.dtype == torch.float32:
            worst = max(worst, _rel(a, b))
        else:
            info = torch.finfo(a.dtype)  # one ulp: eps * |b| for normal numbers, eps * tiny for subnormals
            excess = (a.float() - b.float()).abs() - info.eps * b.float().abs().clamp(min=info.tiny)
            if bool((excess > 0).any()):
                i = int(excess.argmax())
                bad.append(f"{name}[{i}]: {a.view(-1)[i].item()!r} vs {b.view(-1)[i].item()!r}")
    return worst, bad


def _train_lockstep(spec: dict) -> dict:
    """In-place post-validation run in lock-step with a synchronous twin whose state it is given
    before every iteration: each rollback's error is measured on its own, not amplified by the
    training that follows (which in bf16/fp16 turns any round-off into bf16-size differences)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

    torch.manual_seed(SEED)
    ref_ddp, ref_gpt, ref_opt, ref_sched = _build(spec)
    torch.manual_seed(SEED)
    ddp, gpt, inner, sched = _build(spec)
    opt = PostValidationOptimizer(inner, exact=False, warmup_iters=spec.get("warmup", 2),
                                  clean_iters_required=spec.get("clean", 1), timeout=60.0)
    ref_gpt.config.grad_scale_func = ref_opt.scale_loss
    gpt.config.grad_scale_func = opt.scale_loss
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    ref_results, results, per_step, problems = {}, {}, [], []

    def record(report):
        results[report.iteration] = tuple(report.result)
        if report.changed and not report.result.update_successful:
            sched.step(increment=-1)

    opt.register_validation_hook(record)

    iters = spec.get("iters", ITERS)
    for it in range(iters + 1):
        opt.begin_iteration()
        if it > 0:
            worst, bad = _lockstep_diffs(ref_gpt, ref_opt, gpt, inner)
            per_step.append(worst)
            if bad:
                problems.append(f"iteration {it - 1}: model params differ by more than one ulp: {bad}")
            if opt.param_groups[0]["lr"] != ref_opt.param_groups[0]["lr"]:
                problems.append(f"iteration {it - 1}: lr {opt.param_groups[0]['lr']} != {ref_opt.param_groups[0]['lr']}")
            if opt.get_loss_scale().item() != ref_opt.get_loss_scale().item():
                problems.append(f"iteration {it - 1}: loss scale differs")
        if it == iters:
            break
        _copy_training_state(ref_gpt, ref_opt, gpt, inner)
        for d, g, o, s, res in ((ref_ddp, ref_gpt, ref_opt, ref_sched, ref_results), (ddp, gpt, opt, sched, results)):
            d.zero_grad_buffer()
            o.zero_grad()
            forward_backward_pipelining_without_interleaving(
                forward_step_func=_forward_step, data_iterator=_data(it, dp_rank), model=[d],
                num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=MICRO_BATCH)
            if (it, pp_rank) in spec.get("inject", ()):
                _inject_inf(g, ref_opt if o is ref_opt else inner)
            result = o.step()
            if o is ref_opt or not opt.pending:
                res[it] = tuple(result)
            if result[0]:
                s.step(increment=1)
    if [ref_results[i] for i in range(iters)] != [results[i] for i in range(iters)]:
        problems.append(f"step results differ: {ref_results} vs {results}")
    return {"max_step_rel": max(per_step), "per_step": per_step, "problems": problems, "counters": opt.counters()}


def _run_modes(spec: dict, modes: tuple[str, ...]) -> dict[str, dict]:
    init_parallel_state(pipeline_model_parallel_size=spec["pp"], seed=SEED)
    return {mode: (_train_lockstep(spec) if mode == "lockstep" else _train(spec, mode)) for mode in modes}


def _assert_close(a: Any, b: Any, *, exact: bool, what: str, rtol: float = 1e-6) -> None:
    if exact:
        if torch.is_tensor(a):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{what}: not bitwise equal"
        else:
            assert a == b, f"{what}: {a!r} != {b!r}"
        return
    if torch.is_tensor(a):
        assert a.shape == b.shape, what
        r = _rel(a.float(), b.float())
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
    out = run_distributed(_run_modes, world_size=world_size, args=(spec, modes), timeout=timeout)
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
    out = run_distributed(_run_modes, world_size=2, args=(spec, ("sync-bare", "exact-bare")), timeout=120)
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
    ddp, gpt, inner, _ = _build(spec)
    opt = PostValidationOptimizer(inner, exact=False, warmup_iters=0, timeout=1.0 if case == "timeout" else 30.0)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()

    def iteration(it):
        ddp.zero_grad_buffer()
        forward_backward_pipelining_without_interleaving(
            forward_step_func=_forward_step, data_iterator=_data(it, 0), model=[ddp], num_microbatches=MICROBATCHES,
            seq_length=SEQ, micro_batch_size=MICRO_BATCH)

    iteration(0)
    if case == "inf-after-zeroed-grads" and pp_rank == 1:
        _inject_inf(gpt, inner)
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

"""The distributed ranks of ``tests/optimizer/test_post_validation.py``: a tiny GPT trained on megatron-core's
1F1B with megatron-core's synchronous optimizer step and wrapped in post-validation.

Test code, not the product's run path. Every rank builds its chunk with the product's wiring
(:mod:`megatron_zb.training.wiring`: Float16Module, megatron-core ``DistributedDataParallel``,
``get_megatron_optimizer``) -- so the tests exercise what ``pretrain_gpt_zb.py`` runs -- and
megatron-core's ``OptimizerParamScheduler``; :func:`train` trains :data:`ITERS` iterations in one
mode and returns what the tests compare, :func:`train_lockstep` runs the in-place mode in lock-step
with a synchronous twin, :func:`run_modes` runs several modes in the same ranks (called through
:func:`megatron_zb.testing.run_distributed`). The model: 4 layers, hidden 32, 2 heads, sequence 16,
vocabulary 64, micro batch 2, 4 micro batches per iteration.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

from megatron_zb.optimizer import PostValidationOptimizer
from megatron_zb.testing.distributed import init_parallel_state

__all__ = ["ITERS", "MICROBATCHES", "MICRO_BATCH", "SEED", "SEQ", "build", "forward_step", "inject_inf",
           "microbatches", "optimizer_tensors", "relative_difference", "run_modes", "state_tensors", "train",
           "train_lockstep"]

NUM_LAYERS, HIDDEN, HEADS, SEQ, VOCAB, MICRO_BATCH, MICROBATCHES = 4, 32, 2, 16, 64, 2, 4
ITERS = 32
"""Training iterations of a run (a spec's ``iters`` overrides it)."""
SEED = 1234


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative difference ||a - b|| / ||b|| (L2 over the tensor; the absolute norm if b is zero)."""
    scale = b.double().norm().item()
    diff = (a.double() - b.double()).norm().item()
    return diff / scale if scale else diff


def forward_step(data_iterator, model):
    tokens, labels, position_ids = next(data_iterator)
    output = model(tokens, position_ids, None, labels=labels)

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def microbatches(iteration: int, dp_rank: int):
    for mb in range(MICROBATCHES):
        g = torch.Generator().manual_seed(10_000 * iteration + 100 * dp_rank + mb)
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g)
        yield tokens, labels, torch.arange(SEQ).unsqueeze(0).expand(MICRO_BATCH, SEQ)


def build(spec: dict):
    """This pipeline rank's chunk wired by the product (:mod:`megatron_zb.training.wiring`: Float16Module,
    megatron-core DDP, ``get_megatron_optimizer``) and megatron-core's LR scheduler; returns
    ``(ddp, gpt, optimizer, scheduler)``. ``spec``: ``precision`` (``"fp32"``, ``"bf16"``, ``"fp16"``),
    ``dist_opt``, ``clip_grad``, and optionally ``bias``, ``lr``, ``adamw``, ``loss_scale``,
    ``initial_loss_scale``, ``loss_scale_window``, ``log_zeros``."""
    from megatron.core import parallel_state
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_zb.model import build_gpt_chunks, cpu_gpt_config
    from megatron_zb.training.run_config import OptimConfig, ParallelConfig, PrecisionConfig
    from megatron_zb.training.wiring import megatron_optimizer, wrap_chunks

    prec = spec["precision"]
    precision = PrecisionConfig(fp16=prec == "fp16", bf16=prec == "bf16", accumulate_allreduce_grads_in_fp32=True,
                                loss_scale=spec.get("loss_scale"),
                                initial_loss_scale=spec.get("initial_loss_scale", 2.0 ** 16),
                                loss_scale_window=spec.get("loss_scale_window", 4), hysteresis=2, min_loss_scale=1.0)
    parallel = ParallelConfig(world_size=torch.distributed.get_world_size(),
                              pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
                              data_parallel_size=parallel_state.get_data_parallel_world_size(),
                              use_distributed_optimizer=spec["dist_opt"])
    optim = OptimConfig(lr=spec.get("lr", 3e-3), min_lr=3e-4, weight_decay=0.05, clip_grad=spec["clip_grad"],
                        decoupled_weight_decay=spec.get("adamw", True),
                        log_num_zeros_in_grad=spec.get("log_zeros", True))
    cfg = cpu_gpt_config(num_layers=NUM_LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, hidden_dropout=0.0,
                         attention_dropout=0.0, add_bias_linear=spec.get("bias", False), bf16=precision.bf16,
                         fp16=precision.fp16, params_dtype=precision.params_dtype,
                         pipeline_dtype=precision.params_dtype)
    pp, rank = parallel.pipeline_model_parallel_size, parallel_state.get_pipeline_model_parallel_rank()
    [chunk] = build_gpt_chunks(config=cfg, vocab_size=VOCAB, max_sequence_length=SEQ, stage_to_rank=list(range(pp)),
                               seed=SEED)
    gpt = chunk.module
    [ddp] = wrap_chunks([gpt], first_last=[(rank == 0, rank == pp - 1)], parallel=parallel, precision=precision,
                        device=torch.device("cpu"))
    opt = megatron_optimizer(optim, precision=precision, parallel=parallel, modules=[ddp])
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=optim.lr, min_lr=optim.min_lr, lr_warmup_steps=4,
                                    lr_decay_steps=ITERS, lr_decay_style="cosine", start_wd=0.02, end_wd=0.1,
                                    wd_incr_steps=ITERS, wd_incr_style="linear")
    return ddp, gpt, opt, sched


def optimizer_tensors(opt) -> list[torch.Tensor]:
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


def state_tensors(obj) -> list[Any]:
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


def inject_inf(gpt, inner) -> bool:
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


def train(spec: dict, mode: str) -> dict:
    """Train ITERS iterations in ``mode`` ("sync", "exact", "inplace"); return the trace."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

    torch.manual_seed(SEED)
    ddp, gpt, inner, sched = build(spec)
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
            forward_step_func=forward_step, data_iterator=microbatches(it, dp_rank), model=[ddp],
            num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=MICRO_BATCH)
        if out:
            losses.append(torch.stack([o["lm loss"] for o in out]).mean().item())
        if (it, pp_rank) in spec.get("inject", ()):
            owns_inf[it] = inject_inf(gpt, inner)
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
                          "state_dict": state_tensors(sd), "sharded": state_tensors(ssd)}
    if mode != "sync":
        opt.finalize()
    elapsed = time.perf_counter() - t0
    return {
        "results": [results[i] for i in sorted(results)], "losses": losses, "scales": scales, "lrs": lrs,
        "final_scale": opt.get_loss_scale().item(),
        "params": [p.detach().clone() for p in gpt.parameters()],
        "optimizer": optimizer_tensors(inner),
        "counters": None if mode == "sync" else opt.counters(), "reports": reports,
        "checkpoint": checkpoint, "elapsed": elapsed, "pp_rank": pp_rank, "dp_rank": dp_rank, "owns_inf": owns_inf,
    }


@torch.no_grad()
def copy_training_state(src_gpt, src_opt, dst_gpt, dst_opt) -> None:
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


def lockstep_diffs(ref_gpt, ref_opt, gpt, opt) -> tuple[float, list[str]]:
    """Largest relative difference of main params / optimizer state, and the model params that
    differ by more than one ulp of their dtype."""
    worst, bad = 0.0, []
    for a, b in zip(optimizer_tensors(opt), optimizer_tensors(ref_opt)):
        worst = max(worst, relative_difference(a, b))
    for (name, a), b in zip(gpt.named_parameters(), ref_gpt.parameters()):
        a, b = a.detach(), b.detach()
        if a.dtype == torch.float32:
            worst = max(worst, relative_difference(a, b))
        else:
            info = torch.finfo(a.dtype)  # one ulp: eps * |b| for normal numbers, eps * tiny for subnormals
            excess = (a.float() - b.float()).abs() - info.eps * b.float().abs().clamp(min=info.tiny)
            if bool((excess > 0).any()):
                i = int(excess.argmax())
                bad.append(f"{name}[{i}]: {a.view(-1)[i].item()!r} vs {b.view(-1)[i].item()!r}")
    return worst, bad


def train_lockstep(spec: dict) -> dict:
    """In-place post-validation run in lock-step with a synchronous twin whose state it is given
    before every iteration: each rollback's error is measured on its own, not amplified by the
    training that follows (which in bf16/fp16 turns any round-off into bf16-size differences)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

    torch.manual_seed(SEED)
    ref_ddp, ref_gpt, ref_opt, ref_sched = build(spec)
    torch.manual_seed(SEED)
    ddp, gpt, inner, sched = build(spec)
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
            worst, bad = lockstep_diffs(ref_gpt, ref_opt, gpt, inner)
            per_step.append(worst)
            if bad:
                problems.append(f"iteration {it - 1}: model params differ by more than one ulp: {bad}")
            if opt.param_groups[0]["lr"] != ref_opt.param_groups[0]["lr"]:
                problems.append(f"iteration {it - 1}: lr {opt.param_groups[0]['lr']} != {ref_opt.param_groups[0]['lr']}")
            if opt.get_loss_scale().item() != ref_opt.get_loss_scale().item():
                problems.append(f"iteration {it - 1}: loss scale differs")
        if it == iters:
            break
        copy_training_state(ref_gpt, ref_opt, gpt, inner)
        for d, g, o, s, res in ((ref_ddp, ref_gpt, ref_opt, ref_sched, ref_results), (ddp, gpt, opt, sched, results)):
            d.zero_grad_buffer()
            o.zero_grad()
            forward_backward_pipelining_without_interleaving(
                forward_step_func=forward_step, data_iterator=microbatches(it, dp_rank), model=[d],
                num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=MICRO_BATCH)
            if (it, pp_rank) in spec.get("inject", ()):
                inject_inf(g, ref_opt if o is ref_opt else inner)
            result = o.step()
            if o is ref_opt or not opt.pending:
                res[it] = tuple(result)
            if result[0]:
                s.step(increment=1)
    if [ref_results[i] for i in range(iters)] != [results[i] for i in range(iters)]:
        problems.append(f"step results differ: {ref_results} vs {results}")
    return {"max_step_rel": max(per_step), "per_step": per_step, "problems": problems, "counters": opt.counters()}


def run_modes(spec: dict, modes: tuple[str, ...]) -> dict[str, dict]:
    init_parallel_state(pipeline_model_parallel_size=spec["pp"], seed=SEED)
    return {mode: (train_lockstep(spec) if mode == "lockstep" else train(spec, mode)) for mode in modes}

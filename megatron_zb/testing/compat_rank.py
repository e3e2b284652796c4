"""The rank side of the compatibility matrix: run several *arms* in the same processes.

An arm is megatron-core's reference schedule (``"megatron-core"``) or one schedule family of
megatron-zb. :func:`run_arms` runs inside a rank of :func:`megatron_zb.testing.run_distributed`:
it initialises ``parallel_state`` once, then for every arm builds the chunks (layout-independent
weights: the same global layer gets the same weights in every placement), wraps them
(``Float16Module`` for bf16/fp16, megatron-core DDP), builds megatron-core's optimizer
(``get_megatron_optimizer``; the post-validation wrapper for megatron-zb arms when the feature
asks for it), and trains ``feature.iterations`` iterations on fixed data. It returns, per arm,
this rank's raw results (no comparison happens here): see :class:`ArmResult`. The model is the
:class:`~megatron_zb.testing.tiny_gpt.TinyGPT` of :func:`tiny_gpt_of` (the feature's options);
:func:`run_specs` runs several launches' worth of arms (features) one after another. A
``vocab_parallel`` feature's megatron-zb arms run the family's vocabulary form on sliced vocabulary
layers (:mod:`~megatron_zb.testing.compat_vocab`); its reference arm the unsliced model.

Refusals: anything raised while *setting an arm up* (building, wrapping, the optimizer, the
schedule and this rank's lowered plan) of type ``ValueError`` / ``NotImplementedError`` /
``ScheduleError`` / ``ArgumentError`` / ``PostValidationError`` is a refusal; the ranks agree on
it (an all-reduce) and skip the arm. Anything raised while running is an error (re-raised).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..schedules.ir import Placement
from .compat_features import Feature, ModelShape

__all__ = ["FP16_INITIAL_SCALE", "REFERENCE", "ArmResult", "GroupSpec", "run_arms", "run_specs", "tiny_gpt_of"]

REFERENCE = "megatron-core"
"""The name of the reference arm."""

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FP16_INITIAL_SCALE = 2.0 ** 12
"""fp16 features: the dynamic loss scaler's initial scale (hysteresis 1: the first overflow halves it)."""


@dataclass(frozen=True)
class GroupSpec:
    """One launch: a feature, a placement group and the arms to run in order.

    Attributes:
        feature: the configuration.
        model: the model shape (``model.pp`` is the pipeline size of the megatron-zb arms).
        placement: the placement group (a key of :data:`~megatron_zb.testing.compat_features.FAMILIES`).
        arms: arm names (:data:`REFERENCE` and/or family names).
        pp: pipeline size of this launch (``model.pp``; 1 for the V reference launch).
    """

    feature: Feature
    model: ModelShape
    placement: Placement
    arms: tuple[str, ...]
    pp: int


@dataclass
class ArmResult:
    """One rank's results of one arm (keys carry the rank's TP and DP rank: every copy compares).

    Attributes:
        refused: the refusal message, or None.
        losses: ``(iteration, tp_rank, dp_rank) -> [loss of each microbatch]`` (last stage only).
        grads: ``(iteration, name, tp_rank, dp_rank) -> this rank's gradient``: ``main_grad``
            after ``finalize_model_grads`` (before it, with the distributed optimizer), the
            local tensor-parallel shard.
        params: ``(name, tp_rank, dp_rank) -> parameter`` after the last step.
        steps: ``(update_successful, loss scale)`` per iteration.
        w_deferred: weight-gradient computations megatron-zb's store ran (0 for the reference).
        rollbacks: post-validation rollbacks on this rank.
        order: ``(op, local chunk, microbatch)`` of every forward and backward, in execution order.
    """

    refused: str | None = None
    losses: dict[tuple, list[torch.Tensor]] = field(default_factory=dict)
    grads: dict[tuple, torch.Tensor] = field(default_factory=dict)
    params: dict[tuple, torch.Tensor] = field(default_factory=dict)
    steps: list[tuple[bool, float]] = field(default_factory=list)
    w_deferred: int = 0
    rollbacks: int = 0
    order: list[tuple[str, int, int]] = field(default_factory=list)


def _refusal_types() -> tuple[type[BaseException], ...]:
    from ..optimizer import PostValidationError
    from ..schedules import ScheduleError
    from ..training.arguments.common import ArgumentError

    return (ValueError, NotImplementedError, ScheduleError, ArgumentError, PostValidationError)


# ---------------------------------------------------------------------- data and steps
def _microbatches(model: ModelShape, iteration: int, dp_rank: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(7 + 1000 * dp_rank + 100_000 * iteration)
    out = []
    for mb in range(model.num_microbatches):
        tokens = torch.randint(0, model.vocab, (model.micro_batch, model.seq), generator=g)
        out.append(dict(tokens=tokens, labels=torch.roll(tokens, -1, dims=1), mb=mb,
                        position_ids=torch.arange(model.seq).unsqueeze(0).expand(model.micro_batch, model.seq)))
    return out


class _Mark(torch.autograd.Function):
    """Identity whose backward logs that a chunk's backward for a microbatch started. Its output
    shares ``x``'s storage without being a view (``detach``): schedules pseudo-free stage outputs
    (``deallocate_pipeline_outputs``), which megatron-core refuses for a view."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, log: list, event: tuple) -> torch.Tensor:
        ctx.log, ctx.event = log, event
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.log.append(ctx.event)
        return grad, None, None


def _forward_step(*, chunk_index: dict[int, int], order: list, multiplier: float, per_token: bool) -> Callable:
    """megatron-core forward step over :func:`_microbatches`, logging F and B (see :class:`_Mark`)."""

    def loss_func(output: torch.Tensor):
        losses = output.float() * multiplier
        if per_token:
            total, count = losses.sum(), torch.tensor(losses.numel(), dtype=torch.int)
            return total, count, {"lm loss": torch.stack([total.detach(), count.float()])}
        loss = losses.mean()
        return loss, {"lm loss": loss.detach()}

    def forward_step(data_iterator: Any, model: torch.nn.Module):
        batch = next(data_iterator)
        chunk = chunk_index[id(model)]
        order.append(("F", chunk, batch["mb"]))
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        return _Mark.apply(output, order, ("B", chunk, batch["mb"])), loss_func

    return forward_step


# ---------------------------------------------------------------------- building an arm
def _stage_to_rank(placement: Placement, pp: int) -> list[int]:
    """The placement's ``stage_to_rank`` on ``pp`` ranks (interleaved: 2 chunks per rank; PP=1: one stage)."""
    if pp == 1:
        return [0]
    return Placement(placement).stage_to_rank(pp, 2)


def tiny_gpt_of(spec: GroupSpec, arm: str) -> Any:
    """The :class:`~megatron_zb.testing.tiny_gpt.TinyGPT` one arm of ``spec`` builds: the matrix's
    shape, the feature's parallel layout, precision and model options, and the placement's split."""
    from .tiny_gpt import TinyGPT

    f, m = spec.feature, spec.model
    dtype = _DTYPES[f.precision]
    options = dict(f.tiny_gpt)
    config = dict(params_dtype=dtype, pipeline_dtype=dtype, bf16=f.precision == "bf16", fp16=f.precision == "fp16",
                  calculate_per_token_loss=f.per_token_loss, batch_p2p_comm=False,
                  **options.pop("config_options", {}))
    return TinyGPT(pp=spec.pp, tp=f.tp, dp=f.dp, sequence_parallel=f.sequence_parallel,
                   gradient_accumulation_fusion=f.grad_fusion and arm != REFERENCE,
                   num_layers=f.num_layers or m.num_layers, hidden=m.hidden, heads=m.heads, seq=m.seq, vocab=m.vocab,
                   micro_batch=m.micro_batch, num_microbatches=m.num_microbatches, seed=m.seed,
                   config_options=config, split=f.split.get(spec.placement, {}) if spec.pp > 1 else {}, **options)


def _layout(spec: GroupSpec) -> tuple[Any, Any]:
    """The feature's :class:`~megatron_zb.training.run_config.ParallelConfig` and
    :class:`~megatron_zb.training.run_config.PrecisionConfig` (fp16: gradients in fp32, a small
    initial loss scale and no hysteresis, so that the scaler's decisions show in three iterations)."""
    from ..training.run_config import ParallelConfig, PrecisionConfig

    f = spec.feature
    parallel = ParallelConfig(use_distributed_optimizer=f.distributed_optimizer)
    precision = PrecisionConfig(fp16=f.precision == "fp16", bf16=f.precision == "bf16",
                                initial_loss_scale=FP16_INITIAL_SCALE, hysteresis=1, min_loss_scale=1.0,
                                accumulate_allreduce_grads_in_fp32=f.precision != "fp32")
    return parallel, precision


def _build_modules(spec: GroupSpec, arm: str) -> tuple[list[Any], list[Any], Any]:
    """This rank's chunks and the modules to run, wrapped and hooked up by the product's own wiring
    (:func:`megatron_zb.training.wiring.wrap_chunks`; every arm: get_megatron_optimizer needs
    DDP-wrapped chunks, at DP=1 just the main_grad buffer), and for a ``vocab_parallel`` feature's
    megatron-zb arm ``(VocabParallelModel, the slices' DDP module)`` (:mod:`.compat_vocab`), else None."""
    from ..training.wiring import wrap_chunks
    from .distributed import device_from_env
    from .tiny_gpt import build_chunks

    chunks = build_chunks(tiny_gpt_of(spec, arm), _stage_to_rank(spec.placement, spec.pp))
    vocab = None
    if spec.feature.vocab_parallel and arm != REFERENCE:  # the word embedding and output layer sliced
        from .compat_vocab import attach_slices

        vocab = attach_slices(chunks, vocab=spec.model.vocab, hidden=spec.model.hidden, seed=spec.model.seed,
                              dtype=_DTYPES[spec.feature.precision], device=device_from_env())
    parallel, precision = _layout(spec)
    modules = wrap_chunks([c.module for c in chunks],
                          first_last=[(c.plan.pre_process, c.plan.post_process) for c in chunks],
                          parallel=parallel, precision=precision, device=device_from_env())
    if arm == REFERENCE and spec.placement == Placement.INTERLEAVED and spec.pp > 1:
        # megatron-core's interleaved schedule reads the virtual size from the first chunk's config.
        for c in chunks:
            c.module.config.virtual_pipeline_model_parallel_size = len(chunks)
            c.module.config.microbatch_group_size_per_vp_stage = spec.pp
    return chunks, modules, vocab


def _build_optimizer(spec: GroupSpec, arm: str, chunks: list[Any], modules: list[Any]) -> Any:
    """megatron-core's Adam through the product's wiring (lr 0.01, the feature's clipping); the
    post-validation wrapper on megatron-zb's arms (no warm-up, no local-clip synchronisation)."""
    from ..training.run_config import OptimConfig
    from ..training.wiring import megatron_optimizer

    f = spec.feature
    parallel, precision = _layout(spec)
    opt = megatron_optimizer(OptimConfig(lr=0.01, clip_grad=f.clip_grad), precision=precision, parallel=parallel,
                             modules=modules)
    if f.post_validation and arm != REFERENCE:
        from ..optimizer import PostValidationOptimizer

        opt = PostValidationOptimizer(opt, exact=f.post_validation == "exact", warmup_iters=0,
                                      clean_iters_required=0, sync_on_local_clip=False, timeout=120.0)
    for c in chunks:
        c.module.config.grad_scale_func = opt.scale_loss
    return opt


def _forward_backward_func(spec: GroupSpec, arm: str, vocab: Any) -> Any:
    """megatron-core's (reference) or megatron-zb's ``forward_backward_func`` of the arm (with ``vocab``, a
    :class:`~megatron_zb.runtime.vocab_runtime.VocabParallelModel`: the family's vocabulary form)."""
    if arm == REFERENCE:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return get_forward_backward_func()
    from ..runtime import NotBuilt, get_forward_backward_func as zb_func
    from ..schedules.ir import ScheduleError

    if vocab is not None:
        from .compat_vocab import vocab_schedule

        fb = zb_func(vocab_schedule(arm), num_chunks=2, timeout=60.0, vocab_parallel=vocab)
    else:
        fb = zb_func(arm, num_chunks=2, timeout=60.0)
    from megatron.core import parallel_state

    group = parallel_state.get_pipeline_model_parallel_group()
    outcome = fb.install(group.size(), spec.model.num_microbatches)  # rank 0's schedule on every rank (collective)
    if isinstance(outcome, NotBuilt):
        raise ScheduleError(outcome.reason)   # a refusal, as every rank agrees
    fb.plan_for(group.size(), spec.model.num_microbatches, group.rank())  # validate the schedule up front
    return fb


def _setup(spec: GroupSpec, arm: str) -> tuple[Any, str | None]:
    """Build the arm; ``(parts, None)`` or ``(None, refusal message)`` agreed by every rank."""
    import torch.distributed as dist

    parts, message = None, None
    try:
        if spec.feature.grad_fusion and arm != REFERENCE:
            from ..runtime.wgrad_kernels import install_megatron_fallback

            install_megatron_fallback()
        if spec.feature.vocab_parallel and arm != REFERENCE:  # a family without a vocabulary form: refused
            from .compat_vocab import vocab_schedule

            vocab_schedule(arm)
        chunks, modules, vocab = _build_modules(spec, arm)
        stepped = modules + [vocab[1]] if vocab else modules  # the slices' DDP: stepped and zeroed, not run
        opt = _build_optimizer(spec, arm, chunks, stepped)
        parts = (chunks, modules, opt, _forward_backward_func(spec, arm, vocab and vocab[0]), vocab)
    except _refusal_types() as e:
        message = f"{type(e).__name__}: {e}"
    flag = torch.tensor([0 if message is None else 1])
    dist.all_reduce(flag)
    if int(flag) and message is None:
        message = "refused on another rank"
    return (None, message) if int(flag) else (parts, None)


# ---------------------------------------------------------------------- running an arm
def _train(spec: GroupSpec, arm: str, parts: Any) -> ArmResult:
    from megatron.core import parallel_state

    from ..model import named_global_parameters
    from .compat_vocab import gathered

    chunks, modules, opt, fb, vocab = parts
    f, m = spec.feature, spec.model
    tp, dp = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_data_parallel_rank()
    res = ArmResult()
    store = getattr(fb, "store", None)
    before = 0 if store is None else store.executed
    index = {id(mod): i for i, mod in enumerate(modules)}
    if f.distributed_optimizer:
        _record_before_finalize(chunks, res, tp, dp)
    for it in range(f.iterations):
        if hasattr(opt, "begin_iteration"):
            opt.begin_iteration()
        for mod in modules + ([vocab[1]] if vocab else []):
            if hasattr(mod, "zero_grad_buffer"):
                mod.zero_grad_buffer()
        opt.zero_grad()
        step = _forward_step(chunk_index=index, order=res.order, multiplier=f.loss_multiplier(it),
                             per_token=f.per_token_loss)
        data = _microbatches(m, it, dp)
        iters = [iter(data) for _ in modules]
        if vocab:
            vocab[0].data_iterator = iter(data)  # every rank: the same micro batches (IF's tokens, S's targets)
        out = fb(forward_step_func=step, data_iterator=iters if len(iters) > 1 else iters[0],
                 model=modules if len(modules) > 1 else modules[0], num_microbatches=len(data), seq_length=m.seq,
                 micro_batch_size=m.micro_batch)
        if out:
            res.losses[(it, tp, dp)] = [d["lm loss"] for d in out]
        if not f.distributed_optimizer:
            for c in chunks:
                for n, p in named_global_parameters(c):
                    res.grads[(it, n, tp, dp)] = p.main_grad.detach().clone()
        if vocab:
            res.grads.update({(it, n, tp, dp): g for n, g in gathered(vocab[0], grads=True).items()})
        ok, _, _ = opt.step()
        # The wrapper's own get_loss_scale() would validate the step at once: read the inner one.
        res.steps.append((bool(ok), float(getattr(opt, "wrapped", opt).get_loss_scale())))
    if hasattr(opt, "finalize"):
        opt.finalize()
        res.rollbacks = opt.counters().rollbacks
    res.params = {(n, tp, dp): p.detach().clone() for c in chunks for n, p in named_global_parameters(c)}
    res.params.update({(n, tp, dp): b.detach().clone() for c in chunks for n, b in _expert_biases(c)})
    if vocab:
        res.params.update({(n, tp, dp): t for n, t in gathered(vocab[0], grads=False).items()})
    res.w_deferred = 0 if store is None else store.executed - before
    return res


def _expert_biases(chunk: Any) -> list[tuple[str, torch.Tensor]]:
    """(global name, buffer) of the chunk's routers' expert biases (``moe_router_enable_expert_bias``:
    ``finalize_model_grads`` updates them once per iteration), compared with the parameters."""
    from ..model import global_param_name

    return [(global_param_name(n, chunk.plan), b) for n, b in chunk.module.named_buffers() if n.endswith(".expert_bias")]


def _record_before_finalize(chunks: list[Any], res: ArmResult, tp: int, dp: int) -> None:
    """Record each iteration's local gradients just before ``finalize_model_grads``.

    With the distributed optimizer, DDP reduce-scatters the gradient buffer: afterwards only
    this rank's shard of ``main_grad`` is reduced and the shard boundaries depend on the chunk
    layout (V: two buffers per rank), so the raw buffer does not compare across placements. The
    local gradients before the reduction do; the reduced ones are checked through the
    parameters after the step.
    """
    from ..model import named_global_parameters

    finalize = chunks[0].module.config.finalize_model_grads_func

    def recording_finalize(*args: Any, **kwargs: Any) -> Any:
        it = len(res.steps)
        for c in chunks:
            for n, p in named_global_parameters(c):
                res.grads[(it, n, tp, dp)] = p.main_grad.detach().clone()
        return finalize(*args, **kwargs)

    for c in chunks:
        c.module.config.finalize_model_grads_func = recording_finalize


def run_specs(specs: tuple[GroupSpec, ...]) -> list[dict[str, ArmResult]]:
    """:func:`run_arms` of each spec in turn, in this rank (one launch for several features)."""
    return [run_arms(spec) for spec in specs]


def run_arms(spec: GroupSpec) -> dict[str, ArmResult]:
    """Run every arm of ``spec`` on this rank (see the module docstring); results by arm name."""
    from megatron.core import parallel_state

    from .distributed import init_parallel_state

    vp = 2 if spec.placement == Placement.INTERLEAVED and spec.pp > 1 else None
    init_parallel_state(tensor_model_parallel_size=spec.feature.tp, pipeline_model_parallel_size=spec.pp,
                        virtual_pipeline_model_parallel_size=vp, seed=spec.model.seed)
    out: dict[str, ArmResult] = {}
    try:
        for arm in spec.arms:
            parts, refused = _setup(spec, arm)
            out[arm] = ArmResult(refused=refused) if refused else _train(spec, arm, parts)
    finally:
        parallel_state.destroy_model_parallel()
    return out

"""A tiny GPT training step, runnable under any schedule, for equality tests and benchmarks.

:func:`run_step` runs inside a rank of :func:`megatron_zb.testing.run_distributed`: it builds the
rank's megatron-core GPT chunks for the schedule's placement (same weights for every layout),
runs one forward/backward over fixed data -- with megatron-core's own
``get_forward_backward_func()`` when ``schedule is None``, else with megatron-zb's -- and
returns the losses and every parameter's full (tensor-parallel-gathered) gradient keyed by its
global name, so results of different layouts compare directly.

The model runs on :func:`~megatron_zb.testing.distributed.device_from_env` (CPU by default,
``MEGATRON_ZB_TEST_DEVICE=cuda`` on a GPU node); results come back on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

import torch

if TYPE_CHECKING:
    from ..schedules.ir import Schedule


@dataclass(frozen=True)
class TinyGPT:
    """Shape and parallel layout of the tiny model (sizes in elements, counts in microbatches)."""

    pp: int = 2
    tp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    ddp: bool = False
    gradient_accumulation_fusion: bool = False
    num_layers: int = 8
    hidden: int = 64
    heads: int = 4
    seq: int = 32
    vocab: int = 128
    micro_batch: int = 2
    num_microbatches: int = 4
    seed: int = 1234
    schedule_options: dict[str, Any] = field(default_factory=dict)
    config_options: dict[str, Any] = field(default_factory=dict)
    """Extra ``TransformerConfig`` fields, e.g. ``normalization="RMSNorm"``, ``recompute_granularity="full"``,
    ``calculate_per_token_loss=True`` (then the loss is the token sum, normalised by megatron-core)."""
    model_options: dict[str, Any] = field(default_factory=dict)
    """Extra ``GPTModel`` arguments, e.g. ``position_embedding_type="rope"``,
    ``share_embeddings_and_output_weights=True``."""
    spec_options: dict[str, Any] = field(default_factory=dict)
    """Arguments of ``get_gpt_layer_local_spec``, e.g. ``qk_layernorm=True``, ``normalization="RMSNorm"``;
    with ``multi_latent_attention=True`` the spec's core attention takes MLA's head sizes
    (:func:`megatron_zb.model.mla.mla_local_spec`, as ``pretrain_gpt_zb.py``'s)."""
    split: dict[str, Any] = field(default_factory=dict)
    """Arguments of :func:`megatron_zb.model.pipeline_split` (``first_stage_layers=1``, ...); empty: even split."""
    layer_spec: str | None = None
    """``"module:function"`` returning the ``TransformerLayer`` spec (then ``spec_options`` must be
    empty); default: megatron-core's local spec with ``spec_options``."""
    delay_wgrad: bool = False
    """Build Transformer Engine modules with delayed weight gradients
    (:func:`megatron_zb.runtime.te_route.enable_delayed_wgrad`)."""
    moe_pattern: tuple[int, ...] = ()
    """Mixture of experts: one 0/1 per global layer (1 = MoE MLP), with ``config_options``' MoE fields
    (``num_moe_experts``, ``moe_router_topk``, ...; DeepSeek's: ``moe_shared_expert_intermediate_size``,
    ``moe_router_score_function``, ``moe_router_enable_expert_bias``, ...); the layer spec is
    :func:`megatron_zb.training.moe_setup.moe_layer_spec` with ``spec_options`` for every layer (SequentialMLP
    experts, seeded per global expert). Empty: dense."""

    def microbatches(self) -> list[dict[str, torch.Tensor]]:
        """The fixed data: ``num_microbatches`` micro batches of random tokens (per DP rank)."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        dp_rank = parallel_state.get_data_parallel_rank() if dist.is_initialized() else 0
        return random_microbatches(self.num_microbatches, vocab=self.vocab, micro_batch=self.micro_batch,
                                   seq=self.seq, seed=7 + 1000 * dp_rank)

    @staticmethod
    def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
        """Combine per-rank results: losses from the rank that has them, all gradients/params.

        A name held by several ranks (tensor- or data-parallel replicas, or the TP-gathered full
        tensor) keeps one copy when every rank's copy is equal, else all copies stacked in rank
        order -- so no rank's copy goes uncompared (e.g. sequence-parallel layernorm gradients
        before their TP all-reduce differ per rank).
        """
        merged: dict[str, Any] = {"losses": [], "grads": {}, "params": {}, "w_deferred": 0, "peak_bytes": [],
                                  "te_delayed_modules": 0, "te_queued_left": 0}
        copies: dict[str, dict[str, list[torch.Tensor]]] = {"grads": {}, "params": {}}
        for r in results:
            merged["losses"] = merged["losses"] or r["losses"]
            for key in copies:
                for n, t in r[key].items():
                    copies[key].setdefault(n, []).append(t)
            merged["w_deferred"] += r["w_deferred"]
            for key in ("te_delayed_modules", "te_queued_left"):
                merged[key] += r.get(key, 0)
            merged["peak_bytes"].append(r.get("peak_bytes"))
        for key, named in copies.items():
            for n, ts in named.items():
                same = all(torch.equal(t, ts[0]) for t in ts[1:])
                merged[key][n] = ts[0] if same else torch.stack(ts)
        return merged


def assert_bitwise_equal(ref: dict[str, Any], got: dict[str, Any], *, what: str) -> None:
    """Assert two merged :func:`run_step` results have bitwise-equal losses and gradients (every
    gradient key of both, every rank's copy as :meth:`TinyGPT.merge` keeps them)."""
    assert len(got["losses"]) == len(ref["losses"]) > 0, f"{what}: {len(got['losses'])} losses, want {len(ref['losses'])}"
    for a, b in zip(got["losses"], ref["losses"]):
        assert torch.equal(a, b), f"{what}: loss {a} != {b}"
    assert got["grads"].keys() == ref["grads"].keys(), f"{what}: gradient names differ"
    for n, g in ref["grads"].items():
        assert torch.equal(got["grads"][n], g), f"{what}: gradient of {n} differs"


def check_te_run(got: dict[str, Any], *, te_modules: int, microbatches: int, split: bool) -> None:
    """The one count check of a delayed-TE run (merged :func:`run_step` results), shared by the CPU
    test double's runs (``tests/runtime/test_te_contract.py``) and the real-TE runs on a GPU
    (``tests/runtime/test_te_real.py``): exactly ``te_modules`` TE modules delayed their weight gradients;
    a split schedule's store ran ``microbatches x (te_modules + 1)`` W's -- every TE module's and
    the output layer's (linear route), not merely some deferred W, which the output layer alone
    would give -- and a fused one none (TE's queued work runs right after each backward); and no
    TE queue holds an entry at the end."""
    assert got["te_delayed_modules"] == te_modules, (got["te_delayed_modules"], te_modules)
    assert got["w_deferred"] == (microbatches * (te_modules + 1) if split else 0), got["w_deferred"]
    assert got["te_queued_left"] == 0, f"{got['te_queued_left']} TE queue entries left at the end"


def random_microbatches(n: int, *, vocab: int, micro_batch: int, seq: int,
                        seed: int) -> list[dict[str, torch.Tensor]]:
    """``n`` micro batches of random tokens from a CPU generator seeded with ``seed``.

    Each is ``tokens`` (``micro_batch`` x ``seq``), ``labels`` (the tokens shifted left by one)
    and ``position_ids``.
    """
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, vocab, (micro_batch, seq), generator=g)
        out.append(dict(tokens=tokens, labels=torch.roll(tokens, -1, dims=1),
                        position_ids=torch.arange(seq).unsqueeze(0).expand(micro_batch, seq)))
    return out


def loss_func(output_tensor: torch.Tensor):
    """Mean of the per-token losses (megatron divides by the number of microbatches)."""
    loss = output_tensor.float().mean()
    return loss, {"lm loss": loss.detach()}


def per_token_loss_func(output_tensor: torch.Tensor):
    """Sum of the per-token losses and the token count (``calculate_per_token_loss``: megatron-core
    divides the gradients by the tokens of the whole batch)."""
    loss = output_tensor.float().sum()
    tokens = torch.tensor(output_tensor.numel(), dtype=torch.int)
    return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.float()])}


def forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module):
    """megatron-core forward step: every stage draws its micro batch (only the ends use it)."""
    from megatron.core.utils import get_model_config

    batch = next(data_iterator)
    device = next(model.parameters()).device
    if device.type != "cpu":
        batch = {k: v.to(device) for k, v in batch.items()}
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, per_token_loss_func if get_model_config(model).calculate_per_token_loss else loss_func


def forward_backward(fb: Any, modules: list[Any], data: list[dict[str, torch.Tensor]], *, seq: int,
                     micro_batch: int, forward_only: bool = False) -> Any:
    """Run a forward_backward_func (megatron-core's or megatron-zb's) with :func:`forward_step`
    over ``data`` (one micro batch each); every chunk of ``modules`` draws the same micro batches
    in order. Returns what ``fb`` returns (the losses on the last stage)."""
    iters = [iter(data) for _ in modules]
    return fb(forward_step_func=forward_step, data_iterator=iters if len(iters) > 1 else iters[0],
              model=modules, num_microbatches=len(data), seq_length=seq, micro_batch_size=micro_batch,
              forward_only=forward_only)


def measured_forward_backward(fb: Any, modules: list[Any], data: list[dict[str, torch.Tensor]], *, seq: int,
                              micro_batch: int, measure: Any, forward_only: bool = False) -> Any:
    """:func:`forward_backward` through megatron-zb's ``fb.run``, measuring what ``measure`` asks
    (:class:`~megatron_zb.runtime.measure.Measure`); returns the call's
    :class:`~megatron_zb.runtime.measure.Measured`."""
    iters = [iter(data) for _ in modules]
    return fb.run(measure, forward_step_func=forward_step, data_iterator=iters if len(iters) > 1 else iters[0],
                  model=modules, num_microbatches=len(data), seq_length=seq, micro_batch_size=micro_batch,
                  forward_only=forward_only)


def full_tensor(t: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
    """Gather a tensor-parallel shard back to the full tensor (a copy at TP=1), on CPU."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return t.detach().cpu().clone()
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.detach().contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=param.partition_dim).cpu()


def placement_for(schedule: "str | Schedule | None", pp: int, num_chunks: int = 2) -> list[int]:
    """``stage_to_rank`` of the schedule's placement (megatron-core's own 1F1B: plain)."""
    from ..schedules.ir import Placement, Schedule
    from ..schedules.registry import get_spec

    if isinstance(schedule, Schedule):
        return list(schedule.stage_to_rank)
    kind = Placement.PLAIN if schedule is None else get_spec(schedule).placement
    return kind.stage_to_rank(pp, num_chunks)


def build_chunks(cfg: TinyGPT, stage_to_rank: list[int]) -> list[Any]:
    """This rank's GPT chunks of ``cfg`` (no dropout) for a placement, on the test device;
    parallel state must be initialised."""
    import importlib

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from ..model import build_gpt_chunks, cpu_gpt_config, pipeline_split
    from .distributed import device_from_env

    config = cpu_gpt_config(num_layers=cfg.num_layers, hidden_size=cfg.hidden, num_attention_heads=cfg.heads,
                            hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=cfg.tp,
                            pipeline_model_parallel_size=cfg.pp, sequence_parallel=cfg.sequence_parallel,
                            gradient_accumulation_fusion=cfg.gradient_accumulation_fusion, **cfg.config_options)
    layers = (pipeline_split(num_layers=cfg.num_layers, stage_to_rank=stage_to_rank, **cfg.split)
              if cfg.split else None)
    if cfg.layer_spec is not None:
        if cfg.spec_options or cfg.moe_pattern:
            raise ValueError("TinyGPT: give layer_spec or spec_options / moe_pattern, not both")
        module, _, function = cfg.layer_spec.partition(":")
        spec = getattr(importlib.import_module(module), function)()
    elif cfg.moe_pattern:
        from ..training.moe_setup import moe_layer_spec
        from ..training.run_config import MoEConfig

        if len(cfg.moe_pattern) != cfg.num_layers or not config.num_moe_experts:
            raise ValueError(f"TinyGPT: moe_pattern needs one entry per layer ({cfg.num_layers}) and "
                             "config_options' num_moe_experts")
        spec = moe_layer_spec(MoEConfig(num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
                                        moe_layer_pattern=tuple(cfg.moe_pattern)),
                              local_spec_kwargs=cfg.spec_options)
    else:
        spec = get_gpt_layer_local_spec(**cfg.spec_options)
    if cfg.spec_options.get("multi_latent_attention"):
        from ..model.mla import mla_local_spec

        spec = mla_local_spec(spec)
    if cfg.delay_wgrad:
        from ..runtime.te_route import enable_delayed_wgrad

        enable_delayed_wgrad(config)
    chunks = build_gpt_chunks(config=config, vocab_size=cfg.vocab, max_sequence_length=cfg.seq,
                              stage_to_rank=stage_to_rank, seed=cfg.seed, layers_per_stage=layers,
                              layer_spec=spec, **cfg.model_options)
    device = device_from_env()
    if device.type != "cpu":
        for c in chunks:
            c.module.to(device)
    return chunks


def build(cfg: TinyGPT, schedule: str | None) -> tuple[list[Any], list[Any]]:
    """Initialise parallel state and build this rank's chunks; return (chunks, modules to run)."""
    from ..runtime.wgrad_kernels import install_megatron_fallback
    from .distributed import init_parallel_state

    if cfg.gradient_accumulation_fusion:
        install_megatron_fallback()
    init_parallel_state(tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp, seed=cfg.seed)
    chunks = build_chunks(cfg, placement_for(schedule, cfg.pp))
    modules = [c.module for c in chunks]
    if cfg.ddp or cfg.gradient_accumulation_fusion:  # the product's wiring, megatron-core DDP's defaults
        from ..training.run_config import ParallelConfig, PrecisionConfig
        from ..training.wiring import wrap_chunks
        from .distributed import device_from_env

        modules = wrap_chunks(modules, first_last=[(c.plan.pre_process, c.plan.post_process) for c in chunks],
                              parallel=ParallelConfig(), precision=PrecisionConfig(), device=device_from_env())
    return chunks, modules


def run_step(cfg: TinyGPT, *, schedule: "str | Schedule | None", forward_only: bool = False,
             track_memory: bool = False, optimizer_step: bool = False, **options: Any) -> dict[str, Any]:
    """One forward/backward on this rank (see the module docstring).

    ``optimizer_step`` also runs megatron-core's Adam (``get_megatron_optimizer``, clipping on)
    and returns the updated parameters; ``options`` go to megatron-zb's forward_backward_func.
    Also returns ``w_deferred`` (store entries run by W's) and :func:`te_queues`'s counts.
    """
    from ..model import named_global_parameters
    from ..runtime import Measure, get_forward_backward_func

    chunks, modules = build(cfg, schedule)
    data = cfg.microbatches()
    peak_bytes = None
    if schedule is None:
        from megatron.core.pipeline_parallel import get_forward_backward_func as megatron_func
        fb = megatron_func()   # megatron-zb's under patch_megatron: its store then counts the W's run
        store = getattr(fb, "store", None)
        before = 0 if store is None else store.executed
        losses = forward_backward(fb, modules, data, seq=cfg.seq, micro_batch=cfg.micro_batch, forward_only=forward_only)
    else:
        fb = get_forward_backward_func(schedule, **{**cfg.schedule_options, **options})
        store, before = fb.store, fb.store.executed
        measured = measured_forward_backward(fb, modules, data, seq=cfg.seq, micro_batch=cfg.micro_batch,
                                             measure=Measure(track_memory=track_memory), forward_only=forward_only)
        losses, peak_bytes = measured.data, measured.peak_bytes
    grads: dict[str, torch.Tensor] = {}
    if not forward_only:
        use_main = cfg.ddp or cfg.gradient_accumulation_fusion
        for c in chunks:
            for n, p in named_global_parameters(c):
                g = p.main_grad if use_main else p.grad
                grads[n] = full_tensor(g, p)
    w_deferred = 0 if store is None else store.executed - before
    out = {"losses": [d["lm loss"].cpu() for d in losses], "grads": grads, "w_deferred": w_deferred,
           "peak_bytes": peak_bytes, "params": {}, **te_queues(modules)}
    if optimizer_step:  # the product's optimizer wiring: megatron-core's Adam, lr 0.01, clipping at 1.0
        from ..training.run_config import OptimConfig, ParallelConfig, PrecisionConfig
        from ..training.wiring import megatron_optimizer

        opt = megatron_optimizer(OptimConfig(lr=0.01), precision=PrecisionConfig(), parallel=ParallelConfig(),
                                 modules=modules)
        opt.step()
        out["params"] = {n: full_tensor(p, p) for c in chunks for n, p in named_global_parameters(c)}
    return out


def te_moe_grouped_gemm_layer_spec() -> Any:
    """megatron-core's Transformer Engine layer spec with MoE experts in TE's ``GroupedLinear``
    (4 experts, ``moe_grouped_gemm``): the ``layer_spec`` of the real-TE MoE test (GPU only)."""
    from ..runtime.te_route import te_layer_spec

    return te_layer_spec(num_experts=4, moe_grouped_gemm=True)


def te_queues(modules: list[Any]) -> dict[str, int]:
    """The Transformer Engine modules with delayed weight gradients in ``modules`` (real TE or the
    CPU test double alike) and the entries still queued in them: ``te_delayed_modules``,
    ``te_queued_left`` (0 after a complete step: every queued W ran)."""
    from ..megatron_compat.te import te_queued_wgrad
    from ..runtime.te_route import chunk_te_modules

    delayed = [te.module for mod in modules for te in chunk_te_modules(mod).delayed]
    return {"te_delayed_modules": len(delayed), "te_queued_left": sum(te_queued_wgrad(m) for m in delayed)}


def run_step_with_env(cfg: TinyGPT, *, env: dict[str, str | None], **kwargs: Any) -> dict[str, Any]:
    """:func:`run_step` with environment variables set (``None`` removes one) in this rank."""
    import os

    import megatron.core

    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    out = run_step(cfg, **kwargs)
    out["megatron_core_file"] = megatron.core.__file__
    return out

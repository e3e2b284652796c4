"""The model of a run: this rank's GPT chunks for the schedule's placement, wrapped as Megatron wraps them."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from megatron.core.transformer import TransformerConfig

from megatron_zb.model import GPTChunk
from megatron_zb.training.distributed import DistributedContext
from megatron_zb.training.logging_utils import print_rank_0
from megatron_zb.training.moe_setup import moe_config, moe_layer_spec

__all__ = ["ModelBundle", "build_model", "gpt_config", "gpt_layer_spec", "gpt_model_kwargs"]


@dataclass(frozen=True)
class ModelBundle:
    """This rank's model.

    Attributes:
        chunks: the unwrapped chunks in stage order (:class:`~megatron_zb.model.GPTChunk`: the
            stage's :class:`~megatron_zb.model.ChunkPlan` and its ``GPTModel``); checkpoints are
            built from these.
        modules: the same chunks wrapped (``Float16Module`` for fp16/bf16, then megatron-core
            ``DistributedDataParallel``): the ``model`` list given to ``forward_backward_func``.
        stage_to_rank: pipeline rank of every stage, the placement the chunks were built for.
    """

    chunks: list[GPTChunk]
    modules: list[Any]
    stage_to_rank: list[int]

    @property
    def gpt_models(self) -> list[Any]:
        """The unwrapped ``GPTModel`` of every chunk, stage order."""
        return [c.module for c in self.chunks]

    @property
    def reads_data(self) -> list[bool]:
        """Per chunk: whether it holds the first or the last stage (and so reads micro batches)."""
        return [c.plan.pre_process or c.plan.post_process for c in self.chunks]


def gpt_config(args: argparse.Namespace) -> TransformerConfig:
    """megatron-core's ``TransformerConfig`` for validated ``args`` (CPU initialisation).

    Maps Megatron-LM's flags as its ``core_transformer_config_from_args`` does: ``--swiglu`` is a
    gated linear unit with SiLU, ``--num-query-groups`` counts only with ``--group-query-attention``,
    ``--norm-epsilon`` is ``layernorm_epsilon``, ``--disable-bias-linear`` clears ``add_bias_linear``.
    """
    import torch.nn.functional as F

    from megatron_zb.model import cpu_gpt_config

    return cpu_gpt_config(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size, kv_channels=args.kv_channels,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel, params_dtype=args.params_dtype,
        pipeline_dtype=args.params_dtype, fp16=args.fp16, bf16=args.bf16, init_method_std=args.init_method_std,
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu, activation_func=F.silu if args.swiglu else F.gelu,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        add_bias_linear=args.add_bias_linear, qk_layernorm=args.qk_layernorm,
        attention_softmax_in_fp32=args.attention_softmax_in_fp32,
        recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        recompute_modules=list(args.recompute_modules) if args.recompute_modules is not None else None,
        calculate_per_token_loss=args.calculate_per_token_loss,
        gradient_accumulation_fusion=args.gradient_accumulation_fusion, **moe_config(args))


def gpt_layer_spec(args: argparse.Namespace) -> Any:
    """The transformer layer spec: with ``--transformer-impl transformer_engine`` megatron-core's
    Transformer Engine spec, else its local spec for ``--qk-layernorm`` / ``--normalization``, with
    MoE MLPs on the layers ``--moe-layer-freq`` selects when ``--num-experts`` is set."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if args.transformer_impl == "transformer_engine":
        from megatron_zb.runtime.te_route import te_layer_spec

        return te_layer_spec(qk_layernorm=args.qk_layernorm)

    kwargs = dict(qk_layernorm=args.qk_layernorm, normalization=args.normalization)
    return moe_layer_spec(args, local_spec_kwargs=kwargs) or get_gpt_layer_local_spec(**kwargs)


def gpt_model_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``GPTModel`` arguments beyond the config: position embeddings and embedding tying."""
    return dict(position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                rotary_base=args.rotary_base,
                share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)


def build_model(args: argparse.Namespace, *, stage_to_rank: Sequence[int], dist: DistributedContext) -> ModelBundle:
    """Build, wrap and hook up this rank's chunks of the placement ``stage_to_rank``. Collective (barrier).

    Sets the config hooks as Megatron does: ``no_sync_func`` (one per chunk) and
    ``finalize_model_grads_func``; ``grad_scale_func`` is the optimizer's
    (:func:`~megatron_zb.training.optimizer_setup.build_optimizer`).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from megatron_zb.megatron_compat import chunk_float16_module
    from megatron_zb.model import build_gpt_chunks

    t0 = time.perf_counter()
    print_rank_0(f"> building model: GPT, {args.num_layers} layers, hidden {args.hidden_size}, "
                 f"{args.num_attention_heads} heads, sequence {args.seq_length}, vocabulary "
                 f"{args.padded_vocab_size} (padded); schedule {args.schedule} "
                 f"({args.schedule_placement} placement, {args.num_pipeline_stages} stages, layers per "
                 f"stage {args.num_layers_per_stage}) ...")
    print_rank_0(f"> transformer implementation: {args.transformer_impl} ({args.transformer_impl_reason})")
    print_rank_0(f"> gradient accumulation fusion: {args.wgrad_kernel}")
    config = gpt_config(args)
    if args.transformer_impl == "transformer_engine" and args.split_backward:  # TE queues weight gradients for W
        from megatron_zb.runtime.te_route import enable_delayed_wgrad

        enable_delayed_wgrad(config)
    if args.gradient_accumulation_fusion:  # apex's kernels, or megatron-zb's matmul ones where apex is absent
        from megatron_zb.runtime.wgrad_kernels import install_megatron_fallback

        install_megatron_fallback()
    chunks = build_gpt_chunks(config=config, vocab_size=args.padded_vocab_size,
                              max_sequence_length=args.max_position_embeddings, stage_to_rank=list(stage_to_rank),
                              seed=args.seed, layers_per_stage=args.num_layers_per_stage,
                              layer_spec=gpt_layer_spec(args), **gpt_model_kwargs(args))
    from megatron_zb.training.arguments.parallel import data_parallel_summary

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.bf16, overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather, use_distributed_optimizer=args.use_distributed_optimizer,
        bucket_size=args.ddp_bucket_size, average_in_collective=args.ddp_average_in_collective)
    print_rank_0(data_parallel_summary(args))
    modules = []
    for i, chunk in enumerate(chunks):
        module: Any = chunk.module
        if dist.device.type == "cuda":
            module.cuda(dist.device)
        if args.fp16 or args.bf16:
            module = chunk_float16_module(module.config, module, first=chunk.plan.pre_process,
                                          last=chunk.plan.post_process)
        modules.append(DistributedDataParallel(config=chunk.module.config, ddp_config=ddp_config, module=module,
                                               disable_bucketing=i > 0))
    no_sync = [m.no_sync for m in modules] if len(modules) > 1 else modules[0].no_sync
    grad_sync = [m.start_grad_sync for m in modules] if len(modules) > 1 else modules[0].start_grad_sync
    for chunk in chunks:
        chunk.module.config.no_sync_func = no_sync
        chunk.module.config.finalize_model_grads_func = finalize_model_grads
        if args.overlap_grad_reduce:  # Megatron's --align-grad-reduce (its default) for its own schedules
            chunk.module.config.grad_sync_func = grad_sync
    n = sum(p.numel() for c in chunks for p in c.module.parameters())
    if dist.dp_rank == 0:
        print(f" > model built: {n} parameters on this rank (tensor rank {dist.tp_rank}, pipeline rank "
              f"{dist.pp_rank}, stages {[c.plan.stage for c in chunks]}) in {time.perf_counter() - t0:.1f} s",
              flush=True)
    torch.distributed.barrier()
    return ModelBundle(chunks=list(chunks), modules=modules, stage_to_rank=list(stage_to_rank))

"""The model of a run: this rank's GPT chunks for the schedule's placement, wrapped as Megatron wraps them."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from megatron_zb.model import GPTChunk
from megatron_zb.training.distributed import DistributedContext
from megatron_zb.training.logging_utils import print_rank_0
from megatron_zb.training.run_config import RunConfig
from megatron_zb.training.wiring import gpt_config, gpt_layer_spec, wrap_chunks

__all__ = ["ModelBundle", "build_model"]


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
        vocab_slices: with ``--enable-vocab-parallel``, this rank's
            :class:`~megatron_zb.model.vocab_parallel.VocabParallelSlices` (the chunks then hold no word
            embedding and no output layer); ``None`` otherwise.
        vocab_module: ``vocab_slices`` wrapped in megatron-core DDP (in the optimizer, not in ``modules``).
    """

    chunks: list[GPTChunk]
    modules: list[Any]
    stage_to_rank: list[int]
    vocab_slices: Any = None
    vocab_module: Any = None

    @property
    def vocab_parallel(self) -> Any:
        """What the runtime takes (:class:`~megatron_zb.runtime.vocab_runtime.VocabParallelModel`: the slices
        and their DDP), or ``None`` without ``--enable-vocab-parallel``."""
        if self.vocab_slices is None:
            return None
        from megatron_zb.runtime.vocab_runtime import VocabParallelModel

        return VocabParallelModel(self.vocab_slices, ddp=self.vocab_module)

    @property
    def all_modules(self) -> list[Any]:
        """``modules`` and the vocabulary slices' module: what the optimizer steps and the loop zeroes."""
        return self.modules + ([self.vocab_module] if self.vocab_module is not None else [])

    @property
    def gpt_models(self) -> list[Any]:
        """The unwrapped ``GPTModel`` of every chunk, stage order."""
        return [c.module for c in self.chunks]

    @property
    def reads_data(self) -> list[bool]:
        """Per chunk: whether it holds the first or the last stage (and so reads micro batches)."""
        return [c.plan.pre_process or c.plan.post_process for c in self.chunks]


def build_model(config: RunConfig, *, stage_to_rank: Sequence[int], dist: DistributedContext) -> ModelBundle:
    """Build, wrap and hook up this rank's chunks of the placement ``stage_to_rank``. Collective (barrier).

    Sets the config hooks as Megatron does (:func:`~megatron_zb.training.wiring.wrap_chunks`):
    ``no_sync_func`` (one per chunk) and ``finalize_model_grads_func``; ``grad_scale_func`` is the
    optimizer's (:func:`~megatron_zb.training.optimizer_setup.build_optimizer`).
    """
    from megatron_zb.model import build_gpt_chunks
    from megatron_zb.training.arguments.parallel import data_parallel_summary

    model, parallel, schedule = config.model, config.parallel, config.schedule
    t0 = time.perf_counter()
    print_rank_0(f"> building model: GPT, {model.num_layers} layers, hidden {model.hidden_size}, "
                 f"{model.num_attention_heads} heads, sequence {model.seq_length}, vocabulary "
                 f"{model.padded_vocab_size} (padded); schedule {schedule.name} "
                 f"({schedule.placement} placement, {schedule.num_pipeline_stages} stages, layers per "
                 f"stage {list(schedule.layers_per_stage)}) ...")
    print_rank_0(f"> transformer implementation: {model.transformer_impl} ({model.transformer_impl_reason})")
    print_rank_0(f"> gradient accumulation fusion: {model.wgrad_kernel}")
    tc = gpt_config(model, parallel=parallel, precision=config.precision)
    if model.transformer_impl == "transformer_engine" and schedule.split_backward:  # TE queues wgrads for W
        from megatron_zb.runtime.te_route import enable_delayed_wgrad

        enable_delayed_wgrad(tc)
    if model.gradient_accumulation_fusion:  # apex's kernels, or megatron-zb's matmul ones where apex is absent
        from megatron_zb.runtime.wgrad_kernels import install_megatron_fallback

        install_megatron_fallback()
    gpt_kwargs = model.gpt_model_kwargs()
    if schedule.enable_vocab_parallel:  # the slices tie (or not); the chunks' vocabulary layers are dropped
        gpt_kwargs["share_embeddings_and_output_weights"] = False
    chunks = build_gpt_chunks(config=tc, vocab_size=model.padded_vocab_size,
                              max_sequence_length=model.max_position_embeddings, stage_to_rank=list(stage_to_rank),
                              seed=config.seed, layers_per_stage=list(schedule.layers_per_stage),
                              layer_spec=gpt_layer_spec(model), **gpt_kwargs)
    print_rank_0(data_parallel_summary(parallel))
    slices = _strip_vocab_layers(config, chunks, tc) if schedule.enable_vocab_parallel else None
    modules = wrap_chunks([c.module for c in chunks],
                          first_last=[(c.plan.pre_process, c.plan.post_process) for c in chunks],
                          parallel=parallel, precision=config.precision, device=dist.device)
    vocab_module = None
    if slices is not None:
        from megatron.core.distributed import DistributedDataParallel

        from megatron_zb.training.wiring import ddp_config

        # no autograd hook reports the slices' gradients (the passes add them to main_grad): reduced after
        # the schedule by the runtime (VocabParallelModel.ddp), not overlapped; with the distributed optimizer,
        # reduce-scattered there and all-gathered by the optimizer's step (--overlap-param-gather refused)
        cfg = dataclasses.replace(ddp_config(parallel, config.precision), overlap_grad_reduce=False,
                                  overlap_param_gather=False)
        vocab_module = DistributedDataParallel(config=tc, ddp_config=cfg, module=slices.to(dist.device),
                                               disable_bucketing=True)
    n = sum(p.numel() for c in chunks for p in c.module.parameters())
    n += sum(p.numel() for p in slices.parameters()) if slices is not None else 0
    if dist.dp_rank == 0:
        print(f" > model built: {n} parameters on this rank (tensor rank {dist.tp_rank}, pipeline rank "
              f"{dist.pp_rank}, stages {[c.plan.stage for c in chunks]}) in {time.perf_counter() - t0:.1f} s",
              flush=True)
    torch.distributed.barrier()
    return ModelBundle(chunks=list(chunks), modules=modules, stage_to_rank=list(stage_to_rank), vocab_slices=slices,
                       vocab_module=vocab_module)


def _strip_vocab_layers(config: RunConfig, chunks: Sequence[GPTChunk], tc: Any) -> Any:
    """``--enable-vocab-parallel``: drop the first and last chunk's vocabulary layers (built untied:
    :func:`~megatron_zb.model.vocab_chunks.strip_vocab_layers`); return this rank's slices of them over
    the model-parallel group (tensor x pipeline ranks, slice ``pp_rank x TP + tp_rank``), drawn from the same seeds as the chunks' would be (one slice serving both
    unless ``--untie-embeddings-and-output-weights``)."""
    from megatron.core import parallel_state

    from megatron_zb.model.vocab_chunks import strip_vocab_layers
    from megatron_zb.model.vocab_parallel import VocabParallelSlices

    for c in chunks:
        strip_vocab_layers(c.module)
    slices = VocabParallelSlices(padded_size=config.model.padded_vocab_size, hidden_size=tc.hidden_size,
                                 group=parallel_state.get_model_parallel_group(),
                                 tied=not config.model.untie_embeddings_and_output_weights,
                                 seed=config.seed, init_method=tc.embedding_init_method,
                                 output_init_method=tc.init_method, params_dtype=tc.params_dtype)
    print_rank_0(f"> vocabulary parallelism: {slices.vocab.describe()} "
                 f"(padded vocabulary {slices.vocab.padded_size}){', tied' if slices.tied else ''}")
    return slices

"""The tiny GPT of :mod:`~megatron_zb.testing.tiny_gpt` with vocabulary parallelism: one training step on
this rank under a vocabulary-parallel schedule, with results keyed as :func:`~megatron_zb.testing.tiny_gpt.run_step`
keys megatron-core's, so the two compare directly (tests/runtime/test_vocab_runtime.py).

The chunks are built as for megatron-core (same seeds, same weights) for the schedule's placement
(plain, V or interleaved with 2 chunks per rank: :func:`~megatron_zb.testing.tiny_gpt.placement_for`), then
:func:`~megatron_zb.model.vocab_chunks.strip_vocab_layers` hands the word embedding and the output
layer to :class:`~megatron_zb.model.vocab_parallel.VocabParallelSlices` over the model-parallel group
(tensor x pipeline ranks; the pipeline group's ranks at TP = 1), drawn from the same seeds (the slices of
the same matrices). The slices' gradients are gathered over that group, the chunks' over the tensor
group (as ``run_step``), and returned under megatron-core's names (``embedding.word_embeddings.weight``,
``output_layer.weight``).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from megatron_zb.testing.tiny_gpt import TinyGPT, build, forward_step, full_tensor

__all__ = ["run_in_turn", "run_vocab_step", "run_vocab_steps"]


def run_vocab_step(cfg: TinyGPT, *, schedule: str, forward_only: bool = False, tied: bool = False,
                   iterations: int = 1, defer_t_weight: bool = False, **options: Any) -> dict[str, Any]:
    """One forward/backward of ``cfg`` under the vocabulary-parallel ``schedule`` on this rank: the
    losses (last rank), every parameter's gradient by global name, and how many W entries ran.
    ``tied``: one slice for the embedding and the output layer (the chunks are built untied: their
    vocabulary layers are dropped anyway); compare with ``cfg``'s ``share_embeddings_and_output_weights=True``
    reference, whose two copies' gradients megatron-core sums (``ddp=True``: ``finalize_model_grads``).
    ``iterations``: calls of the same ``forward_backward_func`` on the same data, the gradients zeroed
    before each (results of the last). ``defer_t_weight``: ``VocabParallelModel.defer_t_weight``."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_zb.model import named_global_parameters
    from megatron_zb.model.vocab_chunks import strip_vocab_layers
    from megatron_zb.model.vocab_parallel import VocabParallelSlices
    from megatron_zb.runtime import get_forward_backward_func
    from megatron_zb.runtime.vocab_runtime import VocabParallelModel

    import dataclasses

    untied = {k: v for k, v in cfg.model_options.items() if k != "share_embeddings_and_output_weights"}
    chunks, modules = build(dataclasses.replace(cfg, model_options=untied), schedule)
    for c in chunks:
        strip_vocab_layers(c.module)
    config = chunks[0].module.config
    group = parallel_state.get_model_parallel_group()
    slices = VocabParallelSlices(padded_size=cfg.vocab, hidden_size=cfg.hidden, group=group, tied=tied,
                                 seed=cfg.seed, init_method=config.embedding_init_method,
                                 output_init_method=config.init_method)
    vocab = VocabParallelModel(slices, ddp=_slices_ddp(slices, config) if cfg.ddp else None,
                               defer_t_weight=defer_t_weight)
    fb = get_forward_backward_func(schedule, vocab_parallel=vocab, **options)
    data = cfg.microbatches()
    for _ in range(iterations):
        for m in modules:
            if hasattr(m, "zero_grad_buffer"):
                m.zero_grad_buffer()
            m.zero_grad()
        slices.zero_grad()
        if vocab.ddp is not None:
            vocab.ddp.zero_grad_buffer()
        iters = [iter(data) for _ in modules]
        vocab.data_iterator = iter(data)  # every rank: the same micro batches
        losses = fb(forward_step_func=forward_step, data_iterator=iters if len(iters) > 1 else iters[0],
                    model=modules, num_microbatches=len(data), seq_length=cfg.seq, micro_batch_size=cfg.micro_batch,
                    forward_only=forward_only)
    if forward_only:
        params = [p for c in chunks for p in c.module.parameters()] + list(slices.parameters())
        return {"losses": [d["lm loss"].cpu() for d in losses], "with_grad": sum(p.grad is not None for p in params),
                "w_deferred": fb.store.executed}
    use_main = cfg.ddp or cfg.gradient_accumulation_fusion  # megatron-core DDP: gradients in main_grad
    grads = {n: full_tensor(p.main_grad if use_main else p.grad, p)
             for c in chunks for n, p in named_global_parameters(c)}
    slices_main = vocab.ddp is not None
    for name, weight in (("embedding.word_embeddings.weight", slices.word_embeddings),
                         ("output_layer.weight", slices.output_layer_weight)):
        parts = [torch.empty_like(weight) for _ in range(group.size())]
        grad = weight.main_grad if slices_main else weight.grad
        dist.all_gather(parts, grad.detach().contiguous(), group=group)
        grads[name] = torch.cat(parts)
    return {"losses": [d["lm loss"].cpu() for d in losses], "grads": grads, "w_deferred": fb.store.executed // iterations,
            "peak_bytes": None, "params": {}}


def run_vocab_steps(cfg: TinyGPT, *, schedules: Sequence[str], **options: Any) -> dict[str, dict[str, Any]]:
    """:func:`run_vocab_step` for each of ``schedules`` in turn in the same processes (megatron-core's
    parallel state torn down after each: the next one builds the same weights again), to start the
    processes once for several schedules; results by schedule name."""
    from megatron.core import parallel_state

    out = {}
    for name in schedules:
        out[name] = run_vocab_step(cfg, schedule=name, **options)
        parallel_state.destroy_model_parallel()
    return out


def run_in_turn(calls: Sequence[Callable[[], Any]]) -> list[Any]:
    """Each of ``calls`` (e.g. ``partial(run_step, cfg, schedule=None)``, ``partial(run_vocab_step, ...)``) in
    turn in the same processes, megatron-core's parallel state torn down after each (each call builds its
    own), to start the processes once for several runs, references included; their results in order."""
    from megatron.core import parallel_state

    out = []
    for call in calls:
        out.append(call())
        parallel_state.destroy_model_parallel()
    return out


def _slices_ddp(slices: Any, config: Any) -> Any:
    """The slices in megatron-core DDP (the product's defaults, ``overlap_grad_reduce`` off: the runtime
    reduces them after the schedule)."""
    import dataclasses

    from megatron.core.distributed import DistributedDataParallel

    from megatron_zb.training.run_config import ParallelConfig, PrecisionConfig
    from megatron_zb.training.wiring import ddp_config

    cfg = dataclasses.replace(ddp_config(ParallelConfig(), PrecisionConfig()), overlap_grad_reduce=False)
    return DistributedDataParallel(config=config, ddp_config=cfg, module=slices, disable_bucketing=True)

"""V schedules (``zbv``, ``v-half``, ``v-min``) inside NVIDIA Megatron-LM's own training loop.

A V schedule places ``2p`` pipeline stages on ``p`` ranks as a V: rank ``r`` holds stage ``r``
(model chunk 0) and stage ``2p - 1 - r`` (chunk 1), so rank 0 holds both the embedding (stage 0)
and the loss (stage ``2p - 1``). Megatron-LM builds two chunks per rank when its virtual pipeline
size is 2, but for its interleaved placement. Where it builds them is per release
(``megatron_compat.MEGATRON_LM_LOOP``): core_v0.16.1's ``get_model`` calls the script's model
provider, so the user's ``pretrain_gpt.py`` passes it through :func:`v_model_provider`
(docs/megatron_lm.md)::

    pretrain(train_valid_test_datasets_provider,
             megatron_zb.megatron_lm.v_model_provider(partial(model_provider, gpt_builder)), ...)

core_v0.19.0's ``setup_model_and_optimizer`` builds them from the script's config with
``GPTModelBuilder``, whose ``build_model`` and ``build_distributed_models`` :func:`activate` wraps
(:func:`_wrap_builder`): no change of the script beyond ``install()``. Both routes build a chunk
by one rule, :func:`_build_v_chunk`.

With a V schedule chosen (``--zero-bubble-v-schedule [--zero-bubble-v-schedule-mem-setup
half|min]`` or ``--schedule zbv|v-half|v-min``):

* :func:`refused_with_a_v` and :func:`check_v` (called by :func:`megatron_zb.megatron_lm.configure`,
  before Megatron-LM validates its arguments) refuse what this route cannot build (one line each,
  reported with the route's other refusals, exit 2; multi-token prediction among them) and :func:`check_v` sets
  Megatron-LM's ``--num-virtual-stages-per-pipeline-rank 2``, printed once on rank 0 as
  Megatron-LM prints its own adjustments;
* :func:`activate` (same point) answers Megatron-LM's ``is_first_or_last_pipeline_stage(vp_stage)``
  -- the question by which ``pretrain_gpt.py``'s ``get_batch`` and dataset builder decide whether
  a chunk reads micro batches -- by the V: on rank 0 both chunks read (tokens for stage 0, labels
  for the loss stage), on the other ranks none; and makes the ``Float16Module`` that ``get_model``
  wraps each chunk in with ``--bf16`` / ``--fp16`` cast by the V stage;
* :func:`check_provider` refuses, when Megatron-LM validates its arguments inside ``pretrain()``
  (before any process group), a script that created no :func:`v_model_provider` (core_v0.16.1);
* the wrapped provider (or builder) builds each chunk for its V stage through the user's own
  provider (Megatron-LM's builder): the config a copy with a :class:`~megatron_zb.model.ChunkPlan`
  as its layout (global layer offsets), ``pre_process`` / ``post_process`` by stage, tied
  embeddings as ``pretrain_gpt_zb.py`` ties them in a V (both ends built untied, then the loss
  chunk's output layer uses chunk 0's embedding parameter, on the same rank:
  :func:`~megatron_zb.model.tie_output_layer`); where Megatron-LM's ``get_batch_on_this_tp_rank``
  keeps only the fields of the rank's pipeline end (core_v0.19.0), the V's rank 0 keeps them all;
* :class:`VForwardBackward` hands the loss stage's per-micro-batch losses from rank 0 to the last
  pipeline rank, where Megatron-LM's ``train_step`` and ``evaluate`` read them.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from ..schedules.ir import V_CHUNKS_PER_RANK, v_stages
from ..training.arguments.common import ArgumentError
from .rebind import Rebinds

__all__ = ["V_CHUNKS", "VForwardBackward", "VModelProvider", "activate", "as_megatron_layout", "check_provider",
           "check_v", "deactivate", "refused_with_a_v", "v_model_provider"]

V_CHUNKS = V_CHUNKS_PER_RANK
"""Model chunks per pipeline rank in a V (:data:`~megatron_zb.schedules.ir.V_CHUNKS_PER_RANK`)."""

@dataclass
class VRoute:
    """The V route's state in this process (one instance, :data:`_ROUTE`).

    Attributes:
        schedule: the V schedule while the route is active (:func:`activate`), else ``None``.
        flag: the flag that chose it (``--schedule`` or ``--zero-bubble-v-schedule``).
        providers: every :class:`VModelProvider` made so far (the provider route).
        built: this rank's chunks built for the V by the builder route, by ``vp_stage``.
        rebinds: what :func:`activate` replaced in Megatron-LM (:func:`deactivate` restores it).
    """

    schedule: str | None = None
    flag: str | None = None
    providers: list["VModelProvider"] = field(default_factory=list)
    built: dict[int, Any] = field(default_factory=dict)
    rebinds: Rebinds = field(default_factory=Rebinds)

    @property
    def active(self) -> bool:
        """Whether a V schedule is installed."""
        return self.schedule is not None


_ROUTE = VRoute()


def v_model_provider(model_provider: Callable[..., Any]) -> "VModelProvider":
    """Wrap a Megatron-LM model provider (``partial(model_provider, gpt_builder)``) so that, with a V
    schedule chosen, Megatron-LM's ``get_model`` builds the V; without one it calls ``model_provider``
    unchanged (the wrapper may stay in the script)."""
    return VModelProvider(model_provider)


def _how_to_wrap(flag: str, schedule: str) -> ArgumentError:
    return ArgumentError(flag, f"{schedule!r} is a V schedule: its two model chunks per rank must be built for the "
                               f"V, so in pretrain_gpt.py pass megatron_zb.megatron_lm.v_model_provider(partial("
                               f"model_provider, gpt_builder)) to pretrain() in place of partial(model_provider, "
                               f"gpt_builder) (docs/megatron_lm.md)")


_REFUSED_WITH_A_V: tuple[tuple[str, str, str], ...] = (
    ("pipeline_model_parallel_layout", "--pipeline-model-parallel-layout",
     "the V decides the layer placement; drop it"),
    ("decoder_first_pipeline_num_layers", "--decoder-first-pipeline-num-layers",
     "the V splits the layers evenly; drop it"),
    ("decoder_last_pipeline_num_layers", "--decoder-last-pipeline-num-layers",
     "the V splits the layers evenly; drop it"),
    ("account_for_embedding_in_pipeline_split", "--account-for-embedding-in-pipeline-split",
     "the V splits the layers evenly; drop it"),
    ("account_for_loss_in_pipeline_split", "--account-for-loss-in-pipeline-split",
     "the V splits the layers evenly; drop it"),
    ("mtp_num_layers", "--mtp-num-layers", "the V's loss stage is on pipeline rank 0, where megatron-core's "
                                           "multi-token prediction keeps a word-embedding copy it syncs only over "
                                           "the embedding group of the first and last pipeline ranks; run the V "
                                           "with MTP in pretrain_gpt_zb.py (one shared embedding there), choose a "
                                           "schedule of another placement (e.g. --enable-zero-bubble) or drop it"),
    ("use_legacy_models", "--use-legacy-models", "the V builds megatron-core GPT chunks; drop it"),
    ("yaml_cfg", "--yaml-cfg", "the V chunk configs are made from Megatron-LM's flags; drop it"),
)
"""Megatron-LM flags a V cannot have inside Megatron-LM's loop: (``args`` attribute, flag, why and what
to do)."""


def refused_with_a_v(args: argparse.Namespace, schedule: str) -> list[ArgumentError]:
    """One :class:`ArgumentError` per flag of :data:`_REFUSED_WITH_A_V` that ``args`` sets, for the V
    ``schedule`` (:func:`megatron_zb.megatron_lm.configure` reports them with the route's other refusals)."""
    return [ArgumentError(name, f"not supported with the V schedule {schedule!r} inside Megatron-LM's loop: {why}")
            for dest, name, why in _REFUSED_WITH_A_V if getattr(args, dest, None)]


def check_v(args: argparse.Namespace, schedule: str, flag: str) -> None:
    """Check what else a V needs inside Megatron-LM's loop (:class:`ArgumentError` naming the flag;
    the flags it cannot have at all: :func:`refused_with_a_v`), then set
    ``args.num_virtual_stages_per_pipeline_rank = 2`` (Megatron-LM derives its virtual pipeline size
    from it when it validates ``args``). ``flag`` chose the V ``schedule``."""
    pp, num_layers = args.pipeline_model_parallel_size, args.num_layers
    if args.tensor_model_parallel_size > 1:
        raise ArgumentError("--tensor-model-parallel-size", f"must be 1 with the V schedule {schedule!r} inside "
                                                            f"Megatron-LM's loop: its get_batch_on_this_tp_rank sends "
                                                            f"labels to the other tensor-parallel ranks only on the "
                                                            f"last pipeline rank, and the V's loss stage is on rank 0")
    if not getattr(args, "overlap_p2p_comm", True) and pp <= 2:
        raise ArgumentError("--no-overlap-p2p-communication", "Megatron-LM refuses it at PP <= 2 with two model "
                                                              "chunks per rank (the V has two); drop it")
    if num_layers % (V_CHUNKS * pp):
        raise ArgumentError("--num-layers", f"{num_layers} layers do not split evenly into the V's {V_CHUNKS * pp} "
                                            f"stages (PP={pp}); use a multiple of {V_CHUNKS * pp}")
    per_stage = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    chunks = getattr(args, "num_virtual_stages_per_pipeline_rank", None)
    if per_stage is not None and per_stage != num_layers // (V_CHUNKS * pp):
        raise ArgumentError("--num-layers-per-virtual-pipeline-stage",
                            f"{schedule!r} has {num_layers // (V_CHUNKS * pp)} layers per stage (the V: "
                            f"{V_CHUNKS} chunks per rank), not {per_stage}; drop the flag")
    if chunks is not None and chunks != V_CHUNKS:
        raise ArgumentError("--num-virtual-stages-per-pipeline-rank",
                            f"{schedule!r} places {V_CHUNKS} model chunks per rank (the V), not {chunks}; drop "
                            f"the flag")
    if per_stage is None and chunks is None:
        args.num_virtual_stages_per_pipeline_rank = V_CHUNKS
        if getattr(args, "rank", 0) == 0 and not _ROUTE.active:  # Megatron-LM parses more than once: say it once
            print(f"megatron-zb: setting --num-virtual-stages-per-pipeline-rank {V_CHUNKS}: {flag} {schedule} places "
                  f"{V_CHUNKS} model chunks per pipeline rank (the V), built by megatron_zb.megatron_lm."
                  f"v_model_provider", flush=True)


def activate(schedule: str, flag: str) -> None:
    """Install the V route for ``schedule`` (chosen by ``flag``): answer Megatron-LM's
    ``is_first_or_last_pipeline_stage`` by the V, and give ``get_model`` a V-aware ``Float16Module``
    (module docstring). :func:`deactivate` undoes it."""
    deactivate()
    from megatron.training import utils

    _ROUTE.schedule, _ROUTE.flag = schedule, flag
    original = utils.is_first_or_last_pipeline_stage

    def is_first_or_last_pipeline_stage(vp_stage: int | None) -> bool:
        """Megatron-LM's question, answered by the V: does this chunk hold stage 0 or the loss stage?"""
        if vp_stage is None:
            return original(vp_stage)
        return _v_stage(vp_stage) in (0, V_CHUNKS * _pp()[0] - 1)

    # pretrain_gpt.py imported the name before this runs: rebind it wherever it is held, as patch_megatron does
    _ROUTE.rebinds.everywhere(original, is_first_or_last_pipeline_stage)
    from megatron.training import training

    from ..megatron_compat import megatron_lm_loop

    _ROUTE.rebinds.set(training, "Float16Module", _v_float16_module)  # get_model's one use: Float16Module(config, model_module)
    loop = megatron_lm_loop()
    if loop.v_model_builder is not None:
        _wrap_builder(loop.v_model_builder)
    if loop.tp_batch_by_pipeline_end is not None:
        _keep_whole_batch_on_rank_0(loop.tp_batch_by_pipeline_end)


def _wrap_builder(path: str) -> None:
    """Megatron-LM builds the model from its config with the builder class ``path``
    (``megatron_compat.MEGATRON_LM_LOOP``): its ``build_model`` builds chunk ``vp_stage`` of the V
    (:func:`_build_v_chunk`, the same rule as :class:`VModelProvider`), and its
    ``build_distributed_models`` wraps each chunk with ``--bf16`` / ``--fp16`` in the V-aware
    ``Float16Module`` before megatron-core's DDP, as ``get_model`` does on the provider route."""
    import copy
    import inspect

    from megatron.core.transformer.module import Float16Module

    module_name, name = path.rsplit(".", 1)
    builder = getattr(importlib.import_module(module_name), name)
    build_model, build_distributed_models = builder.build_model, builder.build_distributed_models
    distributed_signature = inspect.signature(build_distributed_models)

    def build_v_model(self: Any, pg_collection: Any, pre_process: bool | None = None,
                      post_process: bool | None = None, vp_stage: int | None = None) -> Any:
        """Megatron-LM's ``build_model``; with a V, chunk ``vp_stage`` of the V (Megatron-LM's
        ``pre_process`` / ``post_process`` are for its interleaved placement and are replaced)."""
        if not _ROUTE.active:
            return build_model(self, pg_collection, pre_process, post_process, vp_stage)
        model_config = self._model_config

        def build(plan: Any, num_ranks: int, untied: bool) -> Any:
            chunk = copy.copy(model_config)  # the builder reads these two; object's setter: no proxying
            object.__setattr__(chunk, "transformer", _v_chunk_config(model_config.transformer, plan, num_ranks))
            if untied:
                object.__setattr__(chunk, "share_embeddings_and_output_weights", False)
            return build_model(type(self)(chunk), pg_collection, plan.pre_process, plan.post_process, None)

        return _build_v_chunk(_ROUTE.built, vp_stage, pg_collection,
                              tied=model_config.share_embeddings_and_output_weights, build=build)

    def build_v_distributed_models(self: Any, *args: Any, **kwargs: Any) -> Any:
        """Megatron-LM's ``build_distributed_models``; with a V, megatron-core's ``Float16Module``
        (the default wrapper) replaced by the V-aware one."""
        if _ROUTE.active:
            bound = distributed_signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            wrapper = bound.arguments["mixed_precision_wrapper"]
            if wrapper is not None and wrapper is not Float16Module:
                raise RuntimeError(f"the V schedule {_ROUTE.schedule!r} casts by V stage with megatron-core's "
                                   f"Float16Module; {path}.build_distributed_models was given {wrapper!r}")
            if wrapper is Float16Module:
                bound.arguments["mixed_precision_wrapper"] = _v_float16_module
            args, kwargs = bound.args[1:], bound.kwargs
        return build_distributed_models(self, *args, **kwargs)

    _ROUTE.rebinds.set(builder, "build_model", build_v_model)
    _ROUTE.rebinds.set(builder, "build_distributed_models", build_v_distributed_models)


def _keep_whole_batch_on_rank_0(path: str) -> None:
    """``path`` (``megatron_compat.MEGATRON_LM_LOOP``) keeps only the fields of the rank's pipeline
    end; on the V's rank 0 (the embedding's and the loss stage's rank) it is called as for one
    pipeline rank, which keeps every field (the V route needs tensor-parallel size 1)."""
    module_name, name = path.rsplit(".", 1)
    original = getattr(importlib.import_module(module_name), name)

    def keep_whole_batch_on_rank_0(*args: Any, **kwargs: Any) -> Any:
        if _pp()[1] == 0:
            kwargs["pipeline_model_parallel_size"] = 1
        return original(*args, **kwargs)

    keep_whole_batch_on_rank_0.__name__ = original.__name__
    _ROUTE.rebinds.everywhere(original, keep_whole_batch_on_rank_0)


def _v_float16_module(config: Any, module: Any) -> Any:
    """megatron-core's ``Float16Module`` for chunk ``module.vp_stage`` of the V (``get_model`` sets
    it before wrapping): half-precision inputs on stage 0, fp32 outputs on the loss stage.
    megatron-core's own decides by pipeline rank and virtual stage, which does not match the V."""
    from ..megatron_compat.training import chunk_float16_module

    stage = _v_stage(module.vp_stage)
    return chunk_float16_module(config, module, first=stage == 0, last=stage == V_CHUNKS * _pp()[0] - 1)


def check_provider() -> None:
    """With a V route active: refuse (:class:`ArgumentError`) a script that created no
    :func:`v_model_provider`. Call it once ``pretrain()``'s arguments exist (Megatron-LM's
    ``inprocess_restart`` parses the flags before them)."""
    if _ROUTE.active and not _ROUTE.providers:
        raise _how_to_wrap(_ROUTE.flag, _ROUTE.schedule)


def deactivate() -> None:
    """Undo :func:`activate` (the providers already created stay)."""
    _ROUTE.rebinds.restore()
    _ROUTE.schedule = _ROUTE.flag = None


def _pp(pg_collection: Any = None) -> tuple[int, int]:
    """(pipeline-parallel size, this rank's pipeline rank)."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_pg_rank, get_pg_size

    if pg_collection is not None and getattr(pg_collection, "pp", None) is not None:
        return get_pg_size(pg_collection.pp), get_pg_rank(pg_collection.pp)
    return parallel_state.get_pipeline_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_rank()


def _v_stage(vp_stage: int, pg_collection: Any = None) -> int:
    """The V stage of this rank's chunk ``vp_stage`` (0: stage ``r``, 1: stage ``2p - 1 - r``)."""
    p, r = _pp(pg_collection)
    if vp_stage not in range(V_CHUNKS):
        raise ValueError(f"a V has {V_CHUNKS} model chunks per rank; Megatron-LM asked for chunk {vp_stage}")
    return v_stages(p, r)[vp_stage]


class VModelProvider:
    """Megatron-LM's model-provider signature around the user's provider (:func:`v_model_provider`).

    Attributes:
        model_provider: the user's provider.
        chunks: this rank's chunks built for the V so far, by ``vp_stage``.
    """

    def __init__(self, model_provider: Callable[..., Any]) -> None:
        self.model_provider = model_provider
        self.chunks: dict[int, Any] = {}
        _ROUTE.providers.append(self)

    def __call__(self, pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None,
                 config: Any = None, pg_collection: Any = None) -> Any:
        """Without a V schedule: the user's provider with Megatron-LM's arguments. With one:
        chunk ``vp_stage`` of the V (Megatron-LM's ``pre_process`` / ``post_process`` are for its
        interleaved placement and are replaced by the V stage's)."""
        if not _ROUTE.active:
            return self.model_provider(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
                                       config=config, pg_collection=pg_collection)
        from megatron.training import get_args
        from megatron.training.arguments import core_transformer_config_from_args

        args = get_args()
        base = config if config is not None else core_transformer_config_from_args(args)

        def build(plan: Any, num_ranks: int, untied: bool) -> Any:
            try:  # the user's provider reads Megatron-LM's argument
                if untied:
                    args.untie_embeddings_and_output_weights = True
                return self.model_provider(pre_process=plan.pre_process, post_process=plan.post_process,
                                           vp_stage=None, config=_v_chunk_config(base, plan, num_ranks),
                                           pg_collection=pg_collection)
            finally:
                if untied:
                    args.untie_embeddings_and_output_weights = False

        return _build_v_chunk(self.chunks, vp_stage, pg_collection, tied=not args.untie_embeddings_and_output_weights,
                              build=build)


def _v_chunk_config(config: Any, plan: Any, num_ranks: int) -> Any:
    """``megatron_zb.model.chunk_config`` (a copy of ``config`` whose layout gives the chunk's global
    layer offset), its layout seen by megatron-core as a ``PipelineParallelLayerLayout``
    (:func:`as_megatron_layout`): Megatron-LM's MoE model (``--num-experts``) is built from
    ``get_gpt_decoder_block_spec``, which takes the chunk's layers from the layout only if it is one."""
    from ..model import chunk_config

    chunk = chunk_config(config, plan, num_ranks)
    if chunk.pipeline_model_parallel_layout is not None:
        chunk.pipeline_model_parallel_layout = as_megatron_layout(chunk.pipeline_model_parallel_layout)
    return chunk


def as_megatron_layout(plan: Any) -> Any:
    """``plan`` (a :class:`~megatron_zb.model.ChunkPlan`) behind megatron-core's
    ``PipelineParallelLayerLayout`` type: every question megatron-core asks a layout (``layout``,
    ``get_layer_offset``, ``get_num_layers_to_build``, ``get_layer_id_list``) is answered by the plan,
    for the chunk whatever rank or virtual stage is named."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    class ChunkLayout(PipelineParallelLayerLayout):
        """One V chunk's layers as a megatron-core layout (no ``__init__``: nothing to parse)."""

        def __init__(self, chunk_plan: Any) -> None:  # noqa: D107 -- the base parses a layout string
            self.plan = chunk_plan
            self.input_data = repr(chunk_plan)
            self.layout = chunk_plan.layout

        def __reduce__(self) -> tuple[Any, tuple[Any]]:  # pickle / deepcopy: rebuilt from the plan
            return as_megatron_layout, (self.plan,)

        def get_layer_offset(self, *args: Any, **kwargs: Any) -> int:
            return self.plan.get_layer_offset(*args, **kwargs)

        def get_num_layers_to_build(self, *args: Any, **kwargs: Any) -> int:
            return self.plan.get_num_layers_to_build(*args, **kwargs)

        def get_layer_id_list(self, *args: Any, **kwargs: Any) -> list[int]:
            return self.plan.get_layer_id_list(*args, **kwargs)

    return ChunkLayout(plan)


def _build_v_chunk(chunks: dict[int, Any], vp_stage: int | None, pg_collection: Any, *, tied: bool,
                   build: Callable[[Any, int, bool], Any]) -> Any:
    """Chunk ``vp_stage`` of this rank's V, recorded in ``chunks`` -- the one rule of both routes
    (:class:`VModelProvider`, the builder wrapped by :func:`_wrap_builder`).

    ``build(plan, num_ranks, untied)`` builds the chunk of the V stage's
    :class:`~megatron_zb.model.ChunkPlan` (``pre_process`` / ``post_process`` by stage, its config a
    copy whose layout gives the global layer offset: ``megatron_zb.model.chunk_config``), with the
    word embedding and output layer untied when ``untied``. With ``tied`` embeddings both ends of
    the V (rank 0) are built untied and the loss chunk's output layer then uses chunk 0's embedding
    parameter, as ``pretrain_gpt_zb.py`` ties them in a V. The chunk's ``vp_stage`` is set, as
    Megatron-LM's ``get_model`` sets it."""
    from megatron.training import get_args

    from ..model import plan_chunks, tie_output_layer
    from ..schedules.ir import v_placement

    args = get_args()
    if vp_stage is None or args.virtual_pipeline_model_parallel_size != V_CHUNKS:
        raise RuntimeError(f"the V needs Megatron-LM's virtual pipeline size {V_CHUNKS} (set by megatron_zb."
                           f"megatron_lm.install()); Megatron-LM built a chunk with vp_stage={vp_stage}")
    p, _ = _pp(pg_collection)
    plan = plan_chunks(num_layers=args.num_layers, stage_to_rank=v_placement(p))[_v_stage(vp_stage, pg_collection)]
    untied = tied and (plan.pre_process or plan.post_process)
    module = build(plan, p, untied)
    if untied and plan.post_process:
        first = chunks.get(0)
        if first is None or not first.pre_process:
            raise RuntimeError("the V's loss chunk was built before its embedding chunk (vp_stage 0)")
        tie_output_layer(module, first.embedding.word_embeddings.weight)
    module.vp_stage = vp_stage
    chunks[vp_stage] = module
    return module


class VForwardBackward:
    """Megatron-LM's ``forward_backward_func`` for a V: runs ``inner`` (megatron-zb's, or its
    re-planning wrapper), then hands the losses from the loss stage's rank (pipeline rank 0) to the
    last pipeline rank, where Megatron-LM's ``train_step`` / ``evaluate`` average and log them
    (one ``send_object_list`` per call, tensors moved through the host). At the first call it
    checks that this rank's chunks were built by :class:`VModelProvider`."""

    def __init__(self, inner: Callable[..., list[Any]]) -> None:
        self.inner = inner
        self._checked = False

    def __call__(self, **kwargs: Any) -> list[Any]:
        """megatron-core's ``forward_backward_func`` keywords."""
        import torch
        from megatron.core import parallel_state

        if not self._checked:
            if not any(len(chunks) == V_CHUNKS for chunks in (_ROUTE.built, *(p.chunks for p in _ROUTE.providers))):
                raise RuntimeError(_not_built_for_the_v())
            self._checked = True
        out = self.inner(**kwargs)
        group = parallel_state.get_pipeline_model_parallel_group()
        p, r = group.size(), group.rank()
        if p == 1 or r not in (0, p - 1):
            return out
        if r == 0:
            torch.distributed.send_object_list([_to(out, torch.device("cpu"))],
                                               dst=torch.distributed.get_global_rank(group, p - 1), group=group)
            return out
        received: list[Any] = [None]
        torch.distributed.recv_object_list(received, src=torch.distributed.get_global_rank(group, 0), group=group)
        model = kwargs["model"]
        device = next((model if isinstance(model, list) else [model])[0].parameters()).device
        return _to(received[0], device)


def _not_built_for_the_v() -> str:
    """Why this rank's chunks are not the V's, and what to change (the release's route)."""
    from ..megatron_compat import megatron_lm_loop

    flag, schedule = _ROUTE.flag or "--schedule", _ROUTE.schedule or "V"
    builder = megatron_lm_loop().v_model_builder
    if builder is None:
        return str(_how_to_wrap(flag, schedule))
    return (f"{flag}: the model chunks of the V schedule {schedule!r} were built neither by {builder}, which "
            f"megatron-zb wraps for the V, nor by a megatron_zb.megatron_lm.v_model_provider (a script that "
            f"passes its own model provider to pretrain() must wrap it; other model builders are not supported)")


def _to(value: Any, device: Any) -> Any:
    """``value`` (tensors in lists, tuples, dicts) with every tensor moved to ``device``."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    return value

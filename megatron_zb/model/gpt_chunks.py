"""Build megatron-core ``GPTModel`` pipeline chunks for any stage placement.

A *placement* is ``stage_to_rank`` (see :mod:`megatron_zb.schedules.ir`): stage ``s`` runs on
rank ``stage_to_rank[s]``. Plain ``[0, 1, .., p-1]``, interleaved ``[s % p]`` and V
``[0, .., p-1, p-1, .., 0]`` are all just placements. Each stage is one ``GPTModel`` chunk with
``pre_process = (stage == 0)`` (embedding) and ``post_process = (stage == last)`` (final norm,
output layer, loss), holding a contiguous run of transformer layers.

**Global layer numbering.** megatron-core 0.16.1 derives a layer's global number from
``get_transformer_layer_offset(config, vp_stage, pp_rank)``, called by ``TransformerLayer``
(``layer_number``) and by ``TransformerBlock.sharded_state_dict`` (checkpoint keys). Its
built-in rules only know "stage = vp_stage * p + pp_rank", which is wrong for V. It does,
however, delegate both the offset and the layer count to ``config.pipeline_model_parallel_layout``
whenever that is set and ``config.pipeline_model_parallel_size > 1``. So every chunk gets a
shallow copy of the config whose ``pipeline_model_parallel_layout`` is its :class:`ChunkPlan`
(which answers ``get_layer_offset`` / ``get_num_layers_to_build`` with the chunk's own global
offset and count). Layer numbers, attention's layer-number scaling and dist-checkpoint keys then
come out global for every placement, with no change to megatron-core.

**Layout-independent initialisation.** The same ``seed`` gives every global layer the same
weights whatever rank or stage builds it: layer ``i`` (0-based) is constructed under the CPU
RNG seeded with ``derive_seed(seed, "layer", i)`` (:class:`SeededTransformerLayer`); word and
position embeddings and the output layer are re-initialised under ``derive_seed(seed,
"word_embeddings")`` etc. with megatron's own CPU init (full master weight, then this TP rank's
slice), so the weights are also independent of the tensor-parallel size. Requires
``use_cpu_initialization=True`` (megatron's GPU init draws from the RNG tracker instead).

Chunks use ``vp_stage=None``; a chunk's config has ``virtual_pipeline_model_parallel_size=None``
and ``pipeline_model_parallel_size = max(2, number of ranks)`` (megatron consults the layout only
when that is > 1; nothing else on the model path reads it -- it need not match ``parallel_state``).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import re
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import get_pg_rank, get_pg_size

from megatron_zb.megatron_compat import initialize_affine_weight_cpu, quiet_model_notices
from megatron_zb.model.mtp import (OneRankEmbeddingGPTModel, check_mtp_placement, mtp_block_spec, mtp_on_first_rank,
                                  no_virtual_stages, share_word_embedding, tie_mtp_stage)
from megatron_zb.planning.layout import pipeline_split, split_layers  # layer-split rules live with the planner (no torch)

__all__ = [
    "ChunkPlan",
    "GPTChunk",
    "SeededTransformerLayer",
    "TiedHeadGPTModel",
    "build_gpt_chunks",
    "chunk_config",
    "cpu_gpt_config",
    "derive_seed",
    "global_param_name",
    "named_global_parameters",
    "pipeline_split",
    "plan_chunks",
    "split_layers",
    "tie_output_layer",
]

_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.")


# ---------------------------------------------------------------------- layer split / plan
@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """One pipeline stage of a placement: where it runs and which global layers it holds.

    Also serves as the chunk config's ``pipeline_model_parallel_layout``: megatron-core asks it
    for the chunk's layer offset and count (``get_layer_offset`` / ``get_num_layers_to_build``).

    Attributes:
        stage: pipeline stage index (0 = embedding, ``num_stages - 1`` = loss).
        rank: pipeline rank that runs the stage.
        num_stages: stages in the placement.
        layer_offset: global 0-based index of the stage's first transformer layer.
        num_layers: transformer layers in the stage (may be 0).
        num_mtp_layers: multi-token prediction layers in the stage (``--mtp-num-layers``; all of
            them on the last stage, as megatron-core places them without a custom layout).
    """

    stage: int
    rank: int
    num_stages: int
    layer_offset: int
    num_layers: int
    num_mtp_layers: int = 0

    @property
    def pre_process(self) -> bool:
        """True on the first stage (holds the embedding)."""
        return self.stage == 0

    @property
    def post_process(self) -> bool:
        """True on the last stage (holds the final norm, output layer and loss)."""
        return self.stage == self.num_stages - 1

    @property
    def layer_ids(self) -> range:
        """Global 0-based indices of the stage's layers."""
        return range(self.layer_offset, self.layer_offset + self.num_layers)

    # -- the part of megatron's PipelineParallelLayerLayout interface the model path uses --
    @property
    def layout(self) -> "_ChunkLayout":
        """``layout[pp_rank][vp_stage]``: this chunk's layer types, whichever rank or virtual stage is
        asked (megatron-core 0.19's ``mtp_on_this_rank`` counts the ``LayerType.mtp`` entries)."""
        return _ChunkLayout((LayerType.decoder,) * self.num_layers + (LayerType.mtp,) * self.num_mtp_layers)

    def get_layer_offset(self, layer_type: LayerType = LayerType.decoder, vp_stage: int | None = None,
                         pp_rank: int | None = None) -> int:
        """Global offset of this chunk's first layer of ``layer_type`` (MTP layers: 0, all on one stage)."""
        return self.layer_offset if layer_type == LayerType.decoder else 0

    def get_num_layers_to_build(self, layer_type: LayerType = LayerType.decoder, vp_stage: int | None = None,
                                pp_rank: int | None = None) -> int:
        """Number of ``layer_type`` layers in this chunk (decoder or MTP layers)."""
        if layer_type == LayerType.mtp:
            return self.num_mtp_layers
        return self.num_layers if layer_type == LayerType.decoder else 0

    def get_layer_id_list(self, layer_type: LayerType = LayerType.decoder, vp_stage: int | None = None,
                          pp_rank: int | None = None) -> list[int]:
        """Global 0-based ids of this chunk's ``layer_type`` layers."""
        return list(self.layer_ids) if layer_type == LayerType.decoder else []


@dataclass(frozen=True, slots=True)
class _ChunkLayout:
    """:attr:`ChunkPlan.layout`: one chunk's layer types, as every (rank, virtual stage) entry."""

    types: tuple[LayerType, ...]

    def __getitem__(self, pp_rank: int) -> list[list[LayerType]]:
        return [list(self.types)]


def plan_chunks(*, num_layers: int, stage_to_rank: Sequence[int], layers_per_stage: Sequence[int] | None = None,
                allow_padding: bool = False, mtp_num_layers: int | None = None) -> list[ChunkPlan]:
    """The :class:`ChunkPlan` of every stage of ``stage_to_rank``, in stage order; the last stage
    holds the ``mtp_num_layers`` multi-token prediction layers (if any).

    ``layers_per_stage`` defaults to :func:`split_layers` ``(num_layers, len(stage_to_rank),
    allow_padding=allow_padding)``; an explicit list must sum to ``num_layers``.
    """
    s2r = [int(r) for r in stage_to_rank]
    if not s2r:
        raise ValueError("stage_to_rank is empty")
    ranks = sorted(set(s2r))
    if ranks != list(range(len(ranks))):
        raise ValueError(f"stage_to_rank {s2r} must use every rank 0..p-1 (uses {ranks})")
    if layers_per_stage is None:
        counts = split_layers(num_layers, len(s2r), allow_padding=allow_padding)
    else:
        counts = [int(n) for n in layers_per_stage]
        if len(counts) != len(s2r):
            raise ValueError(f"layers_per_stage has {len(counts)} entries for {len(s2r)} stages")
        if any(n < 0 for n in counts) or sum(counts) != num_layers:
            raise ValueError(f"layers_per_stage {counts} must be >= 0 and sum to num_layers={num_layers}")
    plans, offset = [], 0
    for stage, (rank, n) in enumerate(zip(s2r, counts)):
        mtp = (mtp_num_layers or 0) if stage == len(s2r) - 1 else 0
        plans.append(ChunkPlan(stage=stage, rank=rank, num_stages=len(s2r), layer_offset=offset, num_layers=n,
                               num_mtp_layers=mtp))
        offset += n
    return plans


# ---------------------------------------------------------------------- seeding
def derive_seed(seed: int, *key: int | str) -> int:
    """A 63-bit seed for one named part of the model, e.g. ``derive_seed(1234, "layer", 5)``.

    Deterministic across processes and Python versions (SHA-256 of the key, not ``hash()``).
    """
    digest = hashlib.sha256(repr((int(seed),) + tuple(key)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class SeededTransformerLayer(TransformerLayer):
    """``TransformerLayer`` whose parameters are drawn from ``derive_seed(init_seed, "layer", i)``.

    ``i`` is the global 0-based layer index (``layer_number - 1`` after megatron's offset), so
    the same layer gets the same weights in every placement. The global CPU RNG state is
    restored afterwards. Used through the layer spec's ``params`` (see :func:`build_gpt_chunks`).
    """

    def __init__(self, config: TransformerConfig, submodules: Any, layer_number: int = 1, *args: Any,
                 init_seed: int, **kwargs: Any) -> None:
        plan = config.pipeline_model_parallel_layout
        offset = plan.layer_offset if isinstance(plan, ChunkPlan) else 0
        global_index = offset + layer_number - 1
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(init_seed, "layer", global_index))
            super().__init__(config, submodules, layer_number, *args, **kwargs)
        if self.layer_number != global_index + 1:
            raise RuntimeError(f"megatron numbered layer {global_index} as {self.layer_number - 1}; "
                               "the chunk's layer offset was not applied")


# ---------------------------------------------------------------------- building
def cpu_gpt_config(*, num_layers: int, hidden_size: int, num_attention_heads: int, **kwargs: Any) -> TransformerConfig:
    """A ``TransformerConfig`` for CPU runs: CPU init, fp32 params and pipeline dtype, and stage
    outputs pseudo-freed once sent (``deallocate_pipeline_outputs``, which Megatron-LM's
    ``core_transformer_config_from_args`` always sets).

    ``kwargs`` override or extend (e.g. ``hidden_dropout=0.0``, ``tensor_model_parallel_size=2``).
    With ``multi_latent_attention=True`` the config is megatron-core's ``MLATransformerConfig`` (and
    ``kwargs`` may hold its fields: ``q_lora_rank``, ``kv_lora_rank``, ...), as Megatron-LM's
    ``core_transformer_config_from_args`` chooses it.
    """
    kwargs.setdefault("deallocate_pipeline_outputs", True)
    kwargs.setdefault("use_cpu_initialization", True)
    kwargs.setdefault("pipeline_dtype", torch.float32)
    kwargs.setdefault("params_dtype", torch.float32)
    config_class = MLATransformerConfig if kwargs.get("multi_latent_attention") else TransformerConfig
    return config_class(num_layers=num_layers, hidden_size=hidden_size,
                        num_attention_heads=num_attention_heads, **kwargs)


@dataclass(frozen=True, slots=True)
class GPTChunk:
    """A built pipeline chunk: its :class:`ChunkPlan` and the ``GPTModel`` (``module.config``
    is the chunk's own config copy)."""

    plan: ChunkPlan
    module: GPTModel


@quiet_model_notices()  # megatron-core 0.19's "GPTModel IS DEPRECATED" is megatron-zb's to read, not the user's
def build_gpt_chunks(
    *,
    config: TransformerConfig,
    vocab_size: int,
    max_sequence_length: int,
    stage_to_rank: Sequence[int],
    seed: int,
    rank: int | None = None,
    stages: Sequence[int] | None = None,
    layers_per_stage: Sequence[int] | None = None,
    allow_padding: bool = False,
    layer_spec: ModuleSpec | None = None,
    **gpt_kwargs: Any,
) -> list[GPTChunk]:
    """Build the ``GPTModel`` chunks of one rank (or explicit stages) of a placement.

    Args:
        config: the model's config; ``num_layers`` is the whole model's. Needs
            ``use_cpu_initialization=True`` and no pipeline-layout fields of its own. Each chunk
            gets a shallow copy (see the module docstring); ``config`` itself is not modified.
        vocab_size, max_sequence_length: as for ``GPTModel``.
        stage_to_rank: the placement; ``[0]`` builds the whole model as one chunk.
        seed: initialisation seed; equal seeds give equal weights per global layer in any placement.
        rank: build the stages placed on this rank; default: megatron's pipeline-parallel rank
            (then the placement must have exactly ``parallel_state``'s PP size ranks).
        stages: build exactly these stages instead (e.g. all of them, in one process).
        layers_per_stage, allow_padding: see :func:`plan_chunks`.
        layer_spec: a ``TransformerLayer`` spec; default ``get_gpt_layer_local_spec()``.
        gpt_kwargs: passed to ``GPTModel`` (e.g. ``position_embedding_type="rope"``).
            ``share_embeddings_and_output_weights=True`` ties the output layer to the word
            embedding: across ranks as megatron-core does (a copy on the last stage, kept in sync
            by the embedding group's all-reduce in ``finalize_model_grads``; plain and interleaved
            placements), or -- first and last stage on one rank (V) -- one parameter serving both
            (:class:`TiedHeadGPTModel`).

    Returns:
        The chunks in ascending stage order (= the rank's local chunk order).
    """
    _check_config(config)
    if config.recompute_granularity == "selective" and "layernorm" in (config.recompute_modules or ()):
        _fix_checkpoint_without_output()
    plans = plan_chunks(num_layers=config.num_layers, stage_to_rank=stage_to_rank,
                        layers_per_stage=layers_per_stage, allow_padding=allow_padding,
                        mtp_num_layers=config.mtp_num_layers)
    num_ranks = max(p.rank for p in plans) + 1
    if stages is None:
        if rank is None:
            pp_size = parallel_state.get_pipeline_model_parallel_world_size()
            if pp_size != num_ranks:
                raise ValueError(f"stage_to_rank {list(stage_to_rank)} spans {num_ranks} ranks but parallel_state "
                                 f"has pipeline-parallel size {pp_size}; pass rank= or stages= explicitly")
            rank = parallel_state.get_pipeline_model_parallel_rank()
        wanted = [p for p in plans if p.rank == rank]
    else:
        bad = [s for s in stages if not 0 <= s < len(plans)]
        if bad:
            raise ValueError(f"stages {bad} do not exist in a {len(plans)}-stage placement")
        wanted = [plans[s] for s in sorted(set(stages))]
    check_mtp_placement(plans, config.mtp_num_layers)
    mtp_on_rank0 = mtp_on_first_rank(plans)
    tied = bool(gpt_kwargs.get("share_embeddings_and_output_weights", False))
    # V-like placements hold the first and the last stage on one rank: one parameter serves both.
    tied_on_one_rank = tied and len(plans) > 1 and plans[0].rank == plans[-1].rank
    if tied and len(plans) > 1 and not tied_on_one_rank and (plans[0].rank, plans[-1].rank) != (0, num_ranks - 1):
        raise NotImplementedError("tied embeddings across ranks use megatron's embedding group (first and last "
                                  "pipeline rank): the first stage must be on rank 0 and the last on the last rank")

    spec = copy.copy(layer_spec if layer_spec is not None else get_gpt_layer_local_spec())
    if not (isinstance(spec.module, type) and issubclass(spec.module, TransformerLayer)):
        raise ValueError(f"layer_spec must build a TransformerLayer, got {spec.module!r}")
    if spec.module is TransformerLayer:
        spec.module = SeededTransformerLayer
    elif not issubclass(spec.module, SeededTransformerLayer):
        raise ValueError(f"layer_spec module {spec.module.__name__} is not SeededTransformerLayer; "
                         "layout-independent init needs it (subclass SeededTransformerLayer instead)")
    spec.params = {**spec.params, "init_seed": seed}

    chunks: list[GPTChunk] = []
    for plan in wanted:
        cfg = chunk_config(config, plan, num_ranks)
        common = dict(config=cfg, transformer_layer_spec=spec, vocab_size=vocab_size,
                      max_sequence_length=max_sequence_length, pre_process=plan.pre_process,
                      post_process=plan.post_process)
        if plan.num_mtp_layers:
            common["mtp_block_spec"] = mtp_block_spec(cfg, layer_spec if layer_spec is not None else spec, seed=seed)
        module = _build_chunk(plan, chunks, common, gpt_kwargs, tied_on_one_rank=tied_on_one_rank,
                              mtp_on_rank0=mtp_on_rank0)
        if cfg.perform_initialization:
            _init_embedding_and_output(module, seed)
        if mtp_on_rank0 and plan.num_mtp_layers:
            share_word_embedding(module, chunks[0].module.embedding.word_embeddings.weight)
        tie_mtp_stage(module)
        chunks.append(GPTChunk(plan=plan, module=module))
    return chunks


def _build_chunk(plan: ChunkPlan, built: Sequence[GPTChunk], common: dict[str, Any], gpt_kwargs: dict[str, Any], *,
                 tied_on_one_rank: bool, mtp_on_rank0: bool) -> GPTModel:
    """One chunk's ``GPTModel`` (``common``: its constructor's arguments but ``gpt_kwargs``). The first and the
    last stage of a V-like placement (``tied_on_one_rank``: tied embeddings; ``mtp_on_rank0``: MTP layers) are
    built untied, then share the first stage's word-embedding parameter (``built``: the rank's chunks so far,
    which must start with the first stage)."""
    ends = plan.pre_process or plan.post_process
    cls = OneRankEmbeddingGPTModel if mtp_on_rank0 and ends else GPTModel
    kwargs = {**gpt_kwargs, "share_embeddings_and_output_weights": False} if tied_on_one_rank and ends else gpt_kwargs
    if plan.post_process and (tied_on_one_rank or mtp_on_rank0) and (not built or not built[0].plan.pre_process):
        raise ValueError("tied embeddings or MTP in a V-like placement: build the first stage together with "
                         "the last (they share the word-embedding parameter)")
    with no_virtual_stages() if plan.num_mtp_layers else contextlib.nullcontext():
        module = cls(**common, **kwargs)
    if tied_on_one_rank and plan.post_process:  # as TiedHeadGPTModel
        tie_output_layer(module, built[0].module.embedding.word_embeddings.weight)
    return module


class TiedHeadGPTModel(GPTModel):
    """The last-stage ``GPTModel`` chunk whose output layer uses the first stage's word embedding
    *parameter* (same rank, V-like placements): :func:`tie_output_layer` applied at construction."""

    def __init__(self, *args: Any, tied_weight: torch.nn.Parameter, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        tie_output_layer(self, tied_weight)


def tie_output_layer(module: GPTModel, tied_weight: torch.nn.Parameter) -> None:
    """Make the last-stage chunk ``module`` (built untied) use ``tied_weight`` -- the first stage's
    word-embedding parameter, on the same rank (V-like placements) -- as its output layer's weight:
    no weight of its own, no copy to keep in sync.

    Its output layer's weight gradient lands on that parameter (B/W of the linear route, or
    autograd + DDP's hook into the first chunk's ``main_grad``); megatron's embedding-group
    all-reduce has nothing to do (neither chunk reports a duplicated weight). Checkpoints hold
    the weight once, under the first stage's ``embedding.word_embeddings.weight``. Works on any
    ``GPTModel`` instance (e.g. one a Megatron-LM model provider built): the two methods that
    differ are replaced on the instance.
    """
    if not module.post_process or module.pre_process:
        raise ValueError("tie_output_layer: the chunk must hold the last stage and not the first")
    if tied_weight.shape != module.output_layer.weight.shape:
        raise ValueError(f"tied weight of shape {tuple(tied_weight.shape)} does not fit the output layer "
                         f"{tuple(module.output_layer.weight.shape)}")
    del module.output_layer.weight
    module.output_layer.weight = None
    # Two layers on one rank share the parameter: as megatron-core does for tied embeddings at
    # PP=1, a weight-gradient placeholder must be zeros and DDP's hook must always add .grad
    # (otherwise the output layer's `grad_added_to_main_grad` would drop the embedding's
    # gradient, which arrives in another backward pass).
    tied_weight.zero_out_wgrad = True
    module.shared_embedding_or_output_weight = lambda: tied_weight  # forward passes the shared weight
    module.tie_embeddings_and_output_weights_state_dict = lambda *args, **kwargs: None  # stage 0 saves it
    module.share_embeddings_and_output_weights = True


def _fix_checkpoint_without_output() -> None:
    """Make megatron-core's ``CheckpointWithoutOutput`` (selective ``layernorm`` recomputation) run
    without Transformer Engine.

    megatron-core 0.16.1 sets ``self.fp8 = fp8 is not None``, true for its default ``fp8=False``,
    and then calls Transformer Engine's ``FP8GlobalStateManager`` -- a ``NameError`` on any
    install without TE. Without TE there is no fp8, so the object's ``fp8`` is set to False
    (idempotent; nothing changes when TE is installed).
    """
    from megatron.core.tensor_parallel import random as mcore_random

    cls = mcore_random.CheckpointWithoutOutput
    if mcore_random.HAVE_TE or getattr(cls, "_megatron_zb_no_te", False):
        return
    original = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.fp8 = False

    cls.__init__ = __init__
    cls._megatron_zb_no_te = True


def _check_config(config: TransformerConfig) -> None:
    if not config.use_cpu_initialization:
        raise ValueError("build_gpt_chunks needs use_cpu_initialization=True for layout-independent weights "
                         "(megatron's GPU init draws from the RNG tracker, not from the per-layer seed)")
    owned = {
        "pipeline_model_parallel_layout": config.pipeline_model_parallel_layout,
        "num_layers_in_first_pipeline_stage": config.num_layers_in_first_pipeline_stage,
        "num_layers_in_last_pipeline_stage": config.num_layers_in_last_pipeline_stage,
    }
    set_fields = [k for k, v in owned.items() if v is not None]
    set_fields += [k for k in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
                   if getattr(config, k)]
    if set_fields:
        raise ValueError(f"build_gpt_chunks decides the layer placement itself; unset {set_fields} in the config")


def chunk_config(config: TransformerConfig, plan: ChunkPlan, num_ranks: int) -> TransformerConfig:
    """Shallow copy of ``config`` that makes megatron number this chunk's layers globally (module
    docstring); ``num_ranks``: pipeline ranks of the placement."""
    cfg = copy.copy(config)
    cfg.virtual_pipeline_model_parallel_size = None
    if plan.num_stages == 1:
        cfg.pipeline_model_parallel_size = 1
        cfg.pipeline_model_parallel_layout = None
    else:
        cfg.pipeline_model_parallel_size = max(2, num_ranks)
        cfg.pipeline_model_parallel_layout = plan
    return cfg


@torch.no_grad()
def _init_embedding_and_output(module: GPTModel, seed: int) -> None:
    """Re-draw embedding / output weights from per-tensor seeds (megatron's CPU init, TP-sliced)."""
    cfg = module.config

    def init_vocab_parallel(weight: torch.Tensor, part: torch.nn.Module, init_method: Any, key: str) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(seed, key))
            initialize_affine_weight_cpu(weight, module.vocab_size, cfg.hidden_size, weight.shape[0], 0, init_method,
                                         params_dtype=cfg.params_dtype, rank=get_pg_rank(part.tp_group),
                                         world_size=get_pg_size(part.tp_group))

    if module.pre_process or getattr(module, "mtp_process", False):  # the MTP stage's copy: stage 0's values
        word = module.embedding.word_embeddings
        init_vocab_parallel(word.weight, word, cfg.embedding_init_method, "word_embeddings")
        position = getattr(module.embedding, "position_embeddings", None)
        if position is not None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(derive_seed(seed, "position_embeddings"))
                cfg.embedding_init_method(position.weight)
    if module.post_process and module.output_layer.weight is not None:
        out = module.output_layer
        if module.share_embeddings_and_output_weights:
            # A later stage's copy of the tied embedding: the same values as stage 0's embedding.
            init_vocab_parallel(out.weight, out, cfg.embedding_init_method, "word_embeddings")
        else:
            init_vocab_parallel(out.weight, out, cfg.init_method, "output_layer")


# ---------------------------------------------------------------------- naming
def global_param_name(name: str, plan: ChunkPlan) -> str:
    """Map a chunk's parameter/state name to the whole model's (layer index made global).

    ``decoder.layers.{i}.…`` becomes ``decoder.layers.{plan.layer_offset + i}.…``; other names
    (embedding, final norm, output layer) are the same in every placement, but for the MTP stage's own
    copy of the embedding (not the first stage): ``mtp_stage.embedding.…``.
    """
    if plan.num_mtp_layers and not plan.pre_process and name.startswith("embedding."):
        return f"mtp_stage.{name}"
    m = _LAYER_NAME.match(name)
    if m is None:
        return name
    return f"decoder.layers.{plan.layer_offset + int(m.group(1))}.{name[m.end():]}"


def named_global_parameters(chunk: GPTChunk) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """``(global name, parameter)`` for every parameter of ``chunk`` (see :func:`global_param_name`)."""
    for name, param in chunk.module.named_parameters():
        yield global_param_name(name, chunk.plan), param

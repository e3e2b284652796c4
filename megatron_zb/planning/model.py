"""The model and the parallel layout a plan is for, in Megatron's terms, checked up front.

Field names are Megatron-LM's argument names (``--num-layers`` is ``num_layers``), so a profile
written by ``pretrain_gpt_zb.py`` can carry them as they are. Every rule that Megatron (or the
planner) would reject raises :class:`PlanError` naming the flag.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .layout import LayerSplit

POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
PRECISIONS = ("bf16", "fp16", "fp32")
TRANSFORMER_IMPLS = ("transformer_engine", "local")
ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Bytes of one activation, parameter or parameter gradient element, per precision."""


def default_ffn_hidden_size(hidden_size: int, *, swiglu: bool) -> int:
    """Megatron-LM's default ``--ffn-hidden-size`` [elements]: ``4h``, with ``--swiglu`` a multiple of
    64 near ``8h/3`` (``int(4h * 2/3 / 64) * 64``). The one copy of the rule (command line and planner)."""
    return int((4 * hidden_size * 2 / 3) / 64) * 64 if swiglu else 4 * hidden_size


class PlanError(ValueError):
    """A user error; ``flag`` names the offending flag (or file)."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag


def padded_vocab_size(vocab_size: int, *, divisible_by: int = 128, tp: int = 1) -> int:
    """``vocab_size`` rounded up to a multiple of ``divisible_by x tp`` [rows]: Megatron-LM's
    ``--make-vocab-size-divisible-by`` rule, with and without ``--enable-vocab-parallel`` (whose ``TP x PP``
    slices split the rows as evenly as they go, :class:`~megatron_zb.model.vocab_parallel.VocabSlice`), so a
    checkpoint continues across the flag whatever the vocabulary size."""
    if vocab_size < 1 or divisible_by < 1 or tp < 1:
        raise ValueError(f"padded_vocab_size: vocab_size={vocab_size}, divisible_by={divisible_by} and tp={tp} "
                         f"must be >= 1")
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def padded_vocab_fix(saved: int, *, tp: int) -> str:
    """How to load a checkpoint whose embedding has ``saved`` rows into a run that pads to other rows
    (the clause after the checkpoint's refusal): ``--make-vocab-size-divisible-by saved/TP`` pads this
    run to exactly ``saved`` rows (:func:`padded_vocab_size`), with or without
    ``--enable-vocab-parallel``, unless TP does not divide ``saved``."""
    if saved % tp == 0:
        return f"pass --make-vocab-size-divisible-by {saved // tp} to pad this run to the checkpoint's {saved} rows"
    return (f"the checkpoint's {saved} rows do not split over this run's {tp} tensor-parallel ranks: load it at a "
            f"--tensor-model-parallel-size that divides {saved}")


@dataclass(frozen=True)
class PlanModel:
    """A GPT model as Megatron's flags describe it (resolved: no ``None`` left): the model that
    ``megatron-zb plan`` (and ``--profile-out``'s profile) plans for. Not the training run's
    :class:`megatron_zb.training.run_config.ModelConfig`, from which
    :func:`megatron_zb.training.replanning.planning_model` derives one.

    Attributes:
        num_layers: transformer layers.
        hidden_size: ``h``.
        num_attention_heads: ``a``.
        seq_length: ``s``, tokens per sample.
        micro_batch_size: ``b``, samples per microbatch.
        vocab_size: tokens in the vocabulary (before padding).
        ffn_hidden_size: MLP width (Megatron's default ``4h``, with SwiGLU ``int(8h/3/64)*64``).
        num_query_groups: key/value heads ``g`` (``a`` without grouped-query attention).
        kv_channels: channels per head ``d`` (default ``h / a``).
        swiglu: gated MLP (two input projections of ``ffn_hidden_size`` each).
        make_vocab_size_divisible_by: embedding rows are padded to a multiple of this times TP.
        untie_embeddings_and_output_weights: separate output-layer weights.
        position_embedding_type: ``learned_absolute`` (a table of ``max_position_embeddings``
            rows), ``rope`` or ``none``.
        max_position_embeddings: rows of the learned position table.
        normalization: ``LayerNorm`` or ``RMSNorm``.
        add_bias_linear: biases on the linear layers (Megatron's default; ``--disable-bias-linear``).
        hidden_dropout: dropout after attention and MLP (a mask is kept when > 0).
        attention_dropout: dropout on the attention probabilities.
        use_flash_attn: fused (flash) attention: no ``s x s`` score tensors are kept.
        precision: ``bf16`` or ``fp16`` (mixed precision: 2-byte activations and parameters, fp32
            main gradients and optimizer state) or ``fp32`` (Megatron's default without ``--bf16`` /
            ``--fp16``: 4-byte everything, no master copy).
        transformer_impl: ``transformer_engine`` (Megatron-LM's default) or ``local``: with sequence
            parallelism TE's layers keep the all-gathered inputs of the column-parallel layers until
            ``W`` (:mod:`.memory`).
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    micro_batch_size: int
    vocab_size: int
    ffn_hidden_size: int
    num_query_groups: int
    kv_channels: int
    swiglu: bool = False
    make_vocab_size_divisible_by: int = 128
    untie_embeddings_and_output_weights: bool = False
    position_embedding_type: str = "learned_absolute"
    max_position_embeddings: int = 0
    normalization: str = "LayerNorm"
    add_bias_linear: bool = True
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    use_flash_attn: bool = False
    precision: str = "bf16"
    transformer_impl: str = "transformer_engine"

    @property
    def element_bytes(self) -> int:
        """Bytes of one activation, parameter or parameter-gradient element (2 or 4)."""
        return ELEMENT_BYTES[self.precision]

    def padded_vocab_size(self, tp: int) -> int:
        """Embedding rows as Megatron builds them: rounded up to ``divisible_by * TP``
        (:func:`padded_vocab_size`; with ``--enable-vocab-parallel`` too)."""
        return padded_vocab_size(self.vocab_size, divisible_by=self.make_vocab_size_divisible_by, tp=tp)

    @property
    def query_size(self) -> int:
        """``a * d``: width of the query projection (``h`` unless ``--kv-channels`` differs)."""
        return self.num_attention_heads * self.kv_channels

    @property
    def kv_size(self) -> int:
        """``g * d``: width of the key (or value) projection."""
        return self.num_query_groups * self.kv_channels

    def to_flags(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PlanLayout:
    """The parallel layout and batch of one iteration that ``megatron-zb plan`` plans for. Not the
    training run's :class:`megatron_zb.training.run_config.ParallelConfig`, from which
    :func:`megatron_zb.training.replanning.planning_parallel` derives one.

    Attributes:
        pp: pipeline-parallel size (ranks of one pipeline).
        tp: tensor-parallel size.
        dp: data-parallel size.
        num_microbatches: ``m``, microbatches per iteration per pipeline.
        sequence_parallel: Megatron sequence parallelism (norms/dropout sharded over TP).
        use_distributed_optimizer: optimizer state sharded over DP.
        allow_padding_num_layers: the first/last stage may take fewer layers
            (:func:`megatron_zb.planning.layout.split_layers`).
        num_virtual_stages: chunks per rank for interleaved schedules, or ``None`` for the
            smallest number >= 2 that splits the layers evenly.
        decoder_first_pipeline_num_layers, decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split, account_for_loss_in_pipeline_split: Megatron's
            uneven-split flags (:func:`megatron_zb.planning.layout.pipeline_split`); any of them
            decides the layers per stage instead of the even split.
        data_parallel_sharding_strategy: ``no_shard``, ``optim`` (the distributed optimizer's sharding) or
            ``optim_grads`` (sharded gradients, ZeRO-2: :mod:`megatron_zb.planning.sharded`).
        ddp_bucket_size: elements per gradient bucket (``--ddp-bucket-size``); ``None``: megatron-core's
            default, ``max(40M, 1M x dp)``.
        wgrad_group: with ``optim_grads``, the W group size ``k`` to plan; ``None``: every candidate, the
            planner recommends one (``--zero-bubble-wgrad-group auto``).
    """

    pp: int
    tp: int = 1
    dp: int = 1
    num_microbatches: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    allow_padding_num_layers: bool = False
    num_virtual_stages: int | None = None
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    data_parallel_sharding_strategy: str = "no_shard"
    ddp_bucket_size: int | None = None
    wgrad_group: int | None = None

    @property
    def bucket_elements(self) -> int:
        """Elements per gradient bucket: ``ddp_bucket_size``, else megatron-core's ``max(40M, 1M x dp)``."""
        return self.ddp_bucket_size if self.ddp_bucket_size is not None else max(40_000_000, 1_000_000 * self.dp)

    @property
    def split(self) -> "LayerSplit":
        """The flags that decide the layers per stage (:func:`~megatron_zb.planning.layout.layers_per_stage`)."""
        from .layout import LayerSplit
        return LayerSplit(allow_padding=self.allow_padding_num_layers,
                          first_stage_layers=self.decoder_first_pipeline_num_layers,
                          last_stage_layers=self.decoder_last_pipeline_num_layers,
                          account_for_embedding=self.account_for_embedding_in_pipeline_split,
                          account_for_loss=self.account_for_loss_in_pipeline_split)

    def to_flags(self) -> dict[str, Any]:
        """The fields under Megatron's argument names (``pp`` is ``pipeline_model_parallel_size``)."""
        return {_PARALLEL_FLAGS.get(f.name, f.name): getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_flags(cls, flags: dict[str, Any]) -> "PlanLayout":
        """Inverse of :meth:`to_flags`; unknown keys raise ``ValueError``."""
        names = {_PARALLEL_FLAGS.get(f.name, f.name): f.name for f in fields(cls)}
        unknown = sorted(set(flags) - set(names))
        if unknown:
            raise ValueError(f"parallel has unknown keys {unknown}")
        return cls(**{names[k]: v for k, v in flags.items()})


_PARALLEL_FLAGS = {"pp": "pipeline_model_parallel_size", "tp": "tensor_model_parallel_size",
                   "dp": "data_parallel_size", "num_virtual_stages": "num_virtual_stages_per_pipeline_rank"}


SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads")
"""The ``--data-parallel-sharding-strategy`` values a plan takes (Megatron-LM's, without ZeRO-3)."""


def _check_sharding(par: PlanLayout) -> None:
    """The sharding flags against the layout (:class:`PlanError` naming the flag), as ``pretrain_gpt_zb.py``
    checks them (:mod:`megatron_zb.training.arguments.sharding`)."""
    s, k = par.data_parallel_sharding_strategy, par.wgrad_group
    if s not in SHARDING_STRATEGIES:
        raise PlanError("--data-parallel-sharding-strategy", f"one of {', '.join(SHARDING_STRATEGIES)}, got {s!r}")
    if s != "no_shard" and not par.use_distributed_optimizer:
        raise PlanError("--data-parallel-sharding-strategy", f"{s} shards through the distributed optimizer; add "
                                                             f"--use-distributed-optimizer")
    if s == "optim_grads" and par.sequence_parallel:
        raise PlanError("--sequence-parallel", "not supported with --data-parallel-sharding-strategy optim_grads yet")
    if par.ddp_bucket_size is not None and par.ddp_bucket_size < 1:
        raise PlanError("--ddp-bucket-size", f"must be >= 1, got {par.ddp_bucket_size}")
    if k is not None and s != "optim_grads":
        raise PlanError("--zero-bubble-wgrad-group", "groups the W's of sharded gradients; add "
                                                     "--data-parallel-sharding-strategy optim_grads")
    if k is not None and (k < 1 or par.num_microbatches % k):
        raise PlanError("--zero-bubble-wgrad-group", f"{k} does not divide the {par.num_microbatches} microbatches "
                                                     f"per iteration; use a divisor (or auto)")


def make_model(*, num_layers: int, hidden_size: int, num_attention_heads: int, seq_length: int,
               micro_batch_size: int, vocab_size: int, ffn_hidden_size: int | None = None,
               num_query_groups: int | None = None, group_query_attention: bool = False,
               kv_channels: int | None = None, swiglu: bool = False, **rest: Any) -> PlanModel:
    """Resolve Megatron's defaults and check the model flags.

    Raises:
        PlanError: a value no Megatron model can have, naming the flag.
    """
    if not isinstance(num_attention_heads, int) or num_attention_heads < 1:
        raise PlanError("--num-attention-heads", f"must be an integer >= 1, got {num_attention_heads!r}")
    if kv_channels is None:
        if hidden_size % num_attention_heads:
            raise PlanError("--num-attention-heads", f"{num_attention_heads} heads do not divide --hidden-size "
                                                     f"{hidden_size} (or give --kv-channels)")
        kv_channels = hidden_size // num_attention_heads
    if num_query_groups is not None and not group_query_attention:
        raise PlanError("--num-query-groups", "needs --group-query-attention (Megatron ignores it otherwise)")
    groups = num_query_groups if group_query_attention and num_query_groups is not None else num_attention_heads
    if ffn_hidden_size is None:
        ffn_hidden_size = default_ffn_hidden_size(hidden_size, swiglu=swiglu)
    rest.setdefault("max_position_embeddings", seq_length)
    model = PlanModel(num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
                        seq_length=seq_length, micro_batch_size=micro_batch_size, vocab_size=vocab_size,
                        ffn_hidden_size=ffn_hidden_size, num_query_groups=groups, kv_channels=kv_channels,
                        swiglu=swiglu, **rest)
    check_model(model)
    return model


def check_model(m: PlanModel) -> None:
    """Reject values no Megatron model can have (:class:`PlanError` naming the flag)."""
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                 "vocab_size", "ffn_hidden_size", "num_query_groups", "kv_channels",
                 "make_vocab_size_divisible_by", "max_position_embeddings"):
        value = getattr(m, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlanError("--" + name.replace("_", "-"), f"must be an integer >= 1, got {value!r}")
    if m.num_attention_heads % m.num_query_groups:
        raise PlanError("--num-query-groups", f"{m.num_query_groups} groups do not divide "
                                              f"{m.num_attention_heads} attention heads")
    if m.position_embedding_type not in POSITION_EMBEDDINGS:
        raise PlanError("--position-embedding-type", f"one of {', '.join(POSITION_EMBEDDINGS)}")
    if m.normalization not in NORMALIZATIONS:
        raise PlanError("--normalization", f"one of {', '.join(NORMALIZATIONS)}")
    if m.transformer_impl not in TRANSFORMER_IMPLS:
        raise PlanError("--transformer-impl", f"one of {', '.join(TRANSFORMER_IMPLS)}, got {m.transformer_impl!r}")
    if m.precision not in PRECISIONS:
        raise PlanError("--bf16", f"precision {m.precision!r} is not one of {', '.join(PRECISIONS)}")
    if m.position_embedding_type == "learned_absolute" and m.max_position_embeddings < m.seq_length:
        raise PlanError("--max-position-embeddings", f"{m.max_position_embeddings} < --seq-length {m.seq_length}")
    for flag, p in (("--hidden-dropout", m.hidden_dropout), ("--attention-dropout", m.attention_dropout)):
        if not 0 <= p < 1:
            raise PlanError(flag, f"must be in [0, 1), got {p:g}")


def make_parallel(model: PlanModel, *, pp: int, tp: int = 1, dp: int = 1, num_microbatches: int | None = None,
                  global_batch_size: int | None = None, **rest: Any) -> PlanLayout:
    """Resolve the microbatch count and check the layout against ``model``.

    ``num_microbatches`` or ``global_batch_size`` (= ``m * micro_batch_size * dp``) is required;
    both may be given if they agree. Whether the layers split over the pipeline stages is checked
    per placement (:mod:`megatron_zb.planning.layout`); the plain placement is checked here unless
    an uneven-split flag is given (its split depends on the placement).

    Raises:
        PlanError: naming the flag.
    """
    for flag, value in (("--pipeline-model-parallel-size", pp), ("--tensor-model-parallel-size", tp),
                        ("--data-parallel-size", dp)):
        if not isinstance(value, int) or value < 1:
            raise PlanError(flag, f"must be an integer >= 1, got {value!r}")
    if pp < 2:
        raise PlanError("--pipeline-model-parallel-size", f"must be >= 2 to plan a pipeline schedule, got {pp}")
    m = _microbatches(model, dp, num_microbatches, global_batch_size)
    if model.num_attention_heads % tp or model.num_query_groups % tp:
        raise PlanError("--tensor-model-parallel-size", f"TP {tp} must divide the {model.num_attention_heads} "
                                                        f"attention heads and {model.num_query_groups} query groups")
    par = PlanLayout(pp=pp, tp=tp, dp=dp, num_microbatches=m, **rest)
    if par.sequence_parallel and tp == 1:
        raise PlanError("--sequence-parallel", "needs --tensor-model-parallel-size > 1")
    if par.num_virtual_stages is not None and par.num_virtual_stages < 2:
        raise PlanError("--num-virtual-stages-per-pipeline-rank", f"must be >= 2, got {par.num_virtual_stages}")
    _check_sharding(par)
    if par.split.uneven:  # the split depends on the placement: families that cannot hold it are skipped
        return par
    from megatron_zb.schedules import plain_placement

    from .layout import layers_per_stage
    try:
        layers_per_stage(model.num_layers, plain_placement(pp), par.split)
    except ValueError as e:
        hint = "" if par.allow_padding_num_layers else " (or add --allow-padding-num-layers)"
        raise PlanError("--pipeline-model-parallel-size", f"{pp} stages cannot hold --num-layers "
                                                          f"{model.num_layers}: {e}{hint}") from None
    return par


def _microbatches(model: PlanModel, dp: int, m: int | None, gbs: int | None) -> int:
    if m is None and gbs is None:
        raise PlanError("--num-microbatches", "give --num-microbatches or --global-batch-size "
                                              "(with --data-parallel-size)")
    if gbs is not None:
        per = model.micro_batch_size * dp
        if gbs < 1 or gbs % per:
            raise PlanError("--global-batch-size", f"{gbs} is not a multiple of --micro-batch-size x "
                                                   f"--data-parallel-size = {per}")
        if m is not None and m != gbs // per:
            raise PlanError("--num-microbatches",
                            f"{m} disagrees with --global-batch-size {gbs} / {per} = {gbs // per}")
        m = gbs // per
    if m < 1:
        raise PlanError("--num-microbatches", f"must be >= 1, got {m}")
    return m

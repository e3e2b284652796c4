"""Activation memory ``M_B`` / ``M_W`` per stage and parameter + optimizer memory per rank (bytes).

Activations (one microbatch, one GPU, no recomputation; ``e`` bytes per element: 2 in bf16/fp16,
4 in fp32 -- the table's factors 2 are ``e``), counted tensor by tensor the way
Korthikanti et al. (arXiv 2205.05198, section 4) count Megatron's GPT layer -- the count behind
the zero-bubble paper's (arXiv 2401.10241, section 2) ``M_B = 34sbh + 5as^2b`` per layer. With
``T = sb``, ``A = Th / r`` (``r = t`` with sequence parallelism, else 1), per-GPU widths
``q = ad/t``, ``g d / t`` and ``f / t``:

========================  ===================================  ==================================
saved by F, freed by B    unfused attention                    ``--use-flash-attn``
========================  ===================================  ==================================
input norm, QKV input     ``2A + 2A``                          same
attention                 ``Q, K 4Tq``; softmax ``2S``; mask   ``q, k, v 2T(q + 2gd/t)``;
                          ``S``; dropout out ``2S``; ``V 2Tq``   softmax statistics ``4Ta/t``
projection input          ``2Tq``                              same
dropout masks             ``A + A`` (1 byte each)              same
MLP                       norm ``2A``, FC1 in ``2A``,          same
                          activation in ``2T f gl/t``,
                          FC2 in ``2T f/t``
========================  ===================================  ==================================

(``S = s^2 b a / t``, keys and values counted at ``a`` heads because the unfused path repeats
them for GQA, ``gl = 2`` with SwiGLU). For the paper's GPT (``t = 1``, MHA, ``f = 4h``, dropout)
this is exactly ``34sbh + 5as^2b``.

``M_W`` is what the weight gradients need after ``B`` has freed the rest: the input and the
output gradient of each linear layer -- QKV ``2A + 2T(q + 2gd/t)``, projection ``2Tq + 2Th``,
FC1 ``2A + 2T f gl / t``, FC2 ``2T f / t + 2Th`` -- which is the paper's ``M_W = 32sbh`` for its
GPT. With sequence parallelism the row-parallel layers' (projection, FC2) output gradients are
all-gathered in ``B`` and kept for ``W``: ``2Th`` each, not divided by ``t``. The column-parallel
layers' (QKV, FC1) inputs: megatron-zb's linear route keeps the sequence-sharded ``2A`` and gathers
it again in ``W``; Transformer Engine's layers (``--transformer-impl transformer_engine``, with
``delay_wgrad_compute``) keep the input they all-gathered in ``B`` until ``W``: ``2Th`` each
(``t`` times ``2A``). So at a large ``t`` ``M_W`` can exceed ``M_B`` (TP=8 with SP and flash
attention, ``h = s = 4096``: about 2.6x with TE, 1.8x without, per layer): ``B`` then
allocates ``M_W - M_B``, which the cost model expresses (:class:`~megatron_zb.schedules.costs.CostModel`:
``B`` changes the held memory by ``mem_w - mem_b``) and the schedules' memory limits check at ``B``.
The embedding stage adds its dropout mask to ``M_B`` and its output gradient to ``M_W``;
the loss stage adds the final norm's and output layer's inputs and the fp32 softmax of the
cross entropy (``4 T V/t``) to ``M_B``, and the output layer's input and 16-bit logit gradient
to ``M_W``.

Parameters and optimizer: Megatron's mixed-precision Adam keeps 18 bytes per parameter (16-bit
weight 2, fp32 gradient 4, fp32 master weight 4, two fp32 moments 8); the distributed optimizer
shards the 12 bytes of master weight and moments over the DP ranks (``6 + 12/dp``); sharded gradients
(``optim_grads``, ZeRO-2) shard the fp32 gradient as well (``2 + 16/dp``, plus per-rank buffers:
:mod:`.sharded`). In fp32 there is no master copy: 16 bytes (weight 4, gradient 4, moments 8), ``8 + 8/dp``
distributed, ``4 + 12/dp`` with sharded gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

from .layout import StageShape
from .model import PlanLayout, PlanModel

GIB = float(2 ** 30)
FP32 = 4


@dataclass(frozen=True)
class ActivationBytes:
    """``M_B`` (allocated by F, held until B) and ``M_W`` (held from B until W), bytes."""

    mem_b: float
    mem_w: float


def _sizes(model: PlanModel, par: PlanLayout) -> tuple[float, float, float, float, float, float, int]:
    t = par.tp
    T = float(model.seq_length * model.micro_batch_size)
    A = T * model.hidden_size / (t if par.sequence_parallel else 1)
    return (T, A, model.query_size / t, model.kv_size / t, model.ffn_hidden_size / t,
            T * model.seq_length * model.num_attention_heads / t, 2 if model.swiglu else 1)


def mem_w_ratio(*, hidden_size: int, num_attention_heads: int, seq_length: int) -> float:
    """``M_W / M_B = 32h / (34h + 5as)``: the share of a layer's activation memory that ``W`` still
    holds after ``B``, for the zero-bubble paper's GPT (``M_B = 34sbh + 5as^2b``, ``M_W = 32sbh``;
    unfused attention, MHA, ``f = 4h``, 16-bit). The one copy of the formula: the profiler's
    fallback, the emulated benchmark and the tests use it."""
    h, a, s = hidden_size, num_attention_heads, seq_length
    return (32.0 * h) / (34.0 * h + 5.0 * a * s)


def layer_activations(model: PlanModel, par: PlanLayout) -> ActivationBytes:
    """``M_B`` and ``M_W`` of one transformer layer on one GPU, bytes (table in the module doc)."""
    e = model.element_bytes
    T, A, q, kv, f, S, gl = _sizes(model, par)
    masks = (2 * A if model.hidden_dropout > 0 else 0.0)
    if model.use_flash_attn:
        attention = e * T * (q + 2 * kv) + FP32 * T * model.num_attention_heads / par.tp
    else:
        drop = model.attention_dropout > 0
        attention = e * 3 * T * q + e * S + (S + e * S if drop else 0.0)
    mem_b = (e * 2 * A + attention + e * T * q + masks + e * 2 * A + e * T * f * gl + e * T * f)
    h = float(model.hidden_size)
    kept_in = T * h if model.transformer_impl == "transformer_engine" else A   # column-parallel inputs W keeps
    mem_w = e * (kept_in + T * (q + 2 * kv) + T * q + T * h + kept_in + T * f * gl + T * f + T * h)
    return ActivationBytes(mem_b, mem_w)


def stage_activations(model: PlanModel, par: PlanLayout, shape: StageShape, *,
                      vocab_parallel: bool = False) -> ActivationBytes:
    """``M_B`` and ``M_W`` of a whole stage (its layers, plus embedding / loss), bytes. ``M_W`` may
    exceed ``M_B`` (sequence parallelism at a large TP, module doc): ``B`` then allocates.
    ``vocab_parallel``: the loss stage keeps only its final norm's input (the output layer's are the
    vocabulary passes' ``mem_s``, :mod:`.vocab`)."""
    e = model.element_bytes
    T, A, *_ = _sizes(model, par)
    layer = layer_activations(model, par)
    mem_b, mem_w = layer.mem_b * shape.num_layers, layer.mem_w * shape.num_layers
    if shape.embedding:
        mem_b += A if model.hidden_dropout > 0 else 0.0
        mem_w += e * A
    if shape.loss and vocab_parallel:
        mem_b += e * A
    elif shape.loss:
        n_logits = T * model.padded_vocab_size(par.tp) / par.tp
        mem_b += e * 2 * A + FP32 * n_logits
        mem_w += e * A + e * n_logits
    return ActivationBytes(mem_b, mem_w)


def layer_parameters(model: PlanModel, par: PlanLayout) -> float:
    """Parameters of one transformer layer held by one GPU."""
    _, _, q, kv, f, _, gl = _sizes(model, par)
    h = float(model.hidden_size)
    bias = 1.0 if model.add_bias_linear else 0.0
    norm = 2 * h if model.normalization == "LayerNorm" else h
    return (h * (q + 2 * kv) + bias * (q + 2 * kv) + q * h + bias * h
            + h * f * gl + bias * f * gl + f * h + bias * h + 2 * norm)


def stage_parameters(model: PlanModel, par: PlanLayout, shape: StageShape, *,
                     vocab_parallel: bool = False) -> float:
    """Parameters of one stage on one GPU (the last stage holds the output layer, or with tied
    embeddings Megatron's copy of the word embeddings: the same size). ``vocab_parallel``: without the
    word embedding and the output layer (every rank's slices, :mod:`.vocab`)."""
    h = float(model.hidden_size)
    n = layer_parameters(model, par) * shape.num_layers
    word = 0.0 if vocab_parallel else model.padded_vocab_size(par.tp) / par.tp * h
    if shape.embedding:
        n += word + (model.max_position_embeddings * h if model.position_embedding_type == "learned_absolute" else 0)
    if shape.loss:
        n += word + (2 * h if model.normalization == "LayerNorm" else h)
    return n


def bytes_per_parameter(model: PlanModel, par: PlanLayout) -> float:
    """Weights, gradients and Adam state per parameter (module doc): mixed precision 18, or
    ``6 + 12/dp`` with the distributed optimizer, or ``2 + 16/dp`` with sharded gradients (``optim_grads``:
    the fp32 gradient is a shard too); fp32 16, ``8 + 8/dp``, ``4 + 12/dp``. Sharded gradients' work buffers
    and residual gradients are per rank, not per parameter (:mod:`.sharded`)."""
    d = par.dp
    mixed = model.precision != "fp32"
    if par.data_parallel_sharding_strategy == "optim_grads":
        return (2.0 + 16.0 / d) if mixed else (4.0 + 12.0 / d)
    if par.use_distributed_optimizer:
        return (6.0 + 12.0 / d) if mixed else (8.0 + 8.0 / d)
    return 18.0 if mixed else 16.0

"""Time of ``F``, ``B`` and ``W`` for every pipeline stage, from the FLOPs and bytes of its kernels.

The FLOPs are the ones the kernels *execute*: the GEMMs of the model FLOPs
(:mod:`.model_flops`, Megatron-LM's ``num_floating_point_operations``, what ``--log-throughput``
reports), per transformer layer, ``T = s * b`` tokens::

    QKV      2 T h (q + 2 g d)        q = a d (query width), g d = key/value width (GQA)
    proj     2 T q h
    MLP      2 T h f (2 with SwiGLU, 1 otherwise) + 2 T f h
    scores   2 T s q   (Q K^T)        context  2 T s q   (P V)
    logits   2 T h V   (output layer, last stage)

with one difference, on purpose: the two attention products are counted over all ``s``
positions, because the attention kernels compute the masked half too (the mask is applied to the
full product), where the model FLOPs count them at half (:data:`.model_flops.CAUSAL_FRACTION`).
``tests/planning/test_model_flops.py`` checks that a layer's ``F + B + W`` here is exactly the model FLOPs
plus that half.

Megatron counts backward as twice the forward. The split into ``B`` (input gradients) and ``W``
(weight gradients) is: a linear layer ``Y = X W^T`` needs ``dX = dY W`` in ``B`` and
``dW = dY^T X`` in ``W``, each as many FLOPs as the forward; attention's score and context
products have no weights, so both of their backward products (four, as many FLOPs as two
forwards) are in ``B``. For the zero-bubble paper's GPT (MHA, ``f = 4h``) this gives its Table 1:
``F = sbh(24h + 4s)``, ``B = sbh(24h + 8s)``, ``W = 24sbh^2`` FLOPs per layer.

Time of one kernel is its roofline, ``max(FLOPs / (peak * mfu), bytes / (HBM * hbm_efficiency))``,
summed over the kernels of a pass, plus the tensor-parallel collectives (ring all-reduce of the
``T x h`` activation, two per layer in ``F`` and two in ``B``; reduce-scatter + all-gather with
sequence parallelism, the same bytes). Matrix products are usually compute bound; attention's
``s x s`` products (unfused attention) and all element-wise kernels are memory bound. The bytes of
the element-wise kernels are counted from Megatron's local GPT layer (fused bias-GeLU/SwiGLU,
fused bias-dropout-add, fused scale-mask-softmax, dropout keeping a 1-byte mask), the loss from
megatron-core's ``VocabParallelCrossEntropy`` (fp32: 38 bytes per logit forward, 14 backward with 16-bit
logits; 32 and 8 for an fp32 model, which has no casts). Element sizes follow the model's precision
(:attr:`~.model.PlanModel.element_bytes`: 2 for bf16/fp16, 4 for fp32).
Not modelled: kernel launch gaps, overlap of communication with computation, the embedding
gradient all-reduce of tied embeddings and the optimizer (counted per iteration by the planner).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..schedules.ir import Op
from .hardware import Hardware
from .layout import StageShape
from .model import PlanLayout, PlanModel

CE_FORWARD_BYTES = 32  # per logit: max 4, subtract 8, exp 8, sum 4, divide 8 (+ .float() e+4 if 16-bit)
CE_BACKWARD_BYTES = 8  # per logit: scale 8 (+ cast back to 16 bit 4+e if 16-bit)
FP32_ACCUMULATE = 8  # bytes per weight-gradient element: read + write of the fp32 main_grad


@dataclass
class PassCost:
    """One pass (``F``, ``B`` or ``W``) of some part of the model on one GPU.

    Attributes:
        flops: matrix-multiplication FLOPs.
        hbm_bytes: bytes moved to and from device memory by all its kernels.
        tp_bytes: bytes one GPU sends in tensor-parallel collectives.
        time_ms: predicted time, ms.
    """

    flops: float = 0.0
    hbm_bytes: float = 0.0
    tp_bytes: float = 0.0
    time_ms: float = 0.0

    def __add__(self, other: "PassCost") -> "PassCost":
        return PassCost(self.flops + other.flops, self.hbm_bytes + other.hbm_bytes,
                        self.tp_bytes + other.tp_bytes, self.time_ms + other.time_ms)

    def scaled(self, k: float) -> "PassCost":
        return PassCost(self.flops * k, self.hbm_bytes * k, self.tp_bytes * k, self.time_ms * k)


@dataclass
class _Kernels:
    """Accumulates kernels into a :class:`PassCost` under one :class:`Hardware`."""

    hw: Hardware
    cost: PassCost = field(default_factory=PassCost)
    e: int = 2  # bytes per activation / parameter element

    def mm(self, flops: float, nbytes: float) -> None:
        """A matrix product (or fused attention): roofline of its FLOPs and bytes."""
        self.cost.flops += flops
        self.cost.hbm_bytes += nbytes
        self.cost.time_ms += max(flops / self.hw.flops_per_ms, nbytes / self.hw.hbm_bytes_per_ms)

    def gemm(self, m: float, k: float, n: float, *, out_bytes: float | None = None) -> None:
        """``(m x k) @ (k x n)`` with ``e``-byte operands; ``out_bytes`` per output element (default ``e``)."""
        out = self.e if out_bytes is None else out_bytes
        self.mm(2.0 * m * k * n, self.e * (m * k + k * n) + out * m * n)

    def ew(self, nbytes: float) -> None:
        """A memory-bound (element-wise or reduction) kernel moving ``nbytes``."""
        self.cost.hbm_bytes += nbytes
        self.cost.time_ms += nbytes / self.hw.hbm_bytes_per_ms

    def tp(self, nbytes: float, *, ring_factor: float) -> None:
        """A TP collective on ``nbytes``: each GPU sends ``ring_factor * nbytes``."""
        sent = ring_factor * nbytes
        self.cost.tp_bytes += sent
        self.cost.time_ms += sent / self.hw.tp_bytes_per_ms


@dataclass(frozen=True)
class _Dims:
    """Per-GPU sizes of one microbatch (elements)."""

    T: float  # tokens s*b
    h: float
    q: float  # query width per GPU, a*d/t
    kv: float  # key (or value) width per GPU, g*d/t
    f: float  # MLP width per GPU (one projection), f/t
    gl: int  # 2 with SwiGLU
    S: float  # attention scores per GPU, s*s*b*a/t
    s: float
    r: int  # sharding of the T x h element-wise work: t with sequence parallelism
    ar: float  # ring all-reduce factor 2(t-1)/t (0 without TP)
    e: int  # bytes per element (precision)

    @staticmethod
    def of(model: PlanModel, par: PlanLayout) -> "_Dims":
        t, T = par.tp, float(model.seq_length * model.micro_batch_size)
        return _Dims(T=T, h=float(model.hidden_size), q=model.query_size / t, kv=model.kv_size / t,
                     f=model.ffn_hidden_size / t, gl=2 if model.swiglu else 1,
                     S=T * model.seq_length * model.num_attention_heads / t, s=float(model.seq_length),
                     r=t if par.sequence_parallel else 1, ar=2.0 * (t - 1) / t, e=model.element_bytes)


def _layer_forward(k: _Kernels, m: PlanModel, d: _Dims) -> None:
    e, A = d.e, d.T * d.h / d.r
    drop = 1 if m.hidden_dropout > 0 else 0
    k.ew(2 * e * A)  # input norm
    k.gemm(d.T, d.h, d.q + 2 * d.kv)
    if m.add_bias_linear:
        k.ew(2 * e * d.T * (d.q + 2 * d.kv))
    if m.position_embedding_type == "rope":
        k.ew(2 * e * d.T * (d.q + d.kv))
    if m.use_flash_attn:
        k.mm(4 * d.T * d.s * d.q, e * d.T * (2 * d.q + 2 * d.kv))
    else:
        if d.kv < d.q:  # GQA: keys and values repeated to every head before the products
            k.ew(2 * 2 * e * d.T * d.q)
        k.mm(2 * d.T * d.s * d.q, e * (2 * d.T * d.q + d.S))  # Q K^T
        k.ew(2 * e * d.S)  # scale-mask-softmax
        if m.attention_dropout > 0:
            k.ew((2 * e + 1) * d.S)
        k.mm(2 * d.T * d.s * d.q, e * (d.S + 2 * d.T * d.q))  # P V
        k.ew(2 * e * d.T * d.q)  # context back to [s, b, h] (contiguous copy)
    k.gemm(d.T, d.q, d.h)
    k.ew((3 * e + drop) * A)  # bias-dropout-add
    k.tp(e * d.T * d.h, ring_factor=d.ar)
    k.ew(2 * e * A)  # pre-MLP norm
    k.gemm(d.T, d.h, d.f * d.gl)
    k.ew((d.gl + 1) * e * d.T * d.f)  # bias + GeLU (read f, write f) / SwiGLU (read 2f, write f)
    k.gemm(d.T, d.f, d.h)
    k.ew((3 * e + drop) * A)
    k.tp(e * d.T * d.h, ring_factor=d.ar)


def _layer_backward_b(k: _Kernels, m: PlanModel, d: _Dims) -> None:
    e, A = d.e, d.T * d.h / d.r
    drop = 1 if m.hidden_dropout > 0 else 0
    bias = 1 if m.add_bias_linear else 0
    k.ew((2 * e + drop) * A + bias * e * d.T * d.h)  # dropout backward, output bias gradient
    k.gemm(d.T, d.h, d.f)
    k.ew((2 * d.gl + 1) * e * d.T * d.f + bias * e * d.T * d.f * d.gl)  # activation backward, bias grad
    k.gemm(d.T, d.f * d.gl, d.h)
    k.tp(e * d.T * d.h, ring_factor=d.ar)
    k.ew(6 * e * A)  # norm backward + residual gradient
    k.ew((2 * e + drop) * A + bias * e * d.T * d.h)
    k.gemm(d.T, d.h, d.q)
    if m.use_flash_attn:
        k.mm(10 * d.T * d.s * d.q, e * d.T * (3 * d.q + 4 * d.kv))  # 4 products + recomputed Q K^T
    else:
        k.ew(2 * e * d.T * d.q)  # context copy backward
        k.mm(2 * d.T * d.s * d.q, e * (d.S + 2 * d.T * d.q))  # dP = dO V^T
        k.mm(2 * d.T * d.s * d.q, e * (d.S + 2 * d.T * d.q))  # dV = P^T dO
        if m.attention_dropout > 0:
            k.ew((2 * e + 1) * d.S)
        k.ew(3 * e * d.S)  # softmax backward
        k.mm(2 * d.T * d.s * d.q, e * (d.S + 2 * d.T * d.q))  # dQ = dS K
        k.mm(2 * d.T * d.s * d.q, e * (d.S + 2 * d.T * d.q))  # dK = dS^T Q
        if d.kv < d.q:
            k.ew(2 * 2 * e * d.T * d.q)  # sum the repeated key/value gradients
    if m.position_embedding_type == "rope":
        k.ew(2 * e * d.T * (d.q + d.kv))
    k.ew(bias * e * d.T * (d.q + 2 * d.kv))
    k.gemm(d.T, d.q + 2 * d.kv, d.h)
    k.tp(e * d.T * d.h, ring_factor=d.ar)
    k.ew(6 * e * A)


def _layer_backward_w(k: _Kernels, m: PlanModel, d: _Dims) -> None:
    for n_in, n_out in ((d.h, d.q + 2 * d.kv), (d.q, d.h), (d.h, d.f * d.gl), (d.f, d.h)):
        k.mm(2 * d.T * n_in * n_out, d.e * d.T * (n_in + n_out) + FP32_ACCUMULATE * n_in * n_out)
    if d.r > 1:  # sequence parallel: the inputs of QKV and FC1 are all-gathered again
        k.tp(2 * d.e * d.T * d.h, ring_factor=d.ar / 2)


def _embedding(k: _Kernels, op: Op, m: PlanModel, d: _Dims, vocab_parallel: bool = False) -> None:
    """The first stage's embedding; ``vocab_parallel``: the word embedding's gather and gradient are
    the passes ``IF``/``IB`` (:mod:`.vocab`), the stage keeps the position embedding and dropout."""
    e, A = d.e, d.T * d.h / d.r
    drop = 1 if m.hidden_dropout > 0 else 0
    learned = m.position_embedding_type == "learned_absolute"
    if op is Op.F:
        if not vocab_parallel:
            k.ew(2 * e * d.T * d.h)  # row gather (vocab-parallel: every TP rank writes the full output)
            k.tp(e * d.T * d.h, ring_factor=d.ar / (2 if d.r > 1 else 1))
        k.ew((3 * e if learned else 0) * A + (2 * e + drop) * A)  # + position, dropout
    elif op is Op.B:
        k.ew((2 * e + drop) * A)
    else:  # scatter-add into the fp32 gradient of the table (and sum of the position gradient)
        k.ew((0 if vocab_parallel else e * d.T * d.h + FP32_ACCUMULATE * d.T * d.h) + (e * A if learned else 0))


def _loss(k: _Kernels, op: Op, m: PlanModel, d: _Dims, vocab_per_gpu: float, vocab_parallel: bool = False) -> None:
    """The last stage's final norm, output layer and cross entropy; ``vocab_parallel``: the output layer
    and the cross entropy are the passes ``S``/``T`` (:mod:`.vocab`), the stage keeps the final norm."""
    e, A, N = d.e, d.T * d.h / d.r, d.T * vocab_per_gpu
    cast = e + 4 if e < 4 else 0  # 16-bit logits: .float() in F, the cast back in B
    if vocab_parallel:
        if op is Op.F:
            k.ew(2 * e * A)  # final norm
        elif op is Op.B:
            k.ew(6 * e * A)  # its backward
        return
    if op is Op.F:
        k.ew(2 * e * A)  # final norm
        k.tp(e * d.T * d.h, ring_factor=d.ar / 2 if d.r > 1 else 0)  # SP all-gather
        k.gemm(d.T, d.h, vocab_per_gpu)
        k.ew((CE_FORWARD_BYTES + cast) * N)
    elif op is Op.B:
        k.ew((CE_BACKWARD_BYTES + cast) * N)
        k.gemm(d.T, vocab_per_gpu, d.h)
        k.tp(e * d.T * d.h, ring_factor=d.ar / (2 if d.r > 1 else 1))
        k.ew(6 * e * A)
    else:
        k.mm(2 * d.T * d.h * vocab_per_gpu, e * (d.T * d.h + N) + FP32_ACCUMULATE * d.h * vocab_per_gpu)


@dataclass(frozen=True)
class StageCost:
    """Predicted costs of one microbatch through one pipeline stage (one GPU of its TP group).

    Attributes:
        shape: what the stage holds.
        f, b, w: the three passes (:class:`PassCost`, times in ms).
    """

    shape: StageShape
    f: PassCost
    b: PassCost
    w: PassCost


def layer_cost(model: PlanModel, par: PlanLayout, hw: Hardware) -> dict[Op, PassCost]:
    """``F``, ``B`` and ``W`` of one transformer layer on one GPU."""
    d = _Dims.of(model, par)
    out = {}
    for op, fn in ((Op.F, _layer_forward), (Op.B, _layer_backward_b), (Op.W, _layer_backward_w)):
        k = _Kernels(hw, e=d.e)
        fn(k, model, d)
        out[op] = k.cost
    return out


def stage_costs(model: PlanModel, par: PlanLayout, hw: Hardware,
                shapes: list[StageShape], *, vocab_parallel: bool = False) -> list[StageCost]:
    """:class:`StageCost` of every stage in ``shapes``; ``vocab_parallel``: without the word embedding's
    gather and gradient and the output layer with its loss (their passes are :mod:`.vocab`'s)."""
    d = _Dims.of(model, par)
    layer = layer_cost(model, par, hw)
    vocab = model.padded_vocab_size(par.tp) / par.tp
    out = []
    for sh in shapes:
        passes = {}
        for op in (Op.F, Op.B, Op.W):
            k = _Kernels(hw, layer[op].scaled(sh.num_layers), d.e)
            if sh.embedding:
                _embedding(k, op, model, d, vocab_parallel)
            if sh.loss:
                _loss(k, op, model, d, vocab, vocab_parallel)
            passes[op] = k.cost
        out.append(StageCost(sh, passes[Op.F], passes[Op.B], passes[Op.W]))
    return out


def p2p_time_ms(model: PlanModel, par: PlanLayout, hw: Hardware) -> float:
    """``T_comm``: one activation (or its gradient) between two stages, latency + bytes / bandwidth.

    Each GPU of a TP group sends its own copy of the ``s x b x h`` activation (a ``1/t`` shard with
    sequence parallelism).
    """
    nbytes = model.element_bytes * model.seq_length * model.micro_batch_size * model.hidden_size
    if par.sequence_parallel:
        nbytes /= par.tp
    return hw.p2p_latency_ms + nbytes / hw.p2p_bytes_per_ms

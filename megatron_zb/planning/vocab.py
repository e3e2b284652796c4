"""Costs of the vocabulary-parallel passes for ``megatron-zb plan --enable-vocab-parallel`` (issue 24).

With vocabulary parallelism (Yeung et al., MLSys 2025; docs/vocab_parallel.md) the input embedding
and the output layer with its cross entropy are split over the ``p`` ranks of the model-parallel group
(``TP x PP``; the pipeline ranks when ``TP = 1``): each rank holds ``V_i = V_pad / p`` rows, rounded up (``V_pad``: the vocabulary padded to a multiple of
``--make-vocab-size-divisible-by x TP``, as Megatron-LM and ``pretrain_gpt_zb.py --enable-vocab-parallel`` pad
it) and runs its slice's passes ``IF``, ``S``, ``T``, ``IB`` for every microbatch. Their kernels are
counted as :mod:`.flops` counts the output layer and the embedding of the last / first stage without
vocabulary parallelism (the same :class:`~.flops._Kernels` roofline, the same cross-entropy bytes per
logit), so both sides of a plan are counted the same way. Per microbatch, ``T = s b`` tokens,
``e`` bytes per element:

=======  ===================================================================================
``IF``   masked row gather of the slice: ``2 e T h`` bytes (read the rows, write the output)
``S``    logits GEMM ``2 T h V_i`` FLOPs (fp32 output) + the cross entropy's forward bytes per
         logit; Vocab-2 also ``softmax_i W_i``: ``2 T V_i h`` FLOPs (the input gradient's part)
``T``    the cross entropy's backward bytes per logit; Vocab-1 the input-gradient GEMM
         ``2 T V_i h`` FLOPs; the weight-gradient GEMM ``2 T h V_i`` FLOPs + the fp32 gradient's
         read-modify-write (the timing kernel runs it inside ``T``)
``IB``   scatter-add of the broadcast gradient into the slice: read ``e T h``, accumulate the
         slice's share ``8 T h / p`` of the rows in fp32
=======  ===================================================================================

**Why the output layer is about ``V / (12h + 2s)`` transformer layers.** Per microbatch the output
layer costs ``2 T h V`` FLOPs forward and as much in each of the input- and weight-gradient halves of
its backward: ``6 T h V`` FLOPs. A transformer layer of the zero-bubble paper's GPT (MHA, ``f = 4h``)
costs ``F = T h (24 h + 4 s)``, ``B = T h (24 h + 8 s)``, ``W = 24 T h^2`` FLOPs (:mod:`.flops`):
``T h (72 h + 12 s)`` in all. The ratio is ``6 V / (72 h + 12 s) = V / (12 h + 2 s)`` layers
(:func:`output_layer_in_layers`; vocabulary 65,536, ``h = s = 256``: 18.3 layers).

**Collectives.** Each one runs over the model-parallel group beside compute (the timing kernel's barrier,
:class:`~megatron_zb.schedules.costs.VocabCosts`, one ``t_collective`` for all of them). The largest
is an ``s x b x h`` tensor (``e T h`` bytes): the embedding's all-reduce after ``IF``, the broadcast of
the last stage's output before ``S``, the input gradient's all-reduce (``C1``, or ``C0`` with Vocab-2),
the broadcast of the embedding's gradient before ``IB``; the rest (row maxima and sums, ``4 T`` to
``8 T`` bytes) are smaller. ``t_collective`` is a ring all-reduce of ``e T h`` bytes -- each rank sends
``2 (p - 1) / p`` of them -- at the planner's ``--p2p-gbps`` plus ``--p2p-latency-ms``: the largest
collective's time, an upper bound for the small ones.

**Memory.** ``mem_s`` (bytes a rank allocates in ``S`` and frees in ``T``): the broadcast input
``e T h`` and the fp32 softmax of the slice ``4 T V_i``. Parameters: every rank holds ``V_i h`` (tied
embeddings: one slice serving both layers) or ``2 V_i h`` (untied); the first stage keeps the position
embedding, the last the final norm (:func:`~.memory.stage_parameters` with ``vocab_parallel=True``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..schedules.costs import VocabCosts
from .flops import CE_BACKWARD_BYTES, CE_FORWARD_BYTES, FP32_ACCUMULATE, PassCost, _Kernels
from .hardware import Hardware
from .model import PlanLayout, PlanModel

__all__ = ["VocabPassCosts", "base_family", "output_layer_in_layers", "vocab_pass_costs", "vocab_padded_size",
           "vocab_variant"]

FP32 = 4
_VOCAB_NAME = re.compile(r"^(?P<base>.+)-vocab-(?P<variant>[12])$")


def base_family(name: str) -> str | None:
    """The schedule family without vocabulary parallelism: ``zb-h1-vocab-1`` -> ``zb-h1``
    (``zbv-vocab-2`` -> ``zbv``); ``None`` for a name that is not ``BASE-vocab-1|2``."""
    m = _VOCAB_NAME.match(name)
    return m.group("base") if m else None


def vocab_variant(name: str) -> int:
    """The paper's variant of a ``BASE-vocab-N`` name: 1 (two barriers) or 2 (one barrier)."""
    m = _VOCAB_NAME.match(name)
    if m is None:
        raise ValueError(f"{name!r} is not a vocabulary-parallel schedule name (BASE-vocab-1 or BASE-vocab-2)")
    return int(m.group("variant"))


def output_layer_in_layers(*, vocab_size: int, hidden_size: int, seq_length: int) -> float:
    """The output layer's ``F + B + W`` FLOPs in transformer layers of the paper's GPT:
    ``V / (12 h + 2 s)`` (module doc; dimensionless)."""
    return vocab_size / (12.0 * hidden_size + 2.0 * seq_length)


def vocab_padded_size(model: PlanModel, par: PlanLayout) -> int:
    """``V_pad``: the vocabulary padded as Megatron-LM pads it, with or without ``--enable-vocab-parallel``
    (:func:`.model.padded_vocab_size`)."""
    return model.padded_vocab_size(par.tp)


@dataclass(frozen=True)
class VocabPassCosts:
    """One rank's slice of the vocabulary passes, one microbatch (module doc).

    Attributes:
        padded_vocab: ``V_pad``, rows over all ranks.
        rows: ``V_i = ceil(V_pad / (TP x PP))``, rows of the largest slice.
        if_, s, t, ib: the passes (:class:`~.flops.PassCost`; ``time_ms`` in ms, ``flops``, bytes).
        t_weight: the part of ``t`` that is the weight-gradient GEMM (included in ``t``).
        collective_bytes: bytes of the largest collective (``e T h``).
        t_collective_ms: one collective over the model-parallel group, ms.
        mem_s: bytes held from ``S`` to ``T``.
        params: parameters of the slices on every rank (elements).
    """

    padded_vocab: int
    rows: int
    if_: PassCost
    s: PassCost
    t: PassCost
    t_weight: PassCost
    ib: PassCost
    collective_bytes: float
    t_collective_ms: float
    mem_s: float
    params: float

    def costs(self) -> VocabCosts:
        """The simulator's :class:`~megatron_zb.schedules.costs.VocabCosts` (ms, bytes), every rank alike."""
        return VocabCosts(t_if=self.if_.time_ms, t_s=self.s.time_ms, t_t=self.t.time_ms, t_ib=self.ib.time_ms,
                          t_collective=self.t_collective_ms, mem_s=self.mem_s)


def vocab_pass_costs(model: PlanModel, par: PlanLayout, hw: Hardware, *, variant: int) -> VocabPassCosts:
    """Costs of one rank's ``IF``, ``S``, ``T``, ``IB`` (module doc) for the paper's ``variant`` (1 or 2):
    the slices over the model-parallel group, ``TP x PP`` ranks (``pretrain_gpt_zb.py`` builds them so;
    with ``TP = 1`` the pipeline ranks), each collective over that group."""
    e, h = model.element_bytes, float(model.hidden_size)
    p = par.pp * par.tp  # slices: pp_rank x TP + tp_rank
    T = float(model.seq_length * model.micro_batch_size)
    v_pad = vocab_padded_size(model, par)
    rows = -(-v_pad // p)  # the largest slice (VocabSlice: the first V_pad mod p slices hold one row more)
    n = T * rows  # logits of the slice
    cast = e + 4 if e < 4 else 0
    passes = {}
    for name in ("if", "s", "t", "tw", "ib"):
        k = _Kernels(hw, e=e)
        if name == "if":
            k.ew(2 * e * T * h)
        elif name == "s":
            k.gemm(T, h, rows, out_bytes=FP32)
            k.ew((CE_FORWARD_BYTES + cast) * n)
            if variant == 2:
                k.gemm(T, rows, h)
        elif name == "t":
            k.ew((CE_BACKWARD_BYTES + cast) * n)
            if variant == 1:
                k.gemm(T, rows, h)
        elif name == "tw":
            k.mm(2 * T * h * rows, e * (T * h + n) + FP32_ACCUMULATE * h * rows)
        else:
            k.ew(e * T * h + FP32_ACCUMULATE * T * h / p)
        passes[name] = k.cost
    nbytes = e * T * h
    t_coll = hw.p2p_latency_ms + 2.0 * (p - 1) / p * nbytes / hw.p2p_bytes_per_ms
    tied = not model.untie_embeddings_and_output_weights
    return VocabPassCosts(padded_vocab=v_pad, rows=rows, if_=passes["if"], s=passes["s"],
                          t=passes["t"] + passes["tw"], t_weight=passes["tw"], ib=passes["ib"],
                          collective_bytes=nbytes, t_collective_ms=t_coll, mem_s=e * T * h + FP32 * n,
                          params=rows * h * (1 if tied else 2))

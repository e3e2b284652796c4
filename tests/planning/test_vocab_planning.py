"""``megatron-zb plan --enable-vocab-parallel`` (megatron_zb/planning/vocab.py and the planner).

Every expected number is written out here by hand from the model's sizes (FLOPs, bytes,
parameters), never taken from the code under test. Pure Python, no process group.

The model: 2 layers, hidden 64, 4 heads, seq 32, micro batch 1, vocabulary 1000 (padded to 1024:
a multiple of 128 with and without vocabulary parallelism; slices of 512 rows at
PP=2), fp32. The hardware: 1e6 FLOP/ms (0.001 TFLOP/s, mfu 1), 1e9 bytes/ms (1000 GB/s, efficiency
1), so every GEMM here is compute bound and every element-wise kernel takes bytes / 1e9 ms.
"""

from __future__ import annotations

import pytest

from megatron_zb.cli import main
from megatron_zb.planning.flops import stage_costs
from megatron_zb.planning.hardware import resolve_hardware
from megatron_zb.planning.layout import stage_shapes
from megatron_zb.planning.memory import GIB
from megatron_zb.planning.model import make_model, make_parallel
from megatron_zb.planning.planner import plan
from megatron_zb.planning.vocab import base_family, output_layer_in_layers, vocab_pass_costs

T, H, V_PAD, ROWS = 32, 64, 1024, 512
FLOP_PER_MS, BYTES_PER_MS = 1e6, 1e9
HW = resolve_hardware(tflops=0.001, memory_gib=16, hbm_gbs=1000, tp_gbs=1, p2p_gbps=8, p2p_latency_ms=0.5,
                      mfu=1.0, hbm_efficiency=1.0)
"""p2p: 8 Gbit/s = 1e6 bytes/ms, + 0.5 ms latency."""


def small(untied: bool = True, m: int = 4):
    model = make_model(num_layers=2, hidden_size=H, num_attention_heads=4, seq_length=T, micro_batch_size=1,
                       vocab_size=1000, precision="fp32", untie_embeddings_and_output_weights=untied)
    return model, make_parallel(model, pp=2, num_microbatches=m)


def test_output_layer_is_v_over_12h_plus_2s_layers():
    """The docstring's ratio, and the planner's own FLOPs: the loss stage's output layer (F + B + W
    minus the final norm's, which has no GEMM) over one layer's, for the paper's GPT (f = 4h)."""
    assert output_layer_in_layers(vocab_size=65536, hidden_size=256, seq_length=256) == pytest.approx(
        65536 / 3584)  # 12 * 256 + 2 * 256 = 3584: 18.29 layers
    model, par = small()
    costs = stage_costs(model, par, HW, stage_shapes(num_layers=2, pp=2, placement="plain"))
    mid = costs[0]  # 1 layer + embedding (no GEMM)
    out = costs[1]  # 1 layer + loss
    output_flops = sum(c.flops for c in (out.f, out.b, out.w)) - sum(c.flops for c in (mid.f, mid.b, mid.w))
    layer_flops = T * H * (72 * H + 12 * T)  # F + B + W of one layer, s = 32
    assert output_flops == 6 * T * H * V_PAD
    assert output_flops / layer_flops == pytest.approx(V_PAD / (12 * H + 2 * T))


def test_pass_costs_worked_by_hand():
    """One rank's slice (512 rows): FLOPs, times, the collective, mem_s and the slices' parameters."""
    model, par = small()
    n = T * ROWS  # 16384 logits of the slice
    v1 = vocab_pass_costs(model, par, HW, variant=1)
    v2 = vocab_pass_costs(model, par, HW, variant=2)
    assert (v1.padded_vocab, v1.rows) == (V_PAD, ROWS)
    gemm = 2 * T * H * ROWS  # 2,097,152 FLOPs, 2.097152 ms
    assert v1.s.flops == gemm and v2.s.flops == 2 * gemm
    assert v1.t.flops == 2 * gemm and v2.t.flops == gemm and v1.t_weight.flops == gemm
    # S: the GEMM (compute bound) + cross entropy forward 32 bytes per fp32 logit
    assert v1.s.time_ms == pytest.approx(gemm / FLOP_PER_MS + 32 * n / BYTES_PER_MS)
    # T (Vocab-1): backward 8 bytes per logit + input-gradient GEMM + weight-gradient GEMM
    assert v1.t.time_ms == pytest.approx(8 * n / BYTES_PER_MS + 2 * gemm / FLOP_PER_MS)
    assert v2.s.time_ms == pytest.approx(v1.s.time_ms + gemm / FLOP_PER_MS)
    # IF: read + write T x h fp32; IB: read the gradient, accumulate half the rows (p = 2) in fp32
    assert v1.if_.time_ms == pytest.approx(2 * 4 * T * H / BYTES_PER_MS)
    assert v1.ib.time_ms == pytest.approx((4 * T * H + 8 * T * H / 2) / BYTES_PER_MS)
    # the largest collective: ring all-reduce of 8192 bytes over 2 ranks sends 8192 of them
    assert v1.collective_bytes == 4 * T * H == 8192
    assert v1.t_collective_ms == pytest.approx(0.5 + 8192 / 1e6)
    assert v1.mem_s == 4 * T * H + 4 * n  # the broadcast input + the fp32 softmax slice
    assert v1.params == 2 * ROWS * H  # untied: two slices
    assert vocab_pass_costs(small(untied=False)[0], par, HW, variant=1).params == ROWS * H


def test_vocab_stage_drops_only_the_vocabulary_layers():
    """The loss stage without the output layer: its F differs from the whole stage's by the logits
    GEMM (2 T h V FLOPs at 1e6/ms) and the cross entropy's 32 bytes per logit (T V logits)."""
    model, par = small()
    shapes = stage_shapes(num_layers=2, pp=2, placement="plain")
    whole = stage_costs(model, par, HW, shapes)[1]
    vp = stage_costs(model, par, HW, shapes, vocab_parallel=True)[1]
    assert whole.f.time_ms - vp.f.time_ms == pytest.approx(2 * T * H * V_PAD / FLOP_PER_MS + 32 * T * V_PAD / 1e9)


@pytest.mark.parametrize("untied", [True, False])
def test_per_rank_parameters_with_and_without(untied):
    """Per-rank parameters x 16 bytes (fp32 Adam), worked by hand. One layer: QKV 64x192 + 192, proj
    64x64 + 64, FC1 64x256 + 256, FC2 256x64 + 64, two LayerNorms 2 x 128: 49,984. Without: rank 0
    adds the word embedding 1024 x 64 and the positions 32 x 64, rank 1 the final norm 128 and the
    output layer (or, tied, Megatron's copy) 1024 x 64. With: each rank one (tied) or two 512 x 64
    slices."""
    model, par = small(untied=untied)
    layer, word, pos, norm = 49_984, V_PAD * H, T * H, 2 * H
    without = [layer + word + pos, layer + norm + word]
    with_vp = [layer + pos, layer + norm]
    with_vp = [n + ROWS * H * (2 if untied else 1) for n in with_vp]
    res = plan(model=model, parallel=par, hardware=HW, schedules=["1f1b", "1f1b-vocab-1"], enable_vocab_parallel=True)
    got = {f.name: f for f in res.families}
    assert [x * GIB for x in got["1f1b"].param_optimizer_per_rank_gib] == pytest.approx([16 * n for n in without])
    assert [x * GIB for x in got["1f1b-vocab-1"].param_optimizer_per_rank_gib] == pytest.approx(
        [16 * n for n in with_vp])
    assert got["1f1b-vocab-1"].vocab_base == "1f1b" and got["1f1b"].vocab_base is None


def test_output_dominated_model_recommends_vocabulary_parallelism():
    """Hidden 64 and 1024 rows: the output layer is 1024 / (768 + 64) = 1.23 layers on the last of 2
    stages of 1 layer: splitting it over both ranks makes each vocabulary family faster than its base,
    and one of them is recommended; without the flag they are skipped naming it."""
    model, par = small(m=8)
    res = plan(model=model, parallel=par, hardware=HW, schedules=["1f1b", "zb-h1", "1f1b-vocab-1", "zb-h1-vocab-2"],
               enable_vocab_parallel=True)
    got = {f.name: f for f in res.families}
    assert got["1f1b-vocab-1"].iteration_time_ms < got["1f1b"].iteration_time_ms
    assert got["zb-h1-vocab-2"].iteration_time_ms < got["zb-h1"].iteration_time_ms
    assert base_family(res.recommended) is not None
    res = plan(model=model, parallel=par, hardware=HW, schedules=["1f1b", "1f1b-vocab-1"])
    skipped = {f.name: f for f in res.families}["1f1b-vocab-1"]
    assert skipped.status == "skipped" and "--enable-vocab-parallel" in skipped.reason


def test_cli_prints_the_pairs_and_plans_tensor_parallelism(capsys):
    flags = ["plan", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--micro-batch-size", "1", "--vocab-size", "1000", "--pipeline-model-parallel-size", "2",
             "--num-microbatches", "4", "--gpu-tflops", "0.001", "--gpu-memory-gib", "16", "--gpu-hbm-gbs", "1000",
             "--tp-gbs", "1", "--p2p-gbps", "8", "--schedules", "1f1b,1f1b-vocab-1", "--enable-vocab-parallel"]
    assert main(flags) == 0
    out = capsys.readouterr().out
    assert "vocabulary parallelism (each beside its family without it):" in out
    assert any(line.split()[:2] == ["1f1b-vocab-1", "1f1b"] for line in out.splitlines())
    assert main(flags + ["--tensor-model-parallel-size", "2"]) == 0
    assert any(line.split()[:2] == ["1f1b-vocab-1", "1f1b"] for line in capsys.readouterr().out.splitlines())


def test_pass_costs_with_tensor_parallelism_worked_by_hand():
    """TP=2 x PP=2: four slices over the model-parallel group (the vocabulary padded to 128 x 4 = 1024 as
    at TP=1 here): 256 rows per rank, half the TP=1 slice's FLOPs, parameters and softmax bytes; the
    collective a ring all-reduce over 4 ranks, 2 x 3/4 of the 8192 bytes."""
    model = small()[0]
    par = make_parallel(model, pp=2, tp=2, num_microbatches=4)
    v1 = vocab_pass_costs(model, par, HW, variant=1)
    rows = 256
    assert (v1.padded_vocab, v1.rows) == (V_PAD, rows)
    gemm = 2 * T * H * rows
    assert v1.s.flops == gemm and v1.t.flops == 2 * gemm
    assert v1.s.time_ms == pytest.approx(gemm / FLOP_PER_MS + 32 * T * rows / BYTES_PER_MS)
    assert v1.ib.time_ms == pytest.approx((4 * T * H + 8 * T * H / 4) / BYTES_PER_MS)
    assert v1.t_collective_ms == pytest.approx(0.5 + 2 * 3 / 4 * 8192 / 1e6)
    assert v1.mem_s == 4 * T * H + 4 * T * rows
    assert v1.params == 2 * rows * H  # untied


def test_the_searched_families_are_planned_beside_their_family():
    """zb-2p-vocab-1 and v-half-vocab-2 (schedules/generators/vocab_family.py) are planned and paired by name
    (4 layers: the V's 4 stages need one each)."""
    model = make_model(num_layers=4, hidden_size=H, num_attention_heads=4, seq_length=T, micro_batch_size=1,
                       vocab_size=1000, precision="fp32", untie_embeddings_and_output_weights=True)
    par = make_parallel(model, pp=2, num_microbatches=8)
    res = plan(model=model, parallel=par, hardware=HW, schedules=["zb-2p", "zb-2p-vocab-1", "v-half", "v-half-vocab-2"],
               enable_vocab_parallel=True)
    got = {f.name: f for f in res.families}
    for name, base in (("zb-2p-vocab-1", "zb-2p"), ("v-half-vocab-2", "v-half")):
        assert got[name].status == "ok" and got[base].status == "ok", (got[name].reason, got[base].reason)
        assert got[name].vocab_base == base


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 8])
def test_zb_vocab_is_planned_under_the_free_memory_limit_as_zb(n):
    """``zb-vocab-1|2`` (the greedy ``zb`` with the passes) get ``zb``'s rule: the largest ``N`` microbatches
    of ``M_B`` that fit next to the parameters, its whole activation peak capped at ``N x M_B``.

    By hand, no dropout, fp32 (4 bytes), T = s = 32, h = 64, 4 heads, f = 256: one layer's ``M_B`` = 4 x (2A
    (norm, QKV input) + 3Tq (Q, K, V) + S (softmax) + Tq (projection input) + 2A (MLP norm, FC1 input)
    + 2Tf (activation, FC2 input)) with A = Th = 2048, q = 64, S = s^2 a = 4096: 4 x 36,864 = 147,456
    bytes (the paper's 34sbh + 5as^2b without dropout, 64sbh + 4as^2b in fp32); the last stage adds the
    final norm's input 4A: M_B = 155,648. Parameters (untied): rank 0 49,984 + the positions 2,048 + two
    512 x 64 slices 65,536 = 117,568, x 16 bytes = 1,881,088 (the largest rank). The GPU's usable memory
    (0.9 of it) = those bytes + (n + 1/2) M_B, so N = n. (The greedy order fills its limit: with a slice's
    ``S`` in flight beside it only a lower order fits, schedules/generators/vocab_family.py.)"""
    model = make_model(num_layers=2, hidden_size=H, num_attention_heads=4, seq_length=T, micro_batch_size=1,
                       vocab_size=1000, precision="fp32", untie_embeddings_and_output_weights=True,
                       hidden_dropout=0.0, attention_dropout=0.0)
    par = make_parallel(model, pp=2, num_microbatches=8)
    m_b, params = 155_648, 117_568 * 16
    hw = resolve_hardware(tflops=0.001, memory_gib=(params + (n + 0.5) * m_b) / 0.9 / GIB, hbm_gbs=1000, tp_gbs=1,
                          p2p_gbps=8, p2p_latency_ms=0.5, mfu=1.0, hbm_efficiency=1.0)
    res = plan(model=model, parallel=par, hardware=hw, schedules=["zb-vocab-1", "zb-vocab-2"],
               enable_vocab_parallel=True)
    assert [f.name for f in res.families] == ["zb-vocab-1", "zb-vocab-2"]
    for fam in res.families:
        assert fam.status == "ok", (fam.name, fam.reason)
        assert fam.memory_limit_n == n
        assert fam.peak_activation_gib * GIB <= n * m_b * (1 + 1e-9)
        assert fam.param_optimizer_gib * GIB == pytest.approx(params)
        assert fam.fits


def test_zb_vocab_takes_the_default_limit_when_it_fits_and_is_faster():
    """``N x M_B`` rounds the greedy's peak down to whole microbatches. docs/planning.md's model (PP=8, 24
    microbatches, A100) with the passes: the greedy's default limit peaks at 34.7 GiB with the parameters
    (printed by `plan`), so with 38.4 GiB (34.56 usable: 9 of the 3.45-GiB stages' M_B beside 3.4 GiB of
    parameters, not the default's peak) the plan is N = 9, and with 40 GiB (36 usable) the default's
    plan fits and is faster than N = 9's: planned without an N. With 80 GiB N = 19 is faster again."""
    model = make_model(num_layers=22, hidden_size=2304, num_attention_heads=24, seq_length=1024, micro_batch_size=6,
                       vocab_size=32000, precision="fp16")
    par = make_parallel(model, pp=8, num_microbatches=24, allow_padding_num_layers=True)
    got = {gib: plan(model=model, parallel=par, hardware=resolve_hardware(gpu="A100", memory_gib=gib),
                     schedules=["zb-vocab-1"], enable_vocab_parallel=True).families[0] for gib in (38.4, 40, 80)}
    assert all(f.status == "ok" and f.fits for f in got.values()), [(f.status, f.reason) for f in got.values()]
    assert (got[38.4].memory_limit_n, got[40].memory_limit_n, got[80].memory_limit_n) == (9, None, 19)
    assert got[40].peak_memory_gib <= 0.9 * 40  # fits the usable 36 GiB
    assert got[40].peak_memory_gib > 0.9 * 38.4  # ... which 38.4 GiB's usable memory could not hold
    assert got[40].makespan_ms < got[38.4].makespan_ms and got[80].makespan_ms < got[40].makespan_ms

"""``megatron-zb plan --data-parallel-sharding-strategy optim_grads``: the model state per rank, the table of W
group sizes and the recommended ``k`` (megatron_zb/planning/sharded.py, issue 42).

Expected values are worked out by hand here from the element counts of a small GPT (written out below), never
taken from the code under test. Pure Python (no process group).
"""

from __future__ import annotations

import json

import pytest

from megatron_zb.cli import main
from megatron_zb.planning.hardware import resolve_hardware
from megatron_zb.planning.model import PlanError, make_model, make_parallel
from megatron_zb.planning.planner import plan
from megatron_zb.planning.sharded import GroupRow, choose_group, group_candidates

# The small GPT: 4 layers, h 64, 4 heads, seq 32, vocab 1000 (padded to 1024), no biases, LayerNorm, untied.
H, LAYERS, SEQ, VOCAB_PADDED = 64, 4, 32, 1024
LAYER_W = 64 * 192 + 64 * 64 + 64 * 256 + 256 * 64   # QKV, projection, FC1, FC2 weights: 49152
LAYER_NORMS = 2 * 2 * H                                # two LayerNorms (weight and bias): 256
WORD, POS = VOCAB_PADDED * H, SEQ * H                  # 65536, 2048
BUCKET = 4096


def small(**par_kw):
    model = make_model(num_layers=LAYERS, hidden_size=H, num_attention_heads=4, seq_length=SEQ, micro_batch_size=1,
                       vocab_size=1000, precision="bf16", add_bias_linear=False,
                       untie_embeddings_and_output_weights=True, transformer_impl="local")
    kw = dict(pp=2, dp=2, num_microbatches=8, use_distributed_optimizer=True,
              data_parallel_sharding_strategy="optim_grads", ddp_bucket_size=BUCKET)
    kw.update(par_kw)
    return model, make_parallel(model, **kw)


HW = resolve_hardware(gpu="H100", dp_gbps=100.0)


def test_model_state_per_rank_hand_worked():
    # stage 0: 2 layers + word and position embeddings; stage 1: 2 layers + final norm + output layer
    params0 = 2 * (LAYER_W + LAYER_NORMS) + WORD + POS
    params1 = 2 * (LAYER_W + LAYER_NORMS) + 2 * H + WORD
    # residual (B adds the gradient): norms, embeddings; work buffers: 2 x (bucket + largest deferred weight)
    residual0, residual1 = 2 * LAYER_NORMS + WORD + POS, 2 * LAYER_NORMS + 2 * H
    work0, work1 = BUCKET + 64 * 256, BUCKET + WORD
    sharded = [params0 * (2 + 16 / 2) + 4 * (2 * work0 + residual0),
               params1 * (2 + 16 / 2) + 4 * (2 * work1 + residual1)]
    dist_opt = [params0 * (6 + 12 / 2), params1 * (6 + 12 / 2)]
    model, par = small()
    fam = plan(model=model, parallel=par, hardware=HW, schedules=["zb-h1"]).families[0]
    gib = 2.0 ** 30
    assert [b * gib for b in fam.param_optimizer_per_rank_gib] == pytest.approx(sharded, rel=1e-12)
    base = fam.wgrad_groups[0]
    assert base.k is None and base.model_state_bytes == pytest.approx(dist_opt, rel=1e-12)
    assert all(row.model_state_bytes == pytest.approx(sharded, rel=1e-12) for row in fam.wgrad_groups[1:])


def test_rows_count_reduces_and_hold_more_activations_with_larger_groups():
    model, par = small()
    fam = plan(model=model, parallel=par, hardware=HW, schedules=["zb-h1"]).families[0]
    rows = fam.wgrad_groups
    assert [r.k for r in rows] == [None, 1, 2, 4, 8]
    assert [r.reduces_per_bucket for r in rows] == [1, 8, 4, 2, 1]
    acts = [max(r.activation_bytes) for r in rows[1:]]
    assert acts == sorted(acts) and acts[-1] > acts[0]  # a group holds its W inputs until it runs
    # the residual gradients' reduce-scatter after the last W: ring over d = 2 at 100 Gbit/s, one latency
    residual_bytes = 4 * max(2 * LAYER_NORMS + WORD + POS, 2 * LAYER_NORMS + 2 * H)
    residual_ms = HW.p2p_latency_ms + residual_bytes * (1 / 2) / (100e9 / 8 / 1e3)
    optimizer_ms = fam.optimizer_ms
    for r in rows[1:]:
        assert r.iteration_time_ms - r.result.makespan - optimizer_ms == pytest.approx(residual_ms, rel=1e-9)
    # the family's numbers are its recommended row's
    pick = next(r for r in rows if r.k == fam.wgrad_group)
    assert fam.iteration_time_ms == pytest.approx(pick.iteration_time_ms, rel=1e-12)


def _row(k, ms, fits=True):
    return GroupRow(k, 1, ms, 0.0, [0.0], [0.0], fits, None)


def test_choice_rule_smallest_group_within_tolerance_of_the_fastest_that_fits():
    rows = [_row(None, 100.0), _row(1, 200.0), _row(2, 104.0), _row(4, 101.0), _row(8, 99.0, fits=False)]
    assert choose_group(rows).k == 2           # fastest that fits: 101; 104 <= 101 x 1.05
    assert choose_group(rows, tolerance=0.01).k == 4
    assert choose_group([_row(None, 1.0), _row(1, 2.0, fits=False)]) is None


def test_candidates():
    assert group_candidates(8) == [1, 2, 4, 8]
    assert group_candidates(12) == [1, 2, 4, 12]
    assert group_candidates(1) == [1]


def test_families_that_cannot_shard_are_listed_with_the_reason():
    model, par = small()
    fams = {f.name: f for f in plan(model=model, parallel=par, hardware=HW, schedules=["1f1b", "zb-h1", "zbv"]).families}
    assert fams["1f1b"].status == "skipped" and "fuses its backward" in fams["1f1b"].reason
    assert fams["zb-h1"].status == fams["zbv"].status == "ok"
    tied = make_model(num_layers=LAYERS, hidden_size=H, num_attention_heads=4, seq_length=SEQ, micro_batch_size=1,
                      vocab_size=1000, precision="bf16")
    fams = {f.name: f for f in plan(model=tied, parallel=par, hardware=HW, schedules=["zb-h1", "zbv"]).families}
    assert "--untie-embeddings-and-output-weights" in fams["zb-h1"].reason
    assert fams["zbv"].status == "ok"


def test_a_given_group_is_the_only_candidate():
    model, par = small(wgrad_group=4)
    fam = plan(model=model, parallel=par, hardware=HW, schedules=["zb-h1"]).families[0]
    assert [r.k for r in fam.wgrad_groups] == [None, 4] and fam.wgrad_group == 4


@pytest.mark.parametrize("kw, flag", [
    (dict(use_distributed_optimizer=False), "--data-parallel-sharding-strategy"),
    (dict(wgrad_group=3), "--zero-bubble-wgrad-group"),
    (dict(data_parallel_sharding_strategy="optim", wgrad_group=2), "--zero-bubble-wgrad-group"),
    (dict(ddp_bucket_size=0), "--ddp-bucket-size"),
])
def test_bad_layouts_name_the_flag(kw, flag):
    with pytest.raises(PlanError) as e:
        small(**kw)
    assert e.value.flag == flag


FLAGS = ["plan", "--num-layers", LAYERS, "--hidden-size", H, "--num-attention-heads", 4, "--seq-length", SEQ,
         "--micro-batch-size", 1, "--vocab-size", 1000, "--bf16", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--transformer-impl", "local", "--pipeline-model-parallel-size", 2,
         "--data-parallel-size", 2, "--num-microbatches", 8, "--use-distributed-optimizer", "--gpu", "H100",
         "--dp-gbps", 100, "--ddp-bucket-size", BUCKET, "--schedules", "1f1b,zb-h1,zbv"]


def test_cli_table_recommendation_and_json(capsys, tmp_path):
    out_json = tmp_path / "plan.json"
    rc = main([str(a) for a in FLAGS + ["--data-parallel-sharding-strategy", "optim_grads", "--json", out_json]])
    out = capsys.readouterr().out
    assert rc == 0
    assert "sharded gradients (optim_grads)" in out and "distributed optimizer" in out
    doc = json.loads(out_json.read_text())
    best = next(s for s in doc["schedules"] if s["name"] == doc["recommended"])
    assert f"--zero-bubble-wgrad-group {best['wgrad_group']}" in out.splitlines()[-2]
    assert [g["k"] for g in best["wgrad_groups"]] == [None, 1, 2, 4, 8]


@pytest.mark.parametrize("extra, flag", [
    (["--zero-bubble-wgrad-group", "2"], "--zero-bubble-wgrad-group"),     # without optim_grads
    (["--data-parallel-sharding-strategy", "optim_grads", "--zero-bubble-wgrad-group", "x"],
     "--zero-bubble-wgrad-group"),
])
def test_cli_errors_exit_2(capsys, extra, flag):
    rc = main([str(a) for a in FLAGS + extra])
    err = capsys.readouterr().err
    assert rc == 2 and f"error: {flag}:" in err

"""Tests of ``megatron-zb plan`` (megatron_zb/planning): estimates against the zero-bubble paper,
the command line, the JSON document and the profile file.

Expected values come from the paper's tables as copied into tests/data/ (zb_paper_costs.json:
Table 9 profiled T_F/T_B/T_W; zb_paper_throughput.json: Table 4 throughput, Table 3 shapes) or
from formulas written out here, never from the code under test. Pure Python (no GPU, no
process group). The paper does not state its vocabulary; the settings use 32000 (the
SentencePiece tokenizer of the paper-era example script of its implementation).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_zb.cli import main
from megatron_zb.planning.hardware import GPUS, resolve_hardware
from megatron_zb.planning.layout import LayerSplit, stage_shapes
from megatron_zb.planning.flops import layer_cost, stage_costs
from megatron_zb.planning.memory import layer_activations
from megatron_zb.planning.model import PlanError, make_model, make_parallel
from megatron_zb.planning.planner import plan
from megatron_zb.planning.profile import StageProfile, read_profile, write_profile
from megatron_zb.schedules import Op
from megatron_zb.schedules.spread import DurationSpread

DATA = Path(__file__).resolve().parents[1] / "data"
COSTS = json.loads((DATA / "zb_paper_costs.json").read_text())
THROUGHPUT = json.loads((DATA / "zb_paper_throughput.json").read_text())
VOCAB = 32000
TABLE9_TOLERANCE = 0.25  # estimated / published within 1 +- 0.25
RATIO_TOLERANCE = 0.1  # predicted ZB-2p/1F1B throughput ratio within 0.1 of Table 4's


def paper_model(name: str, m: int):
    """The paper's Table 3 shape ``name`` with ``m`` microbatches, on A100s (fp16, as the paper)."""
    md = THROUGHPUT["models"][name]
    model = make_model(num_layers=md["layers"], hidden_size=md["hidden"], num_attention_heads=md["heads"],
                       seq_length=md["seq"], micro_batch_size=md["b"], vocab_size=VOCAB, precision="fp16")
    par = make_parallel(model, pp=md["p"], num_microbatches=m, allow_padding_num_layers=True)
    return model, par


def paper_flags(name: str, m: int) -> list[str]:
    md = THROUGHPUT["models"][name]
    return ["plan", "--num-layers", md["layers"], "--hidden-size", md["hidden"], "--num-attention-heads",
            md["heads"], "--seq-length", md["seq"], "--micro-batch-size", md["b"], "--vocab-size", VOCAB,
            "--fp16", "--pipeline-model-parallel-size", md["p"], "--num-microbatches", m,
            "--allow-padding-num-layers", "--gpu", "A100"]


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


# ------------------------------------------------------------------------------ paper validation
@pytest.mark.parametrize("row", THROUGHPUT["throughput_samples_per_gpu_per_s"], ids=lambda r: f"{r['model']}-m{r['m']}")
def test_paper_ranking_and_zb2p_over_1f1b_ratio(row):
    """Table 4: ZB-2p > ZB-1p > 1F1B, and ZB-2p/1F1B throughput within 0.1 of the measured ratio."""
    model, par = paper_model(row["model"], row["m"])
    assert par.pp * par.tp == row["gpus"]
    result = plan(model=model, parallel=par, hardware=resolve_hardware(gpu="A100"),
                  schedules=["1f1b", "zb-1p", "zb-2p"])
    fam = {f.name: f for f in result.families}
    assert all(f.status == "ok" and f.fits for f in fam.values()), [(f.name, f.status, f.reason) for f in fam.values()]
    assert fam["zb-2p"].throughput > fam["zb-1p"].throughput > fam["1f1b"].throughput
    assert result.recommended == "zb-2p"
    predicted = fam["zb-2p"].throughput / fam["1f1b"].throughput
    measured = row["ZB-2p"] / row["1F1B"]
    assert abs(predicted - measured) <= RATIO_TOLERANCE, (predicted, measured)


@pytest.mark.parametrize("row", COSTS["rows"], ids=lambda r: f"{r['model']}-m{r['m']}")
def test_estimated_costs_within_25_percent_of_table9(row):
    """A full stage's (middle stage: transformer layers only) T_F, T_B, T_W vs the paper's Table 9."""
    model, par = paper_model(row["model"], row["m"])
    shapes = stage_shapes(num_layers=model.num_layers, pp=par.pp, placement="plain",
                          split=LayerSplit(allow_padding=True))
    middle = stage_costs(model, par, resolve_hardware(gpu="A100"), shapes)[par.pp // 2]
    assert not middle.shape.embedding and not middle.shape.loss
    for est, key in ((middle.f, "TF"), (middle.b, "TB"), (middle.w, "TW")):
        assert abs(est.time_ms / row[key] - 1) <= TABLE9_TOLERANCE, (key, est.time_ms, row[key])


def test_memory_per_layer_is_the_papers_formula():
    """M_B = 34sbh + 5as^2b and M_W = 32sbh bytes per layer for the paper's GPT (t = 1, MHA, f = 4h)."""
    for name, md in COSTS["models"].items():
        model, par = paper_model(name, 24)
        s, b, h, a = md["seq"], md["b"], md["hidden"], md["heads"]
        act = layer_activations(model, par)
        assert act.mem_b == 34 * s * b * h + 5 * a * s * s * b
        assert act.mem_w == 32 * s * b * h


def test_flops_per_layer_are_the_papers():
    """Per layer F = sbh(24h + 4s), B = sbh(24h + 8s), W = sbh(24h) FLOPs (the paper's Table 1)."""
    model, par = paper_model("6.2B", 24)
    s, b, h = 1024, 3, 4096
    cost = layer_cost(model, par, GPUS["A100"])
    assert cost["F"].flops == s * b * h * (24 * h + 4 * s)
    assert cost["B"].flops == s * b * h * (24 * h + 8 * s)
    assert cost["W"].flops == s * b * h * 24 * h


def test_tensor_parallel_memory_follows_korthikanti():
    """With TP t (no SP) a layer keeps sbh(10 + 24/t) + 5as^2b/t bytes; with SP (34sbh + 5as^2b)/t."""
    md = THROUGHPUT["models"]["14.6B"]
    model, _ = paper_model("14.6B", 48)
    s, b, h, a, t = md["seq"], md["b"], md["hidden"], md["heads"], 4
    plain = make_parallel(model, pp=16, tp=t, num_microbatches=48, allow_padding_num_layers=True)
    sp = make_parallel(model, pp=16, tp=t, num_microbatches=48, allow_padding_num_layers=True, sequence_parallel=True)
    assert layer_activations(model, plain).mem_b == pytest.approx(s * b * h * (10 + 24 / t) + 5 * a * s * s * b / t)
    assert layer_activations(model, sp).mem_b == pytest.approx((34 * s * b * h + 5 * a * s * s * b) / t)


def test_fp32_model_counts_4_bytes_per_element_and_16_per_parameter(capsys, tmp_path):
    """fp32 (Megatron's default, neither --bf16 nor --fp16): every activation element takes 4 bytes
    (no dropout masks here, so a layer keeps exactly twice the fp16 bytes), Adam keeps 16 bytes per
    parameter (weight 4, gradient 4, two moments 8; no master copy) against 18 in mixed precision,
    and the plan needs the GPU's fp32 peak (the --gpu table's are 16-bit)."""
    md = THROUGHPUT["models"]["1.5B"]
    shape = dict(num_layers=md["layers"], hidden_size=md["hidden"], num_attention_heads=md["heads"],
                 seq_length=md["seq"], micro_batch_size=md["b"], vocab_size=VOCAB, hidden_dropout=0.0,
                 attention_dropout=0.0)
    acts = {}
    for precision in ("fp16", "fp32"):
        model = make_model(**shape, precision=precision)
        acts[precision] = layer_activations(model, make_parallel(model, pp=8, num_microbatches=8,
                                                                 allow_padding_num_layers=True))
    assert acts["fp32"].mem_b == 2 * acts["fp16"].mem_b and acts["fp32"].mem_w == 2 * acts["fp16"].mem_w
    argv = [a for a in map(str, paper_flags("1.5B", 8)) if a != "--fp16"] + ["--schedules", "1f1b"]
    rc, _, err = run(capsys, *argv)
    assert rc == 2 and err.startswith("megatron-zb: error: --gpu-tflops"), err
    docs = {}
    for precision, extra in (("fp16", ["--fp16"]), ("fp32", [])):
        out = tmp_path / f"{precision}.json"
        rc, _, err = run(capsys, *argv, *extra, "--gpu-tflops", "150", "--json", out)
        assert rc == 0, err
        docs[precision] = json.loads(out.read_text())["schedules"][0]
    ratio = docs["fp32"]["param_optimizer_gib"] / docs["fp16"]["param_optimizer_gib"]
    assert ratio == pytest.approx(16 / 18, rel=1e-9)


def test_uneven_split_flags_follow_the_trainers_rule():
    """--decoder-first-pipeline-num-layers decides the split (pretrain_gpt_zb.py's rule, one function
    for planner and trainer): 7 layers on PP=2 are [1, 6] on the plain placement (per rank) and
    [1, 2, 2, 2] on the V (per stage); --allow-padding-num-layers alone gives [4, 3] and [2, 2, 2, 1]."""
    from megatron_zb.planning.planner import CostSource
    from megatron_zb.schedules import Placement

    model = make_model(num_layers=7, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=1,
                       vocab_size=128, precision="bf16")
    hw = resolve_hardware(gpu="A100")
    pars = {"padding": make_parallel(model, pp=2, num_microbatches=2, allow_padding_num_layers=True),
            "first=1": make_parallel(model, pp=2, num_microbatches=2, decoder_first_pipeline_num_layers=1)}
    layers = {k: [[s.num_layers for s in CostSource(model, par, hw).table(pl, c).shapes]
                  for pl, c in ((Placement.PLAIN, 1), (Placement.V, 2))] for k, par in pars.items()}
    assert layers == {"padding": [[4, 3], [2, 2, 2, 1]], "first=1": [[1, 6], [1, 2, 2, 2]]}
    res = plan(model=model, parallel=pars["first=1"], hardware=hw, schedules=["zbv", "interleaved-1f1b"])
    status = {f.name: f.status for f in res.families}
    assert status["zbv"] == "ok"
    # megatron-core's rule for interleaving: the first rank's 1 layer cannot be split over its chunks
    skipped = next(f for f in res.families if f.name == "interleaved-1f1b")
    assert skipped.status == "skipped" and "1 layers of a pipeline rank do not divide evenly" in skipped.reason


# ------------------------------------------------------------------------------ command line
def test_cli_json_schema_and_plot(capsys, tmp_path):
    out_json, out_png = tmp_path / "plan.json", tmp_path / "plan.png"
    rc, out, err = run(capsys, *paper_flags("6.2B", 32), "--schedules", "1f1b,zb-h1,zb-1p,zb-2p",
                       "--json", out_json, "--plot", out_png)
    assert rc == 0, err
    doc = json.loads(out_json.read_text())
    names = [s["name"] for s in doc["schedules"]]
    assert names == ["1f1b", "zb-h1", "zb-1p", "zb-2p"]
    for s in doc["schedules"]:
        assert {"name", "iteration_time_ms", "bubble_rate", "peak_memory_gib", "fits"} <= set(s)
        assert s["iteration_time_ms"] > 0 and 0 <= s["bubble_rate"] < 1 and s["peak_memory_gib"] > 0
        assert isinstance(s["fits"], bool)
    assert doc["recommended"] == "zb-2p"
    best = min((s for s in doc["schedules"] if s["fits"]), key=lambda s: s["iteration_time_ms"])
    assert best["name"] == doc["recommended"]
    assert doc["not_planned"] == []  # --schedules plans exactly the named families
    assert len(doc["stages"]) == 8 and doc["stages"][0]["embedding"] and doc["stages"][-1]["loss"]
    assert out_png.stat().st_size > 0
    assert "recommended: zb-2p" in out


@pytest.mark.parametrize("flags, flag", [
    (["--gpu", "V100"], "--gpu"),
    (["--pipeline-model-parallel-size", "30"], "--pipeline-model-parallel-size"),
    (["--num-microbatches", None], "--num-microbatches"),
    (["--global-batch-size", "100"], "--global-batch-size"),
    (["--fp16", None], "--gpu-tflops"),  # fp32: the table's peaks are 16-bit
    (["--schedules", "zb-3p"], "--schedules"),
    (["--mfu", "1.5"], "--mfu"),
    (["--plot", "x.jpg"], "--plot"),
])
def test_bad_input_exits_2_with_one_line_naming_the_flag(capsys, flags, flag):
    """A user error: exit status 2 and exactly one stderr line, ``megatron-zb: error: <flag>...``."""
    argv = [str(a) for a in paper_flags("1.5B", 24)]
    name, value = flags
    i = argv.index(name) if name in argv else None
    if value is None:  # drop the flag (and its value, if it takes one)
        del argv[i:i + (1 if argv[i] == "--fp16" else 2)]
    elif i is not None:
        argv[i + 1] = value
    else:
        argv += [name, value]
    rc, out, err = run(capsys, *argv)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"megatron-zb: error: {flag}"), err


def test_pp_not_dividing_layers_without_padding(capsys):
    argv = [a for a in map(str, paper_flags("1.5B", 24)) if a != "--allow-padding-num-layers"]
    rc, _, err = run(capsys, *argv)
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith("megatron-zb: error: --pipeline-model-parallel-size: 8 stages cannot hold --num-layers 22")


# ------------------------------------------------------------------------------ profile
def _small():
    model = make_model(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=1024, micro_batch_size=2,
                       vocab_size=32000, swiglu=True, group_query_attention=True, num_query_groups=4,
                       position_embedding_type="rope", normalization="RMSNorm", add_bias_linear=False)
    return model, make_parallel(model, pp=4, num_microbatches=8)


def _stages(n: int) -> list[StageProfile]:
    return [StageProfile(t_f_ms=3.0 + 0.5 * i, t_b_ms=3.5, t_w_ms=2.0, mem_b_bytes=1.5e9, mem_w_bytes=0.5e9)
            for i in range(n)]


def test_profile_round_trip(tmp_path):
    model, par = _small()
    path = tmp_path / "p.json"
    written = write_profile(path, model=model, parallel=par, schedule="1f1b", placement="plain",
                            stage_to_rank=[0, 1, 2, 3], t_comm_ms=0.25, stages=_stages(4), device="test GPU")
    back = read_profile(path)
    assert back == written
    assert back.model.ffn_hidden_size == int(4 * 1024 * 2 / 3 / 64) * 64  # Megatron's SwiGLU default
    raw = json.loads(path.read_text())
    assert raw["format"] == "megatron-zb-profile" and raw["version"] == 1
    assert raw["stages"][3] == {"t_f_ms": 4.5, "t_b_ms": 3.5, "t_w_ms": 2.0, "mem_b_bytes": 1.5e9,
                                "mem_w_bytes": 0.5e9}


def test_profile_rejects_inconsistent_content(tmp_path):
    model, par = _small()
    with pytest.raises(PlanError, match="mem_w_bytes must be a finite number >= 0"):
        write_profile(tmp_path / "p.json", model=model, parallel=par, schedule="1f1b", placement="plain",
                      stage_to_rank=[0, 1, 2, 3], t_comm_ms=0.2,
                      stages=[StageProfile(1.0, 1.0, 1.0, mem_b_bytes=1.0, mem_w_bytes=-2.0)] * 4)
    # mem_w above mem_b is a measurement, not an inconsistency: B allocated (sequence parallelism)
    write_profile(tmp_path / "p.json", model=model, parallel=par, schedule="1f1b", placement="plain",
                  stage_to_rank=[0, 1, 2, 3], t_comm_ms=0.2,
                  stages=[StageProfile(1.0, 1.0, 1.0, mem_b_bytes=1.0, mem_w_bytes=2.0)] * 4)
    with pytest.raises(PlanError, match="not the v placement"):
        write_profile(tmp_path / "p.json", model=model, parallel=par, schedule="zbv", placement="v",
                      stage_to_rank=[0, 1, 2, 3, 0, 1, 2, 3], t_comm_ms=0.2, stages=_stages(8))


@pytest.mark.parametrize("key, value", [("step_ms", -1.0), ("step_ms", "fast"), ("action_overhead_ms", float("nan")),
                                        ("action_overhead_ms", True)])
def test_profile_measured_runtime_keys_are_optional_and_checked(tmp_path, key, value):
    """step_ms / action_overhead_ms: written and read back; a file without them (as written before
    they existed) reads as not measured; a negative, non-finite or non-number value is refused by
    write and read alike, naming the key."""
    model, par = _small()
    path = tmp_path / "p.json"
    kw = dict(model=model, parallel=par, schedule="1f1b", placement="plain", stage_to_rank=[0, 1, 2, 3],
              t_comm_ms=0.25, stages=_stages(4))
    written = write_profile(path, **kw, step_ms=21.5, action_overhead_ms=0.125)
    assert read_profile(path) == written and (written.step_ms, written.action_overhead_ms) == (21.5, 0.125)
    raw = json.loads(path.read_text())
    assert (raw["step_ms"], raw["action_overhead_ms"], raw["version"]) == (21.5, 0.125, 1)
    old = {k: v for k, v in raw.items() if k not in ("step_ms", "action_overhead_ms")}
    path.write_text(json.dumps(old))
    assert (read_profile(path).step_ms, read_profile(path).action_overhead_ms) == (None, None)
    with pytest.raises(PlanError, match=key):
        write_profile(tmp_path / "bad.json", **kw, **{key: value})
    assert not (tmp_path / "bad.json").exists()
    path.write_text(json.dumps({**raw, key: value}))
    with pytest.raises(PlanError, match=f"p.json: {key} must be"):
        read_profile(path)


def test_plan_adds_the_measured_runtime_overhead_and_step(capsys, tmp_path):
    """A profile's action_overhead_ms lengthens every compute action (a fused BW once) and its
    step_ms replaces the optimizer and DP estimates while the DP size is the profile's. 1F1B with
    equal stages and T_comm 0 has the closed form makespan = (m + p - 1) (T_F + T_B + T_W + 2 ov)."""
    model, par = _small()
    stages = [StageProfile(t_f_ms=3.0, t_b_ms=3.5, t_w_ms=2.0, mem_b_bytes=1.5e9, mem_w_bytes=0.5e9)] * 4
    path, out_json = tmp_path / "p.json", tmp_path / "plan.json"
    write_profile(path, model=model, parallel=par, schedule="zb-1p", placement="plain", stage_to_rank=[0, 1, 2, 3],
                  t_comm_ms=0.0, stages=stages, step_ms=7.5, action_overhead_ms=0.25)
    rc, out, err = run(capsys, "plan", "--profile", path, "--gpu", "H100", "--schedules", "1f1b,zb-h1", "--json",
                       out_json)
    assert rc == 0, err
    doc = json.loads(out_json.read_text())
    one = next(s for s in doc["schedules"] if s["name"] == "1f1b")
    m, p = 8, 4
    assert one["makespan_ms"] == pytest.approx((m + p - 1) * (3.0 + 3.5 + 2.0 + 2 * 0.25), rel=1e-9)
    assert one["iteration_time_ms"] == pytest.approx(one["makespan_ms"] + 7.5, rel=1e-9)
    assert (one["optimizer_ms"], one["dp_sync_ms"], one["step_source"]) == (7.5, 0.0, "profile")
    assert doc["action_overhead_ms"] == 0.25
    assert "0.250 ms measured runtime overhead each" in out and "measured time outside the schedule" in out
    # another DP size: the reduces differ from the measured ones, so the step is estimated again
    rc, out, err = run(capsys, "plan", "--profile", path, "--gpu", "H100", "--schedules", "1f1b",
                       "--data-parallel-size", 2, "--json", out_json)
    assert rc == 0, err
    one = json.loads(out_json.read_text())["schedules"][0]
    assert one["step_source"] == "estimate" and one["dp_sync_ms"] > 0 and one["optimizer_ms"] != 7.5
    assert "optimizer step + DP gradient all-reduce (estimates)" in out


def test_plan_from_profile_uses_the_measured_costs(capsys, tmp_path):
    model, par = _small()
    path, out_json = tmp_path / "p.json", tmp_path / "plan.json"
    write_profile(path, model=model, parallel=par, schedule="1f1b", placement="plain", stage_to_rank=[0, 1, 2, 3],
                  t_comm_ms=0.25, stages=_stages(4))
    rc, out, err = run(capsys, "plan", "--profile", path, "--gpu", "H100", "--num-microbatches", 12,
                       "--schedules", "1f1b,zb-2p,interleaved-1f1b", "--json", out_json)
    assert rc == 0, err
    doc = json.loads(out_json.read_text())
    assert doc["inputs"]["parallel"]["num_microbatches"] == 12
    assert [s["t_f_ms"] for s in doc["stages"]] == [3.0, 3.5, 4.0, 4.5]
    assert doc["t_comm_ms"] == 0.25
    src = {s["name"]: s["cost_source"] for s in doc["schedules"]}
    assert src == {"1f1b": "profile", "zb-2p": "profile", "interleaved-1f1b": "scaled estimate"}
    one = next(s for s in doc["schedules"] if s["name"] == "1f1b")
    # 1F1B with a fused backward on 4 ranks: the last rank's chain is bounded below by its own work,
    # 12 * (4.5 + 3.5 + 2.0) ms, plus the first microbatch's forward through stages 0-2 and 3 hops.
    assert one["makespan_ms"] >= 12 * 10.0 + (3.0 + 3.5 + 4.0) + 3 * 0.25
    rc, _, err = run(capsys, "plan", "--profile", path, "--gpu", "H100", "--hidden-size", 2048)
    assert rc == 2 and err.startswith("megatron-zb: error: --hidden-size: 2048 disagrees with the profile")


def test_default_families_progress_and_search_limit(capsys, tmp_path, monkeypatch):
    """Default run: every family planned or listed with a reason; the search-based multi-chunk
    generators are left out above the size limit unless named; a progress line per family once
    planning passes the threshold."""
    import megatron_zb.cli.plan as command
    import megatron_zb.planning.planner as planner
    monkeypatch.setattr(command, "PROGRESS_AFTER_S", 0.0)
    monkeypatch.setattr(planner, "SEARCH_LIMIT", 40)  # V: 8 stages x 8 microbatches = 64 > 40
    base = ["plan", "--num-layers", 8, "--hidden-size", 1024, "--num-attention-heads", 16, "--seq-length", 1024,
            "--micro-batch-size", 2, "--vocab-size", 32000, "--bf16", "--pipeline-model-parallel-size", 4,
            "--num-microbatches", 8, "--gpu", "H100"]
    out_json = tmp_path / "plan.json"
    rc, out, err = run(capsys, *base, "--json", out_json)
    assert rc == 0, err
    doc = json.loads(out_json.read_text())
    from megatron_zb.schedules.registry import schedule_names
    planned = {s["name"] for s in doc["schedules"]}
    left = {d["name"]: d["reason"] for d in doc["not_planned"]}
    assert planned | set(left) == set(schedule_names()) and not planned & set(left)
    assert {"1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb", "zb-1p", "zb-2p"} <= planned
    for name in ("zbv", "v-half", "v-min", "interleaved-zb"):
        assert f"--schedules {name}" in left[name]
    from megatron_zb.schedules.registry import get_spec
    for name in ("zb-optimal", "zbv-optimal"):   # the registry entry's reason (ScheduleSpec.excluded_from_plan)
        assert "CP-SAT" in left[name] and left[name].startswith(get_spec(name).excluded_from_plan)
    progress = [line for line in err.splitlines() if line.startswith("megatron-zb plan: [")]
    assert len(progress) == len(schedule_names())
    rc, _, err = run(capsys, *base, "--schedules", "zbv", "--json", out_json)
    assert rc == 0, err
    assert [s["name"] for s in json.loads(out_json.read_text())["schedules"]] == ["zbv"]


def test_profile_duration_spread_round_trip_and_checks(tmp_path):
    """duration_spread: written as {op: quantiles}, read back equal; absent reads as None; a
    quantile list that is not ascending or not positive, or an op other than F/B/W, is refused by
    read and write alike with the file named."""
    model, par = _small()
    path = tmp_path / "p.json"
    kw = dict(model=model, parallel=par, schedule="zb-1p", placement="plain", stage_to_rank=[0, 1, 2, 3],
              t_comm_ms=0.25, stages=_stages(4))
    spread = DurationSpread({Op.F: (0.75, 1.0, 1.5), Op.W: (0.5, 2.0)})
    written = write_profile(path, **kw, duration_spread=spread)
    assert read_profile(path) == written and written.duration_spread == spread
    raw = json.loads(path.read_text())
    assert raw["duration_spread"] == {"F": [0.75, 1.0, 1.5], "W": [0.5, 2.0]}
    path.write_text(json.dumps({k: v for k, v in raw.items() if k != "duration_spread"}))
    assert read_profile(path).duration_spread is None
    for bad in ({"F": [1.5, 1.0]}, {"B": [0.0, 1.0]}, {"BW": [1.0]}, {"F": "wide"}, [1.0]):
        path.write_text(json.dumps({**raw, "duration_spread": bad}))
        with pytest.raises(PlanError, match=r"p\.json: .*duration.spread"):
            read_profile(path)


def test_plan_draws_action_durations_from_the_profile_spread(capsys, tmp_path):
    """With a spread the makespan is the median over draws. One band per op makes every draw the
    same: F always 1.2 x its median. 1F1B, equal stages, T_comm 0: makespan = (m + p - 1) (1.2 T_F +
    T_B + T_W + 2 ov) = 11 x (3.6 + 3.5 + 2.0 + 0.5) = 105.6 ms against 11 x 9.0 = 99.0 ms with the
    medians: duration_spread_ms 6.6, included in the iteration time. Without a spread the key is null."""
    model, par = _small()
    stages = [StageProfile(t_f_ms=3.0, t_b_ms=3.5, t_w_ms=2.0, mem_b_bytes=1.5e9, mem_w_bytes=0.5e9)] * 4
    path, out_json = tmp_path / "p.json", tmp_path / "plan.json"
    kw = dict(model=model, parallel=par, schedule="zb-1p", placement="plain", stage_to_rank=[0, 1, 2, 3],
              t_comm_ms=0.0, stages=stages, step_ms=7.5, action_overhead_ms=0.25)
    write_profile(path, **kw, duration_spread=DurationSpread({Op.F: (1.2,), Op.B: (1.0,)}))
    rc, out, err = run(capsys, "plan", "--profile", path, "--gpu", "H100", "--schedules", "1f1b", "--json", out_json)
    assert rc == 0, err
    one = json.loads(out_json.read_text())["schedules"][0]
    assert one["makespan_ms"] == pytest.approx(99.0, rel=1e-9)
    assert one["duration_spread_ms"] == pytest.approx(6.6, rel=1e-9)
    assert one["iteration_time_ms"] == pytest.approx(105.6 + 7.5, rel=1e-9)
    assert "drawn from the profile's measured spread" in out
    write_profile(path, **kw)
    rc, out, err = run(capsys, "plan", "--profile", path, "--gpu", "H100", "--schedules", "1f1b", "--json", out_json)
    assert rc == 0 and json.loads(out_json.read_text())["schedules"][0]["duration_spread_ms"] is None
    assert "measured spread" not in out


def test_weight_gradients_outgrowing_the_forward_plan_with_b_allocating(capsys, tmp_path):
    """TP=8 with sequence parallelism and flash attention (it was refused in one line before issue 30):
    each W keeps the row-parallel layers' all-gathered output gradients and, with Transformer
    Engine's layers, the column-parallel layers' all-gathered inputs (T x h each, not divided by
    TP), more than F saved, so B allocates; the plan counts it. By hand, e = 2, T = s = 4096,
    h = 4096, t = 8, A = Th/t = 2097152, q = kv = 512, f = 2048 (per GPU), 4 layers per stage:
      layer M_B = e(2A + T(q + 2kv) + 2Ta/t + Tq + 2A + Tf + Tf) + 2A (masks) = 71368704 bytes;
      layer M_W, TE    = e(Th + T(q + 2kv) + Tq + Th + Th + Tf + Tf + Th) = 184549376,
                 local = the same with A for the two column-parallel inputs = 125829120;
      stage 0 (+ embedding: mask A, gradient eA): M_B = 287571968, M_W = 742391808 (local 507510784);
      stage 1 (+ loss: 2eA + 4 T V/t with V/t = 4096; eA + e T V/t): M_B = 360972288,
        M_W = 775946240 (local 541065216).
    ZB-H1 at PP=2: rank 0 runs F0 F1 B0 W0 F2 B1 W1 ..., its peak right after B0: M_B + M_W;
    rank 1 runs F0 B0 F1 B1 W0 ...: two W's pending after B1, 2 M_W. 1F1B (fused BW) holds
    2 M_B and 1 M_B."""
    argv = ["plan", "--num-layers", "8", "--hidden-size", "4096", "--num-attention-heads", "32", "--seq-length", "4096",
            "--micro-batch-size", "1", "--use-flash-attn", "--pipeline-model-parallel-size", "2",
            "--tensor-model-parallel-size", "8", "--global-batch-size", "16", "--gpu", "H100",
            "--vocab-size", "32000", "--bf16", "--sequence-parallel", "--schedules", "1f1b,zb-h1"]
    gib = float(2 ** 30)
    b0, b1 = 287571968, 360972288
    for impl, w0, w1 in (("transformer_engine", 742391808, 775946240), ("local", 507510784, 541065216)):
        out_json = tmp_path / f"{impl}.json"
        rc, out, err = run(capsys, *argv, "--transformer-impl", impl, "--json", out_json)
        assert rc == 0, err
        doc = json.loads(out_json.read_text())
        assert [(st["mem_b_gib"] * gib, st["mem_w_gib"] * gib) for st in doc["stages"]] == [(b0, w0), (b1, w1)]
        peaks = {f["name"]: [x * gib for x in f["peak_activation_per_rank_gib"]] for f in doc["schedules"]}
        assert peaks["zb-h1"] == [b0 + w0, 2 * w1] and peaks["1f1b"] == [2 * b0, b1]
    rc, _, err = run(capsys, *argv)  # Megatron-LM's default, transformer_engine
    assert rc == 0, err

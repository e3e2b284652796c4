"""The compatibility matrix: every schedule family x every training feature against megatron-core.

Runs the same runner code as ``scripts/compat_matrix.py`` (real megatron-core GPT chunks, DDP,
optimizers, gloo processes) over the *full* product of families and features, and asserts each
cell's status from :data:`EXPECTED`, written here by hand -- not computed by the runner. The
training features (:data:`TRAINING_FEATURES`) share one launch per placement group and world size, and so
do issue 13's six model features and issue 41's mtp, mla and deepseek-moe (:data:`MODEL_FEATURES`): about 2
minutes for the whole matrix on a loaded 2-core machine (one launch per feature took about 3). Also: recomputation, MoE and MLA queue the
expected number of deferred weight-gradient computations; megatron-core's own execution order
(instrumented forward and backward steps) equals ``1f1b``'s and ``interleaved-1f1b``'s, at PP=2
and PP=4; issue 24's vocab-parallel column (each family's vocabulary form against megatron-core's
schedule on the unsliced model) at PP=2 and PP=4; a refused cell; the comparison's failure modes;
the script end to end.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import megatron_zb  # noqa: F401  (CPU shim)
from megatron_zb.schedules.registry import get_spec
from megatron_zb.testing.compat_features import FAMILIES, FEATURES, Feature, ModelShape, Tolerance, feature
from megatron_zb.testing.compat_matrix import Cell, Launch, classify, compare, plan_launches, run_launches

ROOT = Path(__file__).resolve().parents[2]

# B: equal (bitwise); T: equal within the feature's stated tolerance; R: refused up front.
EXPECTED_TABLE = """
family           fp32 bf16 fp16 tp2 tp2-sp dp2-ddp dp2-distopt wgrad-fusion pv-exact pv-inplace per-token-loss
1f1b             B    B    B    B   B      B       B           B            B        T          B
zb-h1            B    B    B    B   B      B       B           B            B        T          B
zb-h2            B    B    B    B   B      B       B           B            B        T          B
zb               B    B    B    B   B      B       B           B            B        T          B
zb-1p            B    B    B    B   B      B       B           B            B        T          B
zb-2p            B    B    B    B   B      B       B           B            B        T          B
interleaved-1f1b B    B    B    B   B      B       B           B            B        T          B
interleaved-zb   B    B    B    B   B      B       B           B            B        T          B
zbv              B    B    B    B   B      B       B           B            B        T          B
v-half           B    B    B    B   B      B       B           B            B        T          B
v-min            B    B    B    B   B      B       B           B            B        T          B
"""
EXPECTED_MODEL_TABLE = """
family           llama recompute-full recompute-selective tied uneven-split moe mtp mla deepseek-moe
1f1b             B     B              B                   B    B            B   B   B   B
zb-h1            B     B              B                   B    B            B   B   B   B
zb-h2            B     B              B                   B    B            B   B   B   B
zb               B     B              B                   B    B            B   B   B   B
zb-1p            B     B              B                   B    B            B   B   B   B
zb-2p            B     B              B                   B    B            B   B   B   B
interleaved-1f1b B     B              B                   B    B            B   B   B   B
interleaved-zb   B     B              B                   B    B            B   B   B   B
zbv              B     B              B                   T    B            B   T   B   B
v-half           B     B              B                   T    B            B   T   B   B
v-min            B     B              B                   T    B            B   T   B   B
"""
"""Issue 13's model features and issue 41's mtp, mla and deepseek-moe (one table per line width)."""
EXPECTED_VOCAB_TABLE = """
family           vocab-parallel
1f1b             T
zb-h1            T
zb-h2            R
zb               T
zb-1p            T
zb-2p            T
interleaved-1f1b T
interleaved-zb   T
zbv              T
v-half           T
v-min            T
"""
"""Issue 24's column: each family's vocabulary form (zb-h2 has none: refused by name)."""
_KIND = {"B": "bitwise", "T": "tolerance", "R": "refused"}


def _expected() -> dict[tuple[str, str], str]:
    out = {}
    for table in (EXPECTED_TABLE, EXPECTED_MODEL_TABLE, EXPECTED_VOCAB_TABLE):
        header, *rows = [ln.split() for ln in table.strip().splitlines()]
        out.update({(row[0], feat): _KIND[mark] for row in rows for feat, mark in zip(header[1:], row[1:])})
    return out


EXPECTED = _expected()
ALL_FAMILIES = [n for names in FAMILIES.values() for n in names]


def test_expectation_table_covers_the_matrix():
    assert set(EXPECTED) == {(fam, f.name) for fam in ALL_FAMILIES for f in FEATURES}


MODEL_FEATURES = ["llama", "recompute-full", "recompute-selective", "tied", "uneven-split", "moe", "mtp", "mla",
                  "deepseek-moe"]
"""Issue 13's model features and issue 41's mtp, mla and deepseek-moe: run together
(``plan_launches(together=True)``: one launch per placement group for all nine, plus the fp32 column their
``same_w_as`` check needs) -- every cell, with 4 process start-ups instead of 40; about 25 s of CPU time per
rank before issue 41, each of its columns a few seconds more)."""


TRAINING_FEATURES = [f.name for f in FEATURES if f.name not in MODEL_FEATURES]
"""The eleven training features (precisions, TP, DP, fusion, post-validation, per-token loss): run together
as well, one launch per placement group and world size."""


class Matrix:
    """Runs each feature's launches once (on first use) and keeps its cells and raw results."""

    def __init__(self) -> None:
        self.cells: dict[str, dict[str, Cell]] = {}
        self.results: dict[tuple[str, str], dict] = {}

    def column(self, f: Feature) -> dict[str, Cell]:
        if f.name not in self.cells:
            names = MODEL_FEATURES if f.name in MODEL_FEATURES else TRAINING_FEATURES
            group = [feature(n) for n in names]
            launches = plan_launches(group, ALL_FAMILIES, ModelShape(), together=True)
            done = {name for name, _ in self.results}  # a same_w_as column already run (fp32) is not run again
            launches = [Launch(specs, launch.world_size) for launch in launches
                        if (specs := tuple(s for s in launch.specs if s.feature.name not in done))]
            results, errors = run_launches(launches, timeout=300)
            self.results.update(results)
            for g in group:
                self.cells[g.name] = {c.family: c for c in classify([g], ALL_FAMILIES, self.results, errors)}
        return self.cells[f.name]


@pytest.fixture(scope="module")
def matrix() -> Matrix:
    return Matrix()


@pytest.mark.parametrize("name", [f.name for f in FEATURES])
def test_matrix_column(matrix, name):
    """Every family of one feature column has the status of EXPECTED_TABLE (one test per column:
    the column's launches run together)."""
    column = matrix.column(feature(name))
    wrong = {fam: c.status for fam, c in column.items() if c.kind != EXPECTED[(fam, name)]}
    assert not wrong, "\n".join(f"{fam} x {name}: want {EXPECTED[(fam, name)]}, got {s}" for fam, s in wrong.items())
    for c in column.values():
        if c.kind == "bitwise":
            assert c.status == "equal (bitwise)" and c.max_rel == 0.0
        elif c.kind == "tolerance" and c.tolerance.after_step is not None:
            assert 0.0 < c.max_rel <= c.tolerance.rtol and 0.0 < c.max_rel_after_step <= c.tolerance.after_step
            assert c.status.startswith(f"equal (<= {c.tolerance.rtol:g}; after a step <= {c.tolerance.after_step:g}, ")
        elif c.kind == "tolerance":
            assert 0.0 < c.max_rel <= c.tolerance.rtol and c.status.startswith(f"equal (<= {c.tolerance.rtol:g}, ")


@pytest.mark.parametrize("name", ["recompute-full", "recompute-selective"])
def test_recomputation_defers_every_w_once(matrix, name):
    """W still deferred inside recomputed layers: each split-backward family queued exactly as many
    weight-gradient computations as without recomputation (the fp32 column, same family)."""
    matrix.column(feature(name))
    for fam in ALL_FAMILIES:
        got, base = matrix.results[(name, fam)]["w_deferred"], matrix.results[("fp32", fam)]["w_deferred"]
        assert got == base, f"{fam}: {got} W computations with {name}, {base} without"
        assert (got > 0) == get_spec(fam).split_backward, fam


def test_moe_defers_expert_weight_gradients(matrix):
    """4 experts x (fc1, fc2) in each of the 3 MoE layers: a split-backward family queues those W's too,
    so per microbatch a MoE layer has 2 + 8 routed linears (qkv, proj, experts; the router's gradient
    comes in B) where a dense layer has 4 -- 35 W's per microbatch instead of fp32's 17 (+ output layer)."""
    matrix.column(feature("moe"))
    for fam in ALL_FAMILIES:
        got, base = matrix.results[("moe", fam)]["w_deferred"], matrix.results[("fp32", fam)]["w_deferred"]
        assert got * 17 == base * 35, f"{fam}: {got} W computations with MoE, {base} dense"


def test_mla_defers_every_projection_weight_gradient(matrix):
    """Multi-latent attention's five projections (q down/up, kv down/up, output) and the MLP's two linears: a
    split-backward family queues 7 W's per layer where a dense layer has 4 -- 29 W's per microbatch instead of
    fp32's 17 (+ output layer); its q/kv layernorms compute their weight gradients in B, as every norm (bitwise
    equal in test_matrix_column)."""
    matrix.column(feature("mla"))
    for fam in ALL_FAMILIES:
        got, base = matrix.results[("mla", fam)]["w_deferred"], matrix.results[("fp32", fam)]["w_deferred"]
        assert got * 17 == base * 29, f"{fam}: {got} W computations with MLA, {base} without"
        assert (got > 0) == get_spec(fam).split_backward, fam


def test_deepseek_moe_defers_shared_experts_and_updates_the_expert_bias(matrix):
    """DeepSeek's MoE: a split-backward family queues the shared expert's two linears too -- per microbatch
    the dense layer 0 has 4 routed linears, each of the 3 MoE layers 2 + 8 (experts) + 2 (shared expert; the
    router's and the shared-expert gate's gradients come in B), plus the output layer: 41 W's where fp32 has
    17. The routers' expert biases moved from 0 over the 2 iterations (finalize_model_grads, after the last W;
    at least one layer's) and, compared with the parameters, equal megatron-core's bitwise (test_matrix_column)."""
    matrix.column(feature("deepseek-moe"))
    for fam in ALL_FAMILIES:
        got, base = matrix.results[("deepseek-moe", fam)]["w_deferred"], matrix.results[("fp32", fam)]["w_deferred"]
        assert got * 17 == base * 41, f"{fam}: {got} W computations with DeepSeek's MoE, {base} dense"
        biases = {k[0]: b for k, b in matrix.results[("deepseek-moe", fam)]["params"].items()
                  if k[0].endswith(".expert_bias")}
        assert sorted(biases) == [f"decoder.layers.{i}.mlp.router.expert_bias" for i in (1, 2, 3)], fam
        # a layer's bias can come back to 0 (+rate, then -rate; a group's two experts always get the same
        # tokens with top-2 from 1 group of 2), but not every layer's
        assert any(b.abs().max() > 0 for b in biases.values()), f"{fam}: no expert bias moved"


def test_vocab_parallel_runs_each_familys_vocabulary_form(matrix):
    """The vocab-parallel column: the slices' weight gradient runs in T (the product's default), so each
    split-backward family queues exactly fp32's W computations less the output layer's one per microbatch
    (2 iterations x 4 microbatches = 8 fewer), the others none; zb-h2 is refused by name."""
    column = matrix.column(feature("vocab-parallel"))
    for fam in ALL_FAMILIES:
        if fam == "zb-h2":
            assert "'zb-h2' has no vocabulary-parallel form (no schedule 'zb-h2-vocab-1'" in column[fam].status
            continue
        got, base = matrix.results[("vocab-parallel", fam)]["w_deferred"], matrix.results[("fp32", fam)]["w_deferred"]
        want = base - 8 if get_spec(fam).split_backward else 0
        assert got == want and (base > 0) == get_spec(fam).split_backward, f"{fam}: {got} W, fp32's {base}"


def test_vocab_parallel_column_at_pp4():
    """The vocab-parallel column at PP=4 (8 layers, 8 microbatches; the V and interleaved placements: 8
    stages of 1 layer): every family's vocabulary form within the column's tolerance of megatron-core's
    schedule on the unsliced model; zb-h2 refused. The W count by hand (not fp32's PP=4 column: its
    launches are not run here): 4 linears x 8 layers x 8 microbatches x 2 iterations = 512 for a
    split-backward family, the output layer's weight gradient in T."""
    f = dataclasses.replace(feature("vocab-parallel"), same_w_as=None)
    model = ModelShape(pp=4, num_layers=8, num_microbatches=8)
    results, errors = run_launches(plan_launches([f], ALL_FAMILIES, model), timeout=300)
    assert not errors, errors
    cells = {c.family: c for c in classify([f], ALL_FAMILIES, results, errors, model)}
    wrong = {fam: c.status for fam, c in cells.items() if c.kind != EXPECTED[(fam, "vocab-parallel")]}
    assert not wrong, wrong
    for fam, c in cells.items():
        if c.kind == "refused":
            continue
        assert 0.0 < c.max_rel <= 5e-6 and 0.0 < c.max_rel_after_step <= 2e-2, (fam, c.status)
        assert results[(f.name, fam)]["w_deferred"] == (512 if get_spec(fam).split_backward else 0), fam


# ---------------------------------------------------------------------- execution order vs megatron-core
def _orders(results: dict, feature_name: str, arm: str) -> list[list[tuple[str, int, int]]]:
    return results[(feature_name, arm)]["order"]


@pytest.mark.parametrize("placement,family", [("plain", "1f1b"), ("interleaved", "interleaved-1f1b")])
def test_execution_order_equals_megatron_core_pp2(matrix, placement, family):
    """Per rank, the sequence of (F or B, local chunk, microbatch) over both iterations is
    megatron-core's, read from instrumented forward/backward steps of the same run."""
    matrix.column(feature("fp32"))
    ref, got = _orders(matrix.results, "fp32", f"ref:{placement}"), _orders(matrix.results, "fp32", family)
    assert got == ref
    chunks = 2 if placement == "interleaved" else 1
    per_iteration = 2 * chunks * ModelShape().num_microbatches
    assert all(len(r) == 2 * per_iteration for r in ref)  # every F and B of both iterations was seen
    if chunks == 2:  # the interleaved order really mixes the chunks
        assert {c for _, c, _ in ref[0][:per_iteration // 2]} == {0, 1}


def test_interleaved_1f1b_pp4_equals_megatron_core_by_order_and_numerically():
    """PP=4, 2 chunks per rank, 8 microbatches: megatron-core's interleaved schedule and
    megatron-zb's interleaved-1f1b / interleaved-zb."""
    model = ModelShape(pp=4, num_layers=8, num_microbatches=8)
    f = feature("fp32")
    results, errors = run_launches(plan_launches([f], ["interleaved-1f1b", "interleaved-zb"], model), timeout=300)
    assert not errors, errors
    cells = classify([f], ["interleaved-1f1b", "interleaved-zb"], results, errors)
    assert [c.status for c in cells] == ["equal (bitwise)"] * 2
    ref, got = _orders(results, "fp32", "ref:interleaved"), _orders(results, "fp32", "interleaved-1f1b")
    assert len(ref) == 4 and got == ref


# ---------------------------------------------------------------------- refusal and failure modes
def test_a_refused_cell_reports_the_message():
    """6 layers: the plain placement (2 stages) runs, the V (4 stages) is refused while building."""
    f = feature("fp32")
    model = ModelShape(num_layers=6)
    results, errors = run_launches(plan_launches([f], ["zb", "zbv"], model), timeout=300)
    cells = {c.family: c for c in classify([f], ["zb", "zbv"], results, errors)}
    assert cells["zb"].status == "equal (bitwise)"
    assert cells["zbv"].kind == "refused"
    assert "6 layers do not divide evenly over 4 stages" in cells["zbv"].status


def _fake(**over) -> dict:
    base = {"refused": None, "losses": {(0, 0, 0): [torch.tensor(1.0)]}, "steps": [[(True, 1.0)]],
            "grads": {(0, "w", 0, 0): torch.tensor([1.0, -2.0])}, "params": {("w", 0, 0): torch.tensor([3.0, 4.0])},
            "order": [], "w_deferred": 8, "rollbacks": 0}
    return {**base, **over}


def test_compare_classifies_each_failure():
    f = Feature("x", "test")
    ref = _fake()
    assert compare("zb", f, "plain", ref, _fake()).status == "equal (bitwise)"
    off = _fake(grads={(0, "w", 0, 0): torch.tensor([1.0, -2.0 * (1 + 2 ** -20)])})
    c = compare("zb", f, "plain", ref, off)
    assert c.kind == "failed" and "grads" in c.status and c.max_rel == pytest.approx(2 ** -20, rel=1e-3)
    loose = dataclasses.replace(f, tolerance={"plain": feature("pv-inplace").tolerance["plain"]})
    assert compare("zb", loose, "plain", ref, off).kind == "tolerance"
    assert compare("zb", f, "plain", ref, _fake(w_deferred=0)).status.startswith("FAILED: vacuous")
    assert compare("1f1b", f, "plain", ref, _fake(w_deferred=0)).kind == "bitwise"
    assert compare("zb", f, "plain", ref, _fake(steps=[[(False, 0.5)]])).status.startswith("FAILED: step results")
    assert compare("zb", f, "plain", ref, _fake(params={})).status.startswith("FAILED: params differ in their keys")
    assert compare("zb", f, "plain", ref, _fake(refused="ValueError: no")).status == "refused: ValueError: no"
    recompute = dataclasses.replace(f, same_w_as="fp32")
    assert compare("zb", recompute, "plain", ref, _fake(), w_baseline=8).kind == "bitwise"
    c = compare("zb", recompute, "plain", ref, _fake(), w_baseline=9)
    assert c.status == "FAILED: vacuous: 8 deferred weight-gradient computations, 9 in the same family's 'fp32' cell"
    vocab = dataclasses.replace(f, tolerance={"plain": Tolerance(1e-7, "why", after_step=1e-3)})
    later = {(1, "w", 0, 0): torch.tensor([1.0, -2.0 * (1 + 2 ** -12)])}  # 1.2e-4 after a step
    c = compare("zb", vocab, "plain", _fake(grads={**ref["grads"], (1, "w", 0, 0): torch.tensor([1.0, -2.0])}),
                _fake(grads={**ref["grads"], **later}))
    assert c.kind == "tolerance" and c.max_rel == 0.0 and c.max_rel_after_step == pytest.approx(2 ** -12, rel=1e-3)
    assert c.status == "equal (<= 1e-07; after a step <= 0.001, why)"
    c = compare("zb", vocab, "plain", ref, off)  # the first iteration's gradient (9.5e-7): 1e-7 still applies
    assert c.kind == "failed"
    assert c.status.startswith("FAILED: max relative difference (tolerance 1e-07, after a step 0.001): grads 9.54e-07")
    pv = dataclasses.replace(f, post_validation="exact")
    assert "never rolled back" in compare("zb", pv, "plain", ref, _fake()).status


def test_script_writes_the_table(tmp_path):
    """The script end to end, once (the megatron-core 0.16.1 suite): its runner code is the one the matrix
    columns above run on both releases."""
    from megatron_zb.megatron_compat import release

    if release() != "0.16":
        pytest.skip("the script end to end runs in the megatron-core 0.16.1 suite (the runner: every column, both releases)")
    out = tmp_path / "compat.md"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "compat_matrix.py"), "--features", "fp32",
                           "--families", "1f1b,zbv", "--out", str(out)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    md = out.read_text()
    assert "| `1f1b` | equal (bitwise) |" in md and "| `zbv` | equal (bitwise) |" in md
    assert "command: `python scripts/compat_matrix.py --features fp32 --families 1f1b,zbv --out" in md
    assert "[2/3] fp32 / v (PP=1" in proc.stderr and "2 cells, 0 failed" in proc.stderr
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "compat_matrix.py"), "--features", "nope"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "unknown feature 'nope'" in bad.stderr


def test_script_refuses_a_pipeline_size_below_2(capsys):
    """``--pp`` (docs/compatibility_pp4.md is ``--pp 4``'s page; not run here: the PP=4 column's cells run in
    test_vocab_parallel_column_at_pp4): below 2 refused by name, exit 2, before any launch (in this process)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("compat_matrix_script", ROOT / "scripts" / "compat_matrix.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with pytest.raises(SystemExit) as e:
        script.main(["--pp", "1", "--features", "vocab-parallel"])
    assert e.value.code == 2 and "--pp 1: the pipeline size must be at least 2" in capsys.readouterr().err

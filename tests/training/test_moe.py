"""Mixture of experts: flags, layer pattern, expert seeding, W deferred in experts, loss parity.

Loss curves: the trainer of ``pretrain_gpt_zb.py`` on its command line, in-process
(``test_pretrain.in_process``: gloo, CPU, fp32, mock data, a 4-layer MoE GPT with a dense layer
among the MoE ones, top-2 of 4 experts, aux loss 1e-2; the Mixtral example below runs the script
itself under torchrun). Every iteration's lm loss and grad norm of ``--enable-zero-bubble``,
``--schedule zb-2p`` and ``--zero-bubble-v-schedule`` are compared with megatron-core's own 1F1B
(``--use-megatron-core-schedule``) on the same flags at PP=2 (allgather dispatcher, and
``--position-embedding-type none``: that flag's parity test). Bitwise for the plain placement; for V within
1e-6 relative (the grad norm sums the same per-parameter norms in another order). DeepSeek's MoE at
PP=2 x DP=2 x EP=2 with the all-to-all dispatcher and multi-latent attention (the expert bias, updated after
each iteration from the token counts all-reduced over DP, decides the next iteration's routing, so every
later loss depends on it) is compared the same way in tests/training/test_deepseek_v3.py (zb, zb-2p,
interleaved-zb, zbv in one launch); :data:`DEEPSEEK` here serves the flag tests.

In-process (``run_distributed``): which parameters' weight gradients a split-backward schedule
queues for W (expert, shared-expert and dense linear weights: yes; the router and the shared-expert gate:
no, their gradients come in B), and
that expert weights depend on the global expert index only (not on the expert-parallel size).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from megatron_zb.testing import run_distributed
from megatron_zb.training.arguments import ArgumentError, parse_args, validate_args

from harness.pretrain_harness import in_process, losses, train  # the end-to-end tests' harness

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]

PATTERN = "[1,0,1,1]"  # layer 1 is dense
MOE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
       "--hidden-dropout", "0", "--attention-dropout", "0", "--disable-bias-linear",
       "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48",
       "--moe-aux-loss-coeff", "1e-2", "--moe-layer-freq", PATTERN,
       "--micro-batch-size", "2", "--train-iters", "4", "--lr", "2e-3", "--lr-warmup-iters", "1",
       "--mock-data", "--num-workers", "0", "--log-interval", "1", "--eval-iters", "0",
       "--distributed-backend", "gloo", "--pipeline-timeout-seconds", "60", "--distributed-timeout-minutes", "2",
       "--pipeline-model-parallel-size", "2"]
PP2 = MOE + ["--global-batch-size", "8", "--position-embedding-type", "none"]  # and no position embedding
DEEPSEEK = ["--moe-shared-expert-intermediate-size", "32", "--moe-router-score-function", "sigmoid",
            "--moe-router-num-groups", "2", "--moe-router-group-topk", "1", "--moe-router-enable-expert-bias",
            "--moe-router-bias-update-rate", "1e-2", "--moe-router-topk-scaling-factor", "2.5",
            "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-3"]
"""DeepSeek's MoE (issue 41): a shared expert, sigmoid router, group-limited top-k (one group of 2 experts per
token: with EP=2, one expert-parallel rank), expert bias, top-k scaling factor, sequence aux loss."""
SCHEDULES = {"zb": ["--enable-zero-bubble"], "zb-2p": ["--schedule", "zb-2p"], "zbv": ["--zero-bubble-v-schedule"]}
LAYOUTS = {"pp2": (2, PP2)}


class MoERuns:
    """Each (layout, schedule) run once per module, on first use."""

    def __init__(self, root: Path) -> None:
        self.root, self.done = root, {}

    def get(self, layout: str, schedule: str) -> dict:
        key = f"{layout}-{schedule}"
        if key not in self.done:
            nproc, argv = LAYOUTS[layout]
            flags = ["--use-megatron-core-schedule"] if schedule == "ref" else SCHEDULES[schedule]
            self.done[key] = in_process(self.root, key, nproc, argv + flags)
        return self.done[key]


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory) -> MoERuns:
    return MoERuns(tmp_path_factory.mktemp("moe"))


@pytest.mark.parametrize("layout,schedule", [("pp2", "zb"), ("pp2", "zb-2p"), ("pp2", "zbv")])
def test_moe_loss_curve_equals_megatron_core_1f1b(moe_runs, layout, schedule):
    ref, got = moe_runs.get(layout, "ref"), moe_runs.get(layout, schedule)
    assert sorted(losses(got)) == [1, 2, 3, 4] and sorted(losses(ref)) == [1, 2, 3, 4]
    for a, b in zip(train(got), train(ref)):
        if schedule == "zbv":
            assert a["lm loss"] == pytest.approx(b["lm loss"], rel=1e-6, abs=0)
            assert a["grad norm"] == pytest.approx(b["grad norm"], rel=1e-6, abs=0)
        else:
            assert (a["lm loss"], a["grad norm"]) == (b["lm loss"], b["grad norm"]), f"iteration {a['iteration']}"
    assert len({r["lm loss"] for r in train(ref)}) == 4  # the model trains: every iteration's loss differs


# ---------------------------------------------------------------------------- in-process
def _moe_chunks(*, pp: int, ep: int, pattern: list[int], **extra) -> list:
    from megatron_zb.model import build_gpt_chunks, cpu_gpt_config
    from megatron_zb.testing import init_parallel_state
    from megatron_zb.training.moe_setup import moe_layer_spec
    from megatron_zb.training.run_config import MoEConfig

    init_parallel_state(pipeline_model_parallel_size=pp, expert_model_parallel_size=ep)
    config = cpu_gpt_config(num_layers=len(pattern), hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                            attention_dropout=0.0, pipeline_model_parallel_size=pp, add_bias_linear=False,
                            num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_aux_loss_coeff=1e-2,
                            expert_model_parallel_size=ep, moe_layer_freq=pattern, **extra)
    spec = moe_layer_spec(MoEConfig(num_experts=4, moe_layer_pattern=tuple(pattern)))
    return build_gpt_chunks(config=config, vocab_size=128, max_sequence_length=32, stage_to_rank=list(range(pp)),
                            seed=1234, layer_spec=spec)


def _queued_for_w(schedule: str) -> dict:
    """Run one zero-bubble step on a PP=2 MoE model; name the parameters whose W work was queued."""
    from megatron_zb.model import named_global_parameters
    from megatron_zb.runtime import get_forward_backward_func
    from megatron_zb.testing.tiny_gpt import forward_backward, random_microbatches

    chunks = _moe_chunks(pp=2, ep=1, pattern=[1, 0, 1, 1], moe_shared_expert_intermediate_size=32,
                         moe_shared_expert_gate=True)
    names = {id(p): n for c in chunks for n, p in named_global_parameters(c)}
    fb = get_forward_backward_func(schedule)
    queued: set[str] = set()
    real_put = fb.store.put

    def put(fn, *, params):
        queued.update(names[id(p)] for p in params)
        real_put(fn, params=params)

    fb.store.put = put
    data = random_microbatches(4, vocab=128, micro_batch=2, seq=32, seed=7)
    forward_backward(fb, [c.module for c in chunks], data, seq=32, micro_batch=2)
    grads = {n: p.grad is not None and bool(p.grad.abs().sum() > 0) for c in chunks
             for n, p in named_global_parameters(c)}
    return {"queued": queued, "has_grad": grads, "executed": fb.store.executed}


def test_split_backward_defers_expert_weight_gradients_and_not_the_router():
    """With a gated shared expert: its two linears are deferred too; its gate, like the router, is not."""
    ranks = run_distributed(partial(_queued_for_w, "zb"), world_size=2, timeout=180)
    queued = set().union(*(r["queued"] for r in ranks))
    has_grad = {k: v for r in ranks for k, v in r["has_grad"].items()}
    experts = {n for n in has_grad if ".mlp.experts.local_experts." in n}
    assert len(experts) == 3 * 4 * 2  # 3 MoE layers x 4 experts x (fc1, fc2)
    assert experts <= queued, f"expert weights not deferred to W: {sorted(experts - queued)}"
    assert {"decoder.layers.1.mlp.linear_fc1.weight", "decoder.layers.1.mlp.linear_fc2.weight"} <= queued
    shared = {n for n in has_grad if ".mlp.shared_experts.linear_fc" in n}
    assert len(shared) == 3 * 2 and shared <= queued, f"shared experts not deferred: {sorted(shared - queued)}"
    routers = {n for n in has_grad if n.endswith((".mlp.router.weight", ".mlp.shared_experts.gate_weight"))}
    assert routers == {f"decoder.layers.{i}.mlp.{w}" for i in (0, 2, 3)
                       for w in ("router.weight", "shared_experts.gate_weight")}
    assert not routers & queued and all(has_grad[n] for n in routers)  # router and gate: gradient in B
    assert all(has_grad[n] for n in experts)  # W ran: every expert got tokens and a gradient
    assert sum(r["executed"] for r in ranks) > 0


def _expert_weights(*, ep: int, where: str = "decoder") -> dict[str, torch.Tensor]:
    """Expert weights of decoder layer 0 (``where="mtp"``: of the multi-token prediction layer's MoE MLP)
    keyed by global expert index (this rank's local experts), and its gated shared expert's (every rank's
    copy)."""
    mtp = {"mtp_num_layers": 1} if where == "mtp" else {}
    [chunk] = _moe_chunks(pp=1, ep=ep, pattern=[1, 1], moe_shared_expert_intermediate_size=32,
                          moe_shared_expert_gate=True, **mtp)
    if mtp:
        from megatron_zb.model.mtp import inner_layer_name

        layer = getattr(chunk.module.mtp.layers[0], inner_layer_name(chunk.module.mtp.layers[0].submodules))
    else:
        layer = chunk.module.decoder.layers[0]
    moe = layer.mlp
    shared = {f"shared.{n}": p.detach().clone() for n, p in moe.shared_experts.named_parameters()}
    return {**shared, **{f"{e}.{k}": getattr(x, k).weight.detach().clone()
                         for e, x in zip(moe.local_expert_indices, moe.experts.local_experts)
                         for k in ("linear_fc1", "linear_fc2")}}


@pytest.mark.parametrize("where", ["decoder", "mtp"])
def test_expert_weights_depend_on_the_global_expert_only(where):
    """Also the shared expert's (megatron-core builds it after the local experts, whose number depends on
    the expert-parallel size); the MTP layer's MoE MLP (the decoder's last layer's kind, as megatron-core's)
    likewise, drawn from its own seeds (not decoder layer 0's)."""
    [one] = run_distributed(partial(_expert_weights, ep=1, where=where), world_size=1, timeout=120)
    two = run_distributed(partial(_expert_weights, ep=2, where=where), world_size=2, timeout=120)
    shared = [f"shared.{n}" for n in ("gate_weight", "linear_fc1.weight", "linear_fc2.weight")]
    assert sorted(two[0]) == [f"{e}.{k}" for e in (0, 1) for k in ("linear_fc1", "linear_fc2")] + shared
    assert all(torch.equal(two[0][k], two[1][k]) for k in shared)
    merged = {**two[0], **two[1]}
    assert merged.keys() == one.keys()
    assert all(torch.equal(merged[k], one[k]) for k in one)
    assert not torch.equal(one["0.linear_fc1"], one["1.linear_fc1"])  # experts differ from one another
    if where == "mtp":
        [decoder] = run_distributed(partial(_expert_weights, ep=1), world_size=1, timeout=120)
        assert not any(torch.equal(decoder[k], one[k]) for k in one)


# ---------------------------------------------------------------------------- flags
BASE = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--train-iters 2 --lr 1e-4 --mock-data --disable-bias-linear --num-experts 4")


def resolve(extra: str, *, world_size: int = 1):
    return validate_args(parse_args(shlex.split(BASE + " " + extra)), world_size=world_size)


def test_moe_defaults_follow_megatron():
    args = resolve("--ffn-hidden-size 96")
    assert (args.moe_router_topk, args.moe_ffn_hidden_size, args.moe_aux_loss_coeff) == (2, 96, 0.0)
    assert (args.moe_router_load_balancing_type, args.moe_token_dispatcher_type) == ("aux_loss", "allgather")
    assert args.moe_layer_pattern == [1, 1, 1, 1] and args.expert_model_parallel_size == 1
    assert resolve("--moe-layer-freq 2").moe_layer_pattern == [1, 0, 1, 0]
    assert resolve("--moe-layer-freq ([0]+[1]*3)").moe_layer_pattern == [0, 1, 1, 1]
    assert resolve("--moe-aux-loss-coeff 0.01").moe_aux_loss_coeff == 0.01  # one-element list -> float


def test_deepseek_moe_flags_reach_the_transformer_config():
    """Megatron-LM's defaults, and every DeepSeek flag in megatron-core's TransformerConfig under its own name."""
    from megatron_zb.training.run_config import MoEConfig

    default = MoEConfig.from_args(resolve("")).transformer_config_kwargs(expert_model_parallel_size=1)
    assert {k: default[k] for k in ("moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
                                    "moe_router_score_function", "moe_router_num_groups", "moe_router_group_topk",
                                    "moe_router_enable_expert_bias", "moe_router_bias_update_rate",
                                    "moe_router_pre_softmax", "moe_router_topk_scaling_factor")} == {
        "moe_shared_expert_intermediate_size": None, "moe_shared_expert_gate": False,
        "moe_router_score_function": "softmax", "moe_router_num_groups": None, "moe_router_group_topk": None,
        "moe_router_enable_expert_bias": False, "moe_router_bias_update_rate": 1e-3,
        "moe_router_pre_softmax": False, "moe_router_topk_scaling_factor": None}
    args = resolve(" ".join(DEEPSEEK) + " --moe-shared-expert-gate --moe-router-pre-softmax")
    got = MoEConfig.from_args(args).transformer_config_kwargs(expert_model_parallel_size=1)
    assert {k: got[k] for k in default if got[k] != default[k]} == {
        "moe_shared_expert_intermediate_size": 32, "moe_shared_expert_gate": True,
        "moe_router_score_function": "sigmoid", "moe_router_num_groups": 2, "moe_router_group_topk": 1,
        "moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": 1e-2,
        "moe_router_pre_softmax": True, "moe_router_topk_scaling_factor": 2.5,
        "moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 1e-3}


@pytest.mark.parametrize("extra,world,flag", [
    ("--moe-shared-expert-intermediate-size 0", 1, "--moe-shared-expert-intermediate-size"),
    ("--moe-shared-expert-gate", 1, "--moe-shared-expert-gate"),  # no shared expert to gate
    ("--moe-router-enable-expert-bias", 1, "--moe-router-enable-expert-bias"),  # softmax scores
    ("--moe-router-group-topk 1", 1, "--moe-router-num-groups"),
    ("--moe-router-group-topk 1 --moe-router-num-groups 3", 1, "--moe-router-num-groups"),  # 3 does not divide 4
    ("--moe-router-group-topk 3 --moe-router-num-groups 4", 1, "--moe-router-group-topk"),  # > top-k 2
    ("--moe-router-group-topk 1 --moe-router-num-groups 4", 1, "--moe-router-topk"),  # 2 experts from 1 group of 1
    ("--moe-router-topk 1", 1, "--moe-router-pre-softmax"),  # top-1 softmax after top-k: zero gradient
    ("--moe-grouped-gemm", 1, "--moe-grouped-gemm"),
    ("--moe-router-topk 5", 1, "--moe-router-topk"),
    ("--expert-model-parallel-size 3", 3, "--expert-model-parallel-size"),  # 3 does not divide 4 experts
    ("--expert-model-parallel-size 2", 1, "--expert-model-parallel-size"),  # DP 1
    ("--moe-layer-freq [1,0]", 1, "--moe-layer-freq"),  # 2 entries for 4 layers
    ("--moe-layer-freq [0,0,0,0]", 1, "--moe-layer-freq"),
    ("--moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff 0.1", 1, "--moe-aux-loss-coeff"),
])
def test_bad_moe_flags_name_the_flag(extra, world, flag):
    with pytest.raises(ArgumentError) as e:
        resolve(extra, world_size=world)
    assert e.value.flag == flag


@pytest.mark.parametrize("flag,why", [("--moe-shared-expert-overlap", "second CUDA stream"),
                                      ("--moe-router-force-load-balancing", "random logits")])
def test_refused_deepseek_flags_say_why(flag, why):
    with pytest.raises(ArgumentError) as e:
        resolve(flag)
    assert e.value.flag == flag and str(e.value).startswith(f"{flag} is refused: ") and why in str(e.value)


@pytest.mark.parametrize("extra", ["--moe-shared-expert-intermediate-size 32", "--moe-router-score-function sigmoid",
                                   "--moe-router-pre-softmax", "--moe-router-topk-scaling-factor 2",
                                   "--moe-router-bias-update-rate 1e-2"])
def test_deepseek_flags_need_a_moe_model(extra):
    with pytest.raises(ArgumentError) as e:
        validate_args(parse_args(shlex.split(BASE.replace(" --num-experts 4", "") + " " + extra)), world_size=1)
    assert e.value.flag == extra.split()[0] and "only applies to a MoE model" in str(e.value)


def test_score_functions_follow_the_installed_release():
    """sqrtsoftplus is megatron-core 0.19's (megatron_compat.ROUTER_SCORE_FUNCTIONS); on 0.16.1 it is refused
    naming the release; the expert bias takes it there."""
    from megatron_zb.megatron_compat import router_score_functions

    for score in ("softmax", "sigmoid", "sqrtsoftplus"):
        extra = f"--moe-router-score-function {score}"
        if score in router_score_functions():
            assert resolve(extra).moe_router_score_function == score
        else:
            with pytest.raises(ArgumentError) as e:
                resolve(extra)
            assert e.value.flag == "--moe-router-score-function" and "needs megatron-core 0.19" in str(e.value)
    assert router_score_functions()[:2] == ("softmax", "sigmoid")


def test_moe_with_biases_at_ep1_asks_for_disable_bias_linear():
    with pytest.raises(ArgumentError) as e:
        validate_args(parse_args(shlex.split(BASE.replace("--disable-bias-linear ", ""))), world_size=1)
    assert e.value.flag == "--disable-bias-linear"


def test_grouped_gemm_on_cpu_exits_2_with_one_line(tmp_path):
    from harness.pretrain_harness import SCRIPT

    proc = subprocess.run([sys.executable, str(SCRIPT), *shlex.split(BASE), "--moe-grouped-gemm"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and "--moe-grouped-gemm: grouped-GEMM experts need CUDA" in errors[0]


# ---------------------------------------------------------------------------- the Mixtral example
def test_mixtral_example_cpu_scale_down_trains(tmp_path):
    """scripts/examples/mixtral_8x7b_zb_cpu.sh (the GPU script's flags at tiny sizes, PP=2 x EP=2)."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "examples" / "mixtral_8x7b_zb_cpu.sh"
    proc = subprocess.run(["bash", str(script), "--loss-log-json", str(tmp_path / "values.json")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, ITERS="3"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    values = json.loads((tmp_path / "values.json").read_text())["train"]
    assert [r["iteration"] for r in values] == [1, 2, 3]
    assert all(r["lm loss"] == r["lm loss"] and r["grad norm"] > 0 for r in values)  # finite, trained
    assert "throughput per GPU (TFLOP/s/GPU):" in proc.stdout

"""Mixture of experts: flags, layer pattern, expert seeding, W deferred in experts, loss parity.

Loss curves: the trainer of ``pretrain_gpt_zb.py`` on its command line, in-process
(``test_pretrain.in_process``: gloo, CPU, fp32, mock data, a 4-layer MoE GPT with a dense layer
among the MoE ones, top-2 of 4 experts, aux loss 1e-2; the Mixtral example below runs the script
itself under torchrun). Every iteration's lm loss and grad norm of ``--enable-zero-bubble``,
``--schedule zb-2p`` and ``--zero-bubble-v-schedule`` are compared with megatron-core's own 1F1B
(``--use-megatron-core-schedule``) on the same flags: at PP=2 (allgather dispatcher, and
``--position-embedding-type none``: that flag's parity test), at PP=2 x EP=2 (4 processes,
alltoall dispatcher) and at PP=2 with DeepSeek-style multi-latent attention (``--multi-latent-attention``
and its flags: issue 41's end-to-end check). Bitwise for the plain placement; for V within 1e-6 relative (the grad norm
sums the same per-parameter norms in another order).

In-process (``run_distributed``): which parameters' weight gradients a split-backward schedule
queues for W (expert and dense linear weights: yes; the router: no, its gradient comes in B), and
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
PP2_EP2 = MOE + ["--global-batch-size", "16", "--expert-model-parallel-size", "2",
                 "--moe-token-dispatcher-type", "alltoall"]
PP2_MLA = MOE + ["--global-batch-size", "8", "--position-embedding-type", "rope", "--multi-latent-attention",
                 "--q-lora-rank", "16", "--kv-lora-rank", "8", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4",
                 "--v-head-dim", "8", "--qk-layernorm", "--normalization", "RMSNorm"]
"""DeepSeek-style layers (issue 41): multi-latent attention (YaRN RoPE, q/kv RMSNorm) with the MoE MLPs."""
SCHEDULES = {"zb": ["--enable-zero-bubble"], "zb-2p": ["--schedule", "zb-2p"], "zbv": ["--zero-bubble-v-schedule"]}
LAYOUTS = {"pp2": (2, PP2), "pp2_ep2": (4, PP2_EP2), "pp2_mla": (2, PP2_MLA)}


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


@pytest.mark.parametrize("layout,schedule", [("pp2", "zb"), ("pp2", "zb-2p"), ("pp2", "zbv"),
                                             ("pp2_ep2", "zb"), ("pp2_ep2", "zbv"), ("pp2_mla", "zb"),
                                             ("pp2_mla", "zbv")])
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
def _moe_chunks(*, pp: int, ep: int, pattern: list[int]) -> list:
    from megatron_zb.model import build_gpt_chunks, cpu_gpt_config
    from megatron_zb.testing import init_parallel_state
    from megatron_zb.training.moe_setup import moe_layer_spec
    from megatron_zb.training.run_config import MoEConfig

    init_parallel_state(pipeline_model_parallel_size=pp, expert_model_parallel_size=ep)
    config = cpu_gpt_config(num_layers=len(pattern), hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                            attention_dropout=0.0, pipeline_model_parallel_size=pp, add_bias_linear=False,
                            num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_aux_loss_coeff=1e-2,
                            expert_model_parallel_size=ep, moe_layer_freq=pattern)
    spec = moe_layer_spec(MoEConfig(num_experts=4, moe_layer_pattern=tuple(pattern)))
    return build_gpt_chunks(config=config, vocab_size=128, max_sequence_length=32, stage_to_rank=list(range(pp)),
                            seed=1234, layer_spec=spec)


def _queued_for_w(schedule: str) -> dict:
    """Run one zero-bubble step on a PP=2 MoE model; name the parameters whose W work was queued."""
    from megatron_zb.model import named_global_parameters
    from megatron_zb.runtime import get_forward_backward_func
    from megatron_zb.testing.tiny_gpt import forward_backward, random_microbatches

    chunks = _moe_chunks(pp=2, ep=1, pattern=[1, 0, 1, 1])
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
    ranks = run_distributed(partial(_queued_for_w, "zb"), world_size=2, timeout=180)
    queued = set().union(*(r["queued"] for r in ranks))
    has_grad = {k: v for r in ranks for k, v in r["has_grad"].items()}
    experts = {n for n in has_grad if ".mlp.experts.local_experts." in n}
    assert len(experts) == 3 * 4 * 2  # 3 MoE layers x 4 experts x (fc1, fc2)
    assert experts <= queued, f"expert weights not deferred to W: {sorted(experts - queued)}"
    assert {"decoder.layers.1.mlp.linear_fc1.weight", "decoder.layers.1.mlp.linear_fc2.weight"} <= queued
    routers = {n for n in has_grad if n.endswith(".mlp.router.weight")}
    assert routers == {f"decoder.layers.{i}.mlp.router.weight" for i in (0, 2, 3)}
    assert not routers & queued and all(has_grad[n] for n in routers)  # router: gradient in B
    assert all(has_grad[n] for n in experts)  # W ran: every expert got tokens and a gradient
    assert sum(r["executed"] for r in ranks) > 0


def _expert_weights(*, ep: int) -> dict[str, torch.Tensor]:
    """Expert weights of layer 0 keyed by global expert index (this rank's local experts)."""
    [chunk] = _moe_chunks(pp=1, ep=ep, pattern=[1, 1])
    moe = chunk.module.decoder.layers[0].mlp
    return {f"{e}.{k}": getattr(x, k).weight.detach().clone()
            for e, x in zip(moe.local_expert_indices, moe.experts.local_experts) for k in ("linear_fc1", "linear_fc2")}


def test_expert_weights_depend_on_the_global_expert_only():
    [one] = run_distributed(partial(_expert_weights, ep=1), world_size=1, timeout=120)
    two = run_distributed(partial(_expert_weights, ep=2), world_size=2, timeout=120)
    assert sorted(two[0]) == [f"{e}.{k}" for e in (0, 1) for k in ("linear_fc1", "linear_fc2")]
    merged = {**two[0], **two[1]}
    assert merged.keys() == one.keys()
    assert all(torch.equal(merged[k], one[k]) for k in one)
    assert not torch.equal(one["0.linear_fc1"], one["1.linear_fc1"])  # experts differ from one another


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


@pytest.mark.parametrize("extra,world,flag", [
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

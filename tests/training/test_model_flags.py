"""Megatron-LM's architecture, tied-embedding, recomputation, uneven-split and per-token-loss flags.

Two levels:

* one forward/backward of a tiny LLaMA-style GPT (:class:`~megatron_zb.testing.TinyGPT`, in
  ``run_distributed``): every parameter's gradient and the losses of ``zb``, ``zb-2p`` and ``zbv``
  against megatron-core's own 1F1B on the same model -- bitwise for the plain placement, 1e-6
  relative for V -- and the weight-gradient store's counters (W really deferred, also inside
  recomputed layers: exactly as many W entries as without recomputation);
* ``pretrain_gpt_zb.py`` under torchrun with the flags themselves (``scripts/examples``'s CPU
  version of the LLaMA-3-8B-style script): every iteration's lm loss and grad norm of the three
  zero-bubble schedules equals ``--use-megatron-core-schedule``'s.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_zb.model import pipeline_split
from megatron_zb.schedules.registry import get_spec
from megatron_zb.testing import run_distributed
from megatron_zb.testing.compat_features import LLAMA, MLA
from megatron_zb.testing.distributed import cpu_run_env
from megatron_zb.testing.tiny_gpt import TinyGPT, run_step

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def llama(*, pp: int = 2, recompute: dict[str, Any] | None = None, split: dict[str, Any] | None = None,
          per_token: bool = False, tied: bool = True, num_layers: int = 6, mtp: int | None = None, **kw: Any) -> TinyGPT:
    """A tiny LLaMA-style model (RMSNorm, SwiGLU, RoPE, GQA, no biases, QK-norm), DDP + finalize_model_grads;
    ``mtp``: multi-token prediction layers."""
    config = {**LLAMA["config_options"], **(recompute or {}), "calculate_per_token_loss": per_token,
              **({"mtp_num_layers": mtp} if mtp else {})}
    model = {**LLAMA["model_options"], "share_embeddings_and_output_weights": tied}
    return TinyGPT(pp=pp, ddp=True, num_layers=num_layers, hidden=32, heads=4, seq=16, vocab=64,
                   config_options=config, model_options=model, spec_options=LLAMA["spec_options"], split=split or {},
                   **kw)


_RUNS: dict[str, dict[str, Any]] = {}


def run(cfg: TinyGPT, schedule: str | None, **kw: Any) -> dict[str, Any]:
    """One step of ``cfg`` under ``schedule`` (None: megatron-core's 1F1B); each distinct run once per module."""
    key = repr((cfg, schedule, sorted(kw.items())))
    if key not in _RUNS:
        _RUNS[key] = TinyGPT.merge(run_distributed(partial(run_step, cfg, schedule=schedule, **kw),
                                                   world_size=cfg.pp, timeout=120))
    return _RUNS[key]


def assert_same(ref: dict, got: dict, *, bitwise: bool, what: str) -> None:
    """Losses and every gradient both runs have (V's tied head has no output_layer.weight of its own)."""
    assert len(got["losses"]) == len(ref["losses"]) > 0, what
    for a, b in zip(got["losses"], ref["losses"]):
        if bitwise:
            assert torch.equal(a, b), f"{what}: loss {a} != {b}"
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=0, msg=lambda m: f"{what} loss: {m}")
    common = ref["grads"].keys() & got["grads"].keys()
    assert "embedding.word_embeddings.weight" in common and len(common) >= len(ref["grads"]) - 1, what
    for n in sorted(common):
        a, b = got["grads"][n], ref["grads"][n]
        if bitwise:
            assert torch.equal(a, b), f"{what}: gradient of {n} differs (max {(a - b).abs().max()})"
        else:
            scale = b.abs().max().clamp_min(1e-30)
            assert (a - b).abs().max() <= 1e-6 * scale, f"{what}: gradient of {n} off by {(a - b).abs().max()}"


def check_schedules(cfg: TinyGPT, what: str, schedules: tuple[str, ...] = ("zb", "zb-2p", "zbv")) -> dict[str, int]:
    """Every schedule against megatron-core's 1F1B; returns the W entries each deferred."""
    ref = run(cfg, None)
    counts = {}
    for schedule in schedules:
        got = run(cfg, schedule)
        assert_same(ref, got, bitwise=schedule != "zbv", what=f"{what} {schedule}")
        if get_spec(schedule).split_backward:
            assert got["w_deferred"] > 0, f"{what} {schedule}: no weight gradient was deferred to W"
        counts[schedule] = got["w_deferred"]
    return counts


# ---------------------------------------------------------------------------- model level (TinyGPT)
def test_llama_architecture_tied_selective_recompute_per_token_pp2():
    """RMSNorm, SwiGLU, RoPE, GQA, no biases, QK-norm, tied embeddings, selective recomputation
    (core_attn + mlp + layernorm), per-token loss, uneven split: all schedules equal 1F1B."""
    recompute = dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp", "layernorm"])
    plain = check_schedules(llama(recompute=recompute, per_token=True, num_layers=7,
                                  split=dict(first_stage_layers=3)), "llama pp2 (plain split 3+4)",
                            schedules=("zb", "zb-2p"))
    v = check_schedules(llama(recompute=recompute, per_token=True, num_layers=7, split=dict(first_stage_layers=1)),
                        "llama pp2 V (1+2+2+2)", schedules=("zbv",))
    # Recomputation queues each linear's W exactly once: the same count as without it.
    base = check_schedules(llama(per_token=True, num_layers=7, split=dict(first_stage_layers=3)),
                           "llama pp2 no recompute", schedules=("zb",))
    assert plain["zb"] == plain["zb-2p"] == base["zb"]
    assert v["zbv"] == base["zb"]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_mtp_layers_defer_w_and_equal_1f1b(tied):
    """One MTP layer: every gradient and loss of zb and interleaved-zb (the MTP block in the last virtual
    chunk) equals megatron-core 1F1B's bit for bit, zbv's (the MTP block on rank 0 beside the first stage, one
    word-embedding parameter for both) to 1e-6 relative (the V sums the embedding's gradients in another order), and the MTP layer's five linears (projection, QKV,
    attention output, two MLP) each defer one W per micro batch. Untied, the output layer's second use
    (the MTP head) is summed into its first use's W entry; tied, the MTP stage's output layer computes its
    weight gradient in B (the word embedding's lookup gradient arrives there: one W entry fewer)."""
    cfg = llama(num_layers=4, tied=tied, mtp=1)
    counts = check_schedules(cfg, f"mtp pp2 tied={tied}", schedules=("zb", "interleaved-zb", "zbv"))
    base = run(llama(num_layers=4, tied=tied), "zb")
    extra = 4 if tied else 5
    assert {n: c - base["w_deferred"] for n, c in counts.items()} == dict.fromkeys(counts, extra * cfg.num_microbatches)


@pytest.mark.parametrize("method", ["uniform", "block"])
def test_full_recompute_and_tied_embeddings_pp4(method):
    """Full recomputation (CheckpointFunction re-runs the forward inside B) at PP=4, tied embeddings."""
    cfg = llama(pp=4, num_layers=8, num_microbatches=8,
                recompute=dict(recompute_granularity="full", recompute_method=method, recompute_num_layers=1))
    counts = check_schedules(cfg, f"pp4 full/{method}", schedules=("zb", "zbv"))
    base = run(llama(pp=4, num_layers=8, num_microbatches=8), "zb")
    assert counts["zb"] == counts["zbv"] == base["w_deferred"]


def test_untied_learned_absolute_interleaved_account_for_embedding_and_loss():
    """LayerNorm/GeLU GPT with learned positions, untied output layer, embedding and loss counted in
    the split; the interleaved placement (megatron-core's rule) and V."""
    cfg = TinyGPT(pp=2, ddp=True, num_layers=6, hidden=32, heads=4, seq=16, vocab=64,
                  config_options=dict(init_method_std=0.01, attention_softmax_in_fp32=True),
                  split=dict(account_for_embedding=True, account_for_loss=True))
    check_schedules(cfg, "untied account-for", schedules=("zb", "interleaved-zb", "zbv"))


def test_mla_up_projection_recompute_defers_every_w_once():
    """Multi-latent attention with ``--recompute-modules mla_up_proj core_attn`` (megatron-core re-runs the q/kv
    up projections and RoPE inside B): ``zb`` bitwise and ``zbv`` within 1e-6 of megatron-core's 1F1B, and as
    many W entries as MLA without recomputation (each projection's W queued once)."""
    def mla(**config: Any) -> TinyGPT:
        return TinyGPT(pp=2, ddp=True, num_layers=4, hidden=32, heads=4, seq=16, vocab=64,
                       config_options={**MLA["config_options"], **config}, model_options=MLA["model_options"],
                       spec_options=MLA["spec_options"])

    recompute = dict(recompute_granularity="selective", recompute_modules=["mla_up_proj", "core_attn"])
    counts = check_schedules(mla(**recompute), "mla up-projection recompute", schedules=("zb", "zbv"))
    base = run(mla(), "zb")
    assert counts["zb"] == counts["zbv"] == base["w_deferred"] > 0


def test_interleaved_tied_uneven():
    cfg = llama(num_layers=8, split=dict(first_stage_layers=2, last_stage_layers=6))
    check_schedules(cfg, "interleaved tied", schedules=("interleaved-1f1b", "interleaved-zb"))


def test_selective_recompute_zbv_activation_peak_within_1f1b():
    """ZB-V's measured activation peak (bytes saved for backward, max over ranks) stays within 1F1B's,
    with the loss counted as a layer of the last stage (``--account-for-loss-in-pipeline-split``,
    the same flag for both). Without it, V's rank 0 -- which also holds the loss stage -- peaks one
    micro batch's loss-head activations above 1F1B's rank 0 (+4.6% at these tiny sizes)."""
    cfg = llama(num_layers=7, num_microbatches=8, split=dict(account_for_loss=True),
                recompute=dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]))
    peaks = {}
    for schedule in ("1f1b", "zbv"):
        got = run(cfg, schedule, track_memory=True)
        peaks[schedule] = max(p for p in got["peak_bytes"] if p is not None)
    assert 0 < peaks["zbv"] <= peaks["1f1b"], peaks


# ---------------------------------------------------------------------------- the split rule
def _megatron_counts(num_layers: int, pp: int, vp: int | None, **fields: Any) -> list[int]:
    """megatron-core's own per-(vp stage, pp rank) layer counts, in stage order ``vp * pp + rank``."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=num_layers, hidden_size=8, num_attention_heads=2,
                            pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
                            pipeline_dtype=torch.float32, **fields)
    return [get_num_layers_to_build(cfg, vp_stage=v if vp else None, pp_rank=r)
            for v in range(vp or 1) for r in range(pp)]


@pytest.mark.parametrize("num_layers,pp,vp,ours,theirs", [
    (10, 4, None, dict(first_stage_layers=1, last_stage_layers=3), dict(num_layers_in_first_pipeline_stage=1,
                                                                         num_layers_in_last_pipeline_stage=3)),
    (9, 4, None, dict(first_stage_layers=3), dict(num_layers_in_first_pipeline_stage=3)),
    (12, 2, 2, dict(first_stage_layers=4), dict(num_layers_in_first_pipeline_stage=4)),
    (14, 4, None, dict(account_for_embedding=True, account_for_loss=True),
     dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)),
    (6, 2, 2, dict(account_for_embedding=True, account_for_loss=True),
     dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)),
])
def test_pipeline_split_follows_megatron_core(num_layers, pp, vp, ours, theirs):
    placement = [s % pp for s in range(pp * (vp or 1))]
    assert pipeline_split(num_layers=num_layers, stage_to_rank=placement, **ours) == \
        _megatron_counts(num_layers, pp, vp, **theirs)


def test_pipeline_split_v_is_per_stage_any_layer_count():
    v = [0, 1, 1, 0]
    assert pipeline_split(num_layers=7, stage_to_rank=v, first_stage_layers=1) == [1, 2, 2, 2]
    assert pipeline_split(num_layers=5, stage_to_rank=v, first_stage_layers=1, last_stage_layers=0) == [1, 2, 2, 0]
    with pytest.raises(ValueError, match="do not divide evenly"):
        pipeline_split(num_layers=8, stage_to_rank=v, first_stage_layers=1)


# ---------------------------------------------------------------------------- pretrain_gpt_zb.py
REPO = Path(__file__).resolve().parents[2]
CPU_EXAMPLE = REPO / "scripts" / "examples" / "llama3_8b_zb_cpu.sh"
SCHEDULE_FLAGS = {"mcore": "--use-megatron-core-schedule", "zb": "--enable-zero-bubble", "zb-2p": "--schedule zb-2p",
                  "zbv": "--zero-bubble-v-schedule"}


def _example_env(name: str, **extra: str) -> dict[str, str]:
    return cpu_run_env(SCHEDULE=SCHEDULE_FLAGS[name], ITERS="4", **extra)


def _example_run(name: str, tmp: Path) -> list[dict]:
    """The CPU example itself under torchrun; its per-iteration values."""
    out = tmp / f"{name}.json"
    proc = subprocess.run(["bash", str(CPU_EXAMPLE), "--loss-log-json", str(out)], cwd=tmp, capture_output=True,
                          text=True, timeout=300, env=_example_env(name))
    assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(out.read_text())["train"]


def _example_argv(name: str, tmp: Path) -> list[str]:
    """The command line the CPU example passes to ``pretrain_gpt_zb.py`` (its ``python`` replaced by a
    stub on ``PATH`` that records its arguments instead of launching)."""
    stub = tmp / "stub-bin" / "python"
    stub.parent.mkdir(exist_ok=True)
    stub.write_text('#!/bin/sh\nprintf "%s\\0" "$@" > "$ARGV_OUT"\n')
    stub.chmod(0o755)
    out = tmp / f"argv-{name}"
    env = _example_env(name, PATH=f"{stub.parent}{os.pathsep}{os.environ['PATH']}", ARGV_OUT=str(out))
    subprocess.run(["bash", str(CPU_EXAMPLE)], cwd=tmp, env=env, check=True, timeout=60)
    argv = out.read_text().split("\0")[:-1]
    return argv[argv.index("pretrain_gpt_zb.py") + 1:]


def test_llama_example_cpu_loss_curves_equal_megatron_core(tmp_path):
    """scripts/examples/llama3_8b_zb_cpu.sh (RMSNorm, SwiGLU, RoPE, GQA, no biases, untied, selective
    recomputation of core_attn+mlp+layernorm, uneven split, per-token loss): 4 iterations of every
    schedule; lm loss and grad norm of each iteration equal megatron-core 1F1B's (V: 1e-6 relative).
    The script runs under torchrun once (``--enable-zero-bubble``); megatron-core's 1F1B, ``zb-2p``
    and ``zbv`` run the trainer in-process on the exact command line the script passes."""
    from harness.trainer_run import in_process_many

    curves = {"zb": _example_run("zb", tmp_path)}
    runs = in_process_many(tmp_path, {name: _example_argv(name, tmp_path) for name in ("mcore", "zb-2p", "zbv")}, 2)
    curves.update({name: run["values"]["train"] for name, run in runs.items()})
    ref = curves["mcore"]
    assert [r["iteration"] for r in ref] == [1, 2, 3, 4]
    for name in ("zb", "zb-2p", "zbv"):
        got = curves[name]
        assert [r["iteration"] for r in got] == [1, 2, 3, 4], name
        for a, b in zip(got, ref):
            for key in ("lm loss", "grad norm"):
                if name == "zbv":
                    assert a[key] == pytest.approx(b[key], rel=1e-6), (name, a["iteration"], key)
                else:
                    assert a[key] == b[key], (name, a["iteration"], key, a[key], b[key])


MTP_KEYS = ("lm loss", "grad norm", "mtp_1 loss", "mtp_2 loss")


@pytest.mark.parametrize("tie", [[], ["--untie-embeddings-and-output-weights"]], ids=["tied", "untied"])
def test_mtp_pp2_curves_equal_megatron_core(tmp_path, tie):
    """``--mtp-num-layers 2`` at PP=2 (the MTP block on the last stage; the output layer used three
    times per micro batch, with tied embeddings also the MTP's embedding lookup): every iteration's lm
    loss, grad norm and MTP losses of zb, zb-2p and zb-h1 (untied: zb; the compatibility matrix's ``mtp``
    column runs every family untied) equal megatron-core 1F1B's bit for bit, zbv's (tied: the MTP block on rank
    0, one word-embedding parameter for the lookups of stage 0 and the MTP layers and the output layer's three
    uses) to 1e-6 relative (that parameter's gradients are summed in another order), and the iteration line logs
    ``mtp_1 loss`` / ``mtp_2 loss`` as Megatron-LM's does."""
    from harness.pretrain_harness import SMALL
    from harness.trainer_run import in_process_many

    argv = SMALL + ["--pipeline-model-parallel-size", "2", "--train-iters", "3", "--mtp-num-layers", "2",
                    "--mtp-loss-scaling-factor", "0.3", *tie]
    families = (("zb", ["--enable-zero-bubble"]), ("zb-2p", ["--schedule", "zb-2p"]), ("zb-h1", ["--schedule", "zb-h1"]),
                ("zbv", ["--zero-bubble-v-schedule"]))
    families = families if not tie else families[:1]  # untied: every family in the matrix's mtp column
    runs = in_process_many(tmp_path, {"mcore": argv + ["--use-megatron-core-schedule"],
                                      **{name: argv + flags for name, flags in families}}, 2)  # one launch
    ref = runs["mcore"]
    assert re.search(r"\| lm loss: \S+ \| mtp_1 loss: \S+ \| mtp_2 loss: \S+ \|", ref["log"]), ref["log"][-2000:]
    want = [[r[k] for k in MTP_KEYS] for r in ref["values"]["train"]]
    assert len(want) == 3 and all(v is not None for row in want for v in row), want
    for name, _ in families:
        got = [[r[k] for k in MTP_KEYS] for r in runs[name]["values"]["train"]]
        if name == "zbv":  # one word-embedding parameter on rank 0: its gradients summed in another order
            assert got == [pytest.approx(row, rel=1e-6) for row in want], f"{name}: {got} != megatron-core's {want}"
        else:
            assert got == want, f"{name}: {got} != megatron-core's {want}"


@pytest.mark.parametrize("schedule", ["--enable-zero-bubble", "--zero-bubble-v-schedule"], ids=["zb", "zbv"])
def test_mtp_checkpoint_resumes_bitwise(tmp_path, schedule):
    """``--mtp-num-layers 1`` with zb and zbv at PP=2, RoPE (tied: the MTP stage's word-embedding copy is saved
    as a replica of stage 0's; on the V the MTP chunk has no copy: the one parameter is saved once, by the first
    chunk; learned absolute positions are refused with ``--save``: megatron-core saves the MTP stage's own
    position table under stage 0's key): saved at iteration 2, resumed, iterations 3-4 equal the uninterrupted
    run's bit for bit."""
    from harness.pretrain_harness import SMALL, assert_resumes_at, in_process

    argv = SMALL + ["--pipeline-model-parallel-size", "2", "--train-iters", "4", "--mtp-num-layers", "1",
                    schedule, "--position-embedding-type", "rope"]
    full = in_process(tmp_path, "full", 2, argv + ["--save", str(tmp_path / "ckpt"), "--save-interval", "2"])
    assert_resumes_at(tmp_path, tmp_path / "ckpt", full, step=2, argv=argv)


# ---------------------------------------------------------------------------- bad input
MODEL_ARGS = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
              "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3", "--mock-data",
              "--pipeline-model-parallel-size", "2"]


@pytest.mark.parametrize("extra,flag", [
    (["--group-query-attention", "--num-query-groups", "3"], "--num-query-groups"),
    (["--position-embedding-type", "rope", "--rotary-percent", "1.5"], "--rotary-percent"),
    (["--position-embedding-type", "rope", "--rotary-percent", "0"], "--rotary-percent"),
    (["--decoder-first-pipeline-num-layers", "5"], "--decoder-first-pipeline-num-layers"),
    (["--zero-bubble-v-schedule", "--decoder-first-pipeline-num-layers", "2"], "--decoder-first-pipeline-num-layers"),
    (["--decoder-last-pipeline-num-layers", "1", "--account-for-loss-in-pipeline-split"],
     "--decoder-last-pipeline-num-layers"),
    (["--recompute-granularity", "full"], "--recompute-method"),
    (["--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj"], "--recompute-modules"),
    (["--recompute-method", "uniform"], "--recompute-method"),
    (["--mtp-num-layers", "0"], "--mtp-num-layers"),
    (["--mtp-num-layers", "1", "--save", "ckpt"], "--mtp-num-layers"),
    (["--multi-latent-attention", "--group-query-attention", "--num-query-groups", "2"], "--group-query-attention"),
    (["--multi-latent-attention", "--rotary-interleaved"], "--rotary-interleaved"),
    (["--multi-latent-attention", "--qk-pos-emb-head-dim", "5"], "--qk-pos-emb-head-dim"),
    (["--multi-latent-attention", "--kv-lora-rank", "0"], "--kv-lora-rank"),
    (["--multi-latent-attention", "--profile-out", "p.json", "--enable-zero-bubble"], "--profile-out"),
    (["--multi-latent-attention", "--transformer-impl", "transformer_engine"], "--transformer-impl"),
    (["--q-lora-rank", "16"], "--q-lora-rank"),
    (["--rope-type", "yarn"], "--rope-type"),
], ids=["gqa", "rotary-above-1", "rotary-0", "split-sum", "v-split-sum", "split-and-account", "full-no-method",
        "bad-module", "method-without-granularity", "mtp-0", "mtp-learned-positions-save", "mla-gqa",
        "mla-rotary-interleaved", "mla-odd-rope-dim", "mla-rank-0", "mla-profile-out", "mla-te", "mla-flag-without-mla",
        "yarn-without-mla"])
def test_bad_model_flags_exit_2_with_one_line(extra, flag, monkeypatch, capsys):
    import torch.distributed as dist

    from megatron_zb.training.pretrain import main

    for k, v in (("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(k, v)
    assert main(MODEL_ARGS + extra) == 2
    assert not dist.is_initialized()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pretrain_gpt_zb.py: error: {flag}:"), lines


def test_flags_reach_megatron_core_config():
    """Each flag lands in megatron-core's TransformerConfig / GPTModel arguments under Megatron-LM's meaning."""
    from megatron_zb.training.arguments import parse_args, validate_args
    from megatron_zb.training.run_config import ModelConfig, ParallelConfig, PrecisionConfig
    from megatron_zb.training.wiring import gpt_config

    def gpt_model_kwargs(args):
        return ModelConfig.from_args(args).gpt_model_kwargs()

    args = validate_args(parse_args(MODEL_ARGS + [
        "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu", "--group-query-attention",
        "--num-query-groups", "2", "--disable-bias-linear", "--qk-layernorm", "--init-method-std", "0.01",
        "--attention-softmax-in-fp32", "--position-embedding-type", "rope", "--rotary-base", "500000",
        "--rotary-percent", "0.5", "--recompute-granularity", "full", "--recompute-method", "block",
        "--recompute-num-layers", "1", "--calculate-per-token-loss", "--hidden-size", "192",
        "--num-attention-heads", "4", "--rotary-interleaved"]), world_size=2)
    cfg = gpt_config(ModelConfig.from_args(args), parallel=ParallelConfig.from_args(args),
                     precision=PrecisionConfig.from_args(args))
    assert (cfg.normalization, cfg.layernorm_epsilon, cfg.gated_linear_unit, cfg.activation_func) == \
        ("RMSNorm", 1e-6, True, torch.nn.functional.silu)
    assert (cfg.num_query_groups, cfg.add_bias_linear, cfg.qk_layernorm, cfg.init_method_std) == (2, False, True, 0.01)
    assert cfg.attention_softmax_in_fp32 and cfg.calculate_per_token_loss and cfg.rotary_interleaved
    assert (cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers) == ("full", "block", 1)
    assert cfg.ffn_hidden_size == 512  # Megatron-LM's SwiGLU default: int(4 * 192 * 2 / 3 / 64) * 64
    assert gpt_model_kwargs(args) == dict(position_embedding_type="rope", rotary_percent=0.5, rotary_base=500000,
                                          share_embeddings_and_output_weights=True)
    untied = validate_args(parse_args(MODEL_ARGS + ["--untie-embeddings-and-output-weights"]), world_size=2)
    assert gpt_model_kwargs(untied)["share_embeddings_and_output_weights"] is False
    # Its loss parity at PP=2 runs in test_moe.py (the PP=2 MoE curves use it).
    nope = validate_args(parse_args(MODEL_ARGS + ["--position-embedding-type", "none"]), world_size=2)
    assert gpt_model_kwargs(nope)["position_embedding_type"] == "none"


MLA_FLAGS = ["--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "8", "--qk-head-dim", "8",
             "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8", "--qk-layernorm", "--normalization", "RMSNorm",
             "--position-embedding-type", "rope"]
"""Multi-latent attention at the tiny sizes (the compatibility matrix's ``mla`` column's shapes)."""


def test_mla_flags_reach_megatron_core_config_and_spec():
    """``--multi-latent-attention`` builds megatron-core's ``MLATransformerConfig`` from the MLA flags as
    Megatron-LM's ``core_transformer_config_from_args`` (its defaults: ``--rotary-scaling-factor`` 1.0,
    ``--rope-type`` unset -> yarn; ``--rotary-base``, ``--rotary-percent``, ``--normalization`` passed), the
    local spec's ``MLASelfAttention`` and ``--recompute-modules mla_up_proj``; the default implementation is
    the local spec."""
    from megatron.core.transformer import MLATransformerConfig
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from megatron_zb.model.mla import MLADotProductAttention
    from megatron_zb.training.arguments import parse_args, validate_args
    from megatron_zb.training.run_config import ModelConfig, ParallelConfig, PrecisionConfig
    from megatron_zb.training.wiring import gpt_config, gpt_layer_spec

    args = validate_args(parse_args(MODEL_ARGS + MLA_FLAGS + [
        "--rotary-base", "5000", "--rotary-percent", "0.5", "--mscale", "0.7", "--mscale-all-dim", "0.7",
        "--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj"]), world_size=2)
    model = ModelConfig.from_args(args)
    cfg = gpt_config(model, parallel=ParallelConfig.from_args(args), precision=PrecisionConfig.from_args(args))
    assert type(cfg) is MLATransformerConfig and cfg.multi_latent_attention
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim) == \
        (16, 8, 8, 4, 8)
    assert (cfg.rope_type, cfg.rotary_scaling_factor, cfg.mscale, cfg.mscale_all_dim) == ("yarn", 1.0, 0.7, 0.7)
    assert (cfg.rotary_base, cfg.rotary_percent, cfg.normalization) == (5000, 0.5, "RMSNorm")
    assert cfg.recompute_modules == ["mla_up_proj"] and args.transformer_impl == "local"
    attention = gpt_layer_spec(model).submodules.self_attention
    assert attention.module is MLASelfAttention and attention.submodules.core_attention is MLADotProductAttention
    rope = validate_args(parse_args(MODEL_ARGS + MLA_FLAGS + ["--rope-type", "rope"]), world_size=2)
    assert gpt_config(ModelConfig.from_args(rope), parallel=ParallelConfig.from_args(rope),
                      precision=PrecisionConfig.from_args(rope)).rope_type == "rope"
    plain = validate_args(parse_args(MODEL_ARGS + ["--rope-type", "rope"]), world_size=2)  # standard attention's own
    assert ModelConfig.from_args(plain).mla is None
    assert "q_lora_rank" not in ModelConfig.from_args(plain).transformer_config_kwargs()

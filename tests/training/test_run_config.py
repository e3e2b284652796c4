"""The typed run configuration (megatron_zb/training/run_config/): what each flag becomes, and the
defaults tests and benchmarks rely on when they build a section directly."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pkgutil

import pytest
import torch

from megatron_zb.training import run_config as rc
from megatron_zb.training.pretrain import parse_command_line

BASE = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
        "--train-iters 3 --lr 1e-3 --mock-data --pipeline-model-parallel-size 2").split()


def _parsed(argv: list[str], world_size: int) -> rc.RunConfig:
    """The run configuration of a ``pretrain_gpt_zb.py`` command line, as the Trainer builds it."""
    return rc.run_config(parse_command_line(argv, world_size=world_size).args)


def _config(*extra: str, world_size: int = 2) -> rc.RunConfig:
    return _parsed(BASE + list(extra), world_size)


def test_flags_land_in_their_sections():
    """A command line with a value for each section: every value where the section says it goes."""
    c = _config("--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "5000",
                "--enable-zero-bubble", "--enable-optimizer-post-validation", "--enable-exactly-numeric-match",
                "--post-validation-warmup-iters", "3", "--distributed-timeout-minutes", "2",
                "--pipeline-timeout-seconds", "45", "--clip-grad", "0.5",
                "--weight-decay", "0.1", "--lr-warmup-iters", "1", "--seed", "7", "--global-batch-size", "8",
                "--hysteresis", "3", "--min-loss-scale", "2", world_size=4)
    assert (c.parallel.world_size, c.parallel.pipeline_model_parallel_size, c.parallel.data_parallel_size) == (4, 2, 2)
    assert c.parallel.use_distributed_optimizer and c.parallel.overlap_grad_reduce
    assert c.parallel.ddp_bucket_size == 5000 and c.parallel.distributed_timeout_minutes == 2
    assert c.precision.bf16 and c.precision.params_dtype == torch.bfloat16
    assert c.precision.grad_reduce_in_fp32  # Megatron-LM: bf16 accumulates and reduces gradients in fp32
    assert (c.precision.hysteresis, c.precision.min_loss_scale) == (3, 2.0)
    assert (c.optim.clip_grad, c.optim.weight_decay, c.optim.lr_warmup_iters, c.optim.lr_decay_iters) == (0.5, 0.1, 1, 3)
    assert c.optim.post_validation == rc.PostValidationConfig(exact=True, warmup_iters=3, clean_iters_required=10,
                                                              timeout=45.0)
    assert (c.schedule.name, c.schedule.placement, c.schedule.split_backward) == ("zb", "plain", True)
    assert c.schedule.layers_per_stage == (2, 2) and c.schedule.num_pipeline_stages == 2
    assert (c.micro_batch_size, c.global_batch_size, c.num_microbatches, c.train_iters, c.seed) == (2, 8, 2, 3, 7)
    assert c.model.moe is None and c.optim.post_validation is not None


def test_megatron_core_schedule_and_no_post_validation():
    c = _config("--use-megatron-core-schedule")
    assert c.schedule.use_megatron_core_schedule and not c.schedule.split_backward
    assert c.optim.post_validation is None and not c.precision.grad_reduce_in_fp32
    assert c.precision.params_dtype == torch.float32


def test_moe_section():
    c = _config("--num-experts", "4", "--moe-router-topk", "2", "--moe-layer-freq", "2", "--disable-bias-linear")
    assert c.model.moe is not None and c.model.moe.num_experts == 4
    assert c.model.moe.moe_layer_pattern == (1, 0, 1, 0)  # --moe-layer-freq 2: every other layer, from the first
    kwargs = c.model.moe.transformer_config_kwargs(expert_model_parallel_size=1)
    assert kwargs["moe_layer_freq"] == [1, 0, 1, 0] and kwargs["num_moe_experts"] == 4


def test_sections_are_frozen():
    c = _config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.model.hidden_size = 64  # type: ignore[misc]


@pytest.mark.parametrize("section", [rc.ParallelConfig, rc.PrecisionConfig, rc.RecomputeConfig, rc.CheckpointConfig,
                                     rc.LoggingConfig, rc.ProfilingConfig, rc.MemoryConfig])
def test_defaults_are_the_command_lines(section):
    """A section built directly (as tests and benchmarks build it) has the defaults a user's command
    line without those flags gets (world size 1, the gloo backend resolved on this CPU machine)."""
    parsed = _parsed(BASE[:-2], 1)
    got = {rc.ParallelConfig: parsed.parallel, rc.PrecisionConfig: parsed.precision,
           rc.RecomputeConfig: parsed.model.recompute, rc.CheckpointConfig: parsed.checkpoint,
           rc.LoggingConfig: parsed.logging, rc.ProfilingConfig: parsed.profiling,
           rc.MemoryConfig: parsed.memory}[section]
    assert section() == got


def test_optim_and_model_defaults_are_the_command_lines():
    parsed = _parsed(BASE[:-2], 1)
    assert dataclasses.replace(rc.OptimConfig(lr=1e-3), lr_decay_iters=3) == parsed.optim
    m = parsed.model
    direct = rc.ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                            padded_vocab_size=m.padded_vocab_size, vocab_size=m.vocab_size, ffn_hidden_size=128,
                            kv_channels=8, max_position_embeddings=16)
    assert direct == dataclasses.replace(m, transformer_impl_reason=direct.transformer_impl_reason,
                                         wgrad_kernel=direct.wgrad_kernel)


def test_post_validation_is_the_optimizers_config_with_the_command_lines_defaults():
    """One PostValidationConfig (the optimizer's, re-exported as the run configuration's section);
    built directly it has what --enable-optimizer-post-validation alone gives: among them the timeout,
    --pipeline-timeout-seconds' default 300 s."""
    from megatron_zb.optimizer import PostValidationConfig
    assert rc.PostValidationConfig is PostValidationConfig
    parsed = _config("--enable-zero-bubble", "--enable-optimizer-post-validation").optim.post_validation
    assert parsed == rc.PostValidationConfig() and parsed.timeout == 300.0


def test_every_field_has_a_docstring():
    """Each field is documented (its flag and unit), as megatron-core's TransformerConfig."""
    modules = [rc] + [importlib.import_module(f"{rc.__name__}.{m.name}") for m in pkgutil.iter_modules(rc.__path__)]
    for node in (n for module in modules for n in ast.parse(inspect.getsource(module)).body):
        if not isinstance(node, ast.ClassDef) or node.name == "RunConfig":
            continue
        body = node.body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign):
                nxt = body[i + 1] if i + 1 < len(body) else None
                assert isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant), \
                    f"{node.name}.{stmt.target.id} has no docstring"


def test_one_flag_one_field():
    """--rotary-interleaved (a TransformerConfig field of the same name) needs only its field here:
    the model section passes every field marked TC to TransformerConfig."""
    on = _config("--position-embedding-type", "rope", "--rotary-interleaved").model
    off = _config("--position-embedding-type", "rope").model
    assert on.transformer_config_kwargs()["rotary_interleaved"] is True
    assert off.transformer_config_kwargs()["rotary_interleaved"] is False


def _decoupled_lr_run(argv: list[str]) -> dict:
    """In one process: the product's set-up (build_model, build_optimizer) from a command line; the
    learning rates of the embedding's parameter group and of another group after one scheduler step."""
    from megatron_zb.training.distributed import init_distributed
    from megatron_zb.training.model_setup import build_model
    from megatron_zb.training.optimizer_setup import build_optimizer

    config = _parsed(argv, 1)
    ctx = init_distributed(config.parallel, seed=config.seed)
    model = build_model(config, stage_to_rank=[0], dist=ctx)
    optim = build_optimizer(config, model=model, on_validation_report=lambda report: None)
    embedding = model.gpt_models[0].embedding.word_embeddings.weight
    optim.scheduler.step(increment=config.global_batch_size)
    out = {}
    for group in optim.optimizer.param_groups:
        params = group["params"]
        holds = any(p is embedding or getattr(p, "main_param", None) is embedding for p in params) or any(
            getattr(p, "is_embedding_or_output_parameter", False) for p in params)
        out["embedding" if holds else "other"] = group["lr"]
    return out


def test_decoupled_lr_gives_the_embedding_and_output_layer_their_own_schedule():
    """--decoupled-lr / --decoupled-min-lr (Megatron-LM's flags, megatron-core's param-group overrides):
    after one of three iterations with linear decay and no warm-up, lr = min + (max - min) * 2/3."""
    from megatron_zb.testing import run_distributed

    argv = BASE[:-2] + ["--lr", "1e-3", "--min-lr", "0", "--decoupled-lr", "5e-3", "--decoupled-min-lr", "1e-4"]
    [got] = run_distributed(_decoupled_lr_run, world_size=1, args=(argv,), timeout=120)
    assert got["other"] == pytest.approx(1e-3 * 2 / 3, rel=1e-12)
    assert got["embedding"] == pytest.approx(1e-4 + (5e-3 - 1e-4) * 2 / 3, rel=1e-12)


@pytest.mark.parametrize("bf16,in_bf16,accumulate,want", [
    (False, False, False, False), (False, False, True, True), (True, False, False, True),
    (True, True, False, False), (True, True, True, False), (False, True, False, False)])
def test_gradient_reduce_dtype_follows_megatron_lm(bf16, in_bf16, accumulate, want):
    """Megatron-LM's rule (arguments.py: bf16 turns --accumulate-allreduce-grads-in-fp32 on unless
    --grad-reduce-in-bf16, which turns it off)."""
    from megatron_zb.training.wiring import ddp_config

    precision = rc.PrecisionConfig(bf16=bf16, grad_reduce_in_bf16=in_bf16, accumulate_allreduce_grads_in_fp32=accumulate)
    assert precision.grad_reduce_in_fp32 is want
    assert ddp_config(rc.ParallelConfig(), precision).grad_reduce_in_fp32 is want


def test_grad_reduce_in_bf16_from_the_command_line():
    assert not _config("--bf16", "--grad-reduce-in-bf16").precision.grad_reduce_in_fp32
    assert _config("--bf16").precision.grad_reduce_in_fp32


def test_apply_layernorm_1p_reaches_the_config_or_is_refused_naming_what_is_missing():
    import importlib.util

    from megatron_zb.training.arguments import ArgumentError

    kwargs = dataclasses.replace(_config().model, layernorm_zero_centered_gamma=True).transformer_config_kwargs()
    assert kwargs["layernorm_zero_centered_gamma"] is True
    with pytest.raises(ArgumentError, match=r"--apply-layernorm-1p: megatron-core's local RMSNorm"):
        _config("--apply-layernorm-1p", "--normalization", "RMSNorm")
    if importlib.util.find_spec("apex") is None:
        with pytest.raises(ArgumentError, match=r"--apply-layernorm-1p: .*apex is not installed.*install apex"):
            _config("--apply-layernorm-1p")
    else:  # not tested here (no apex on this machine)
        assert _config("--apply-layernorm-1p").model.layernorm_zero_centered_gamma


def test_fp8_and_tp_comm_overlap_flags_map_to_transformer_config_or_are_refused():
    """Megatron-LM's FP8 flags (dest fp8 for --fp8-format, fp8_param from --fp8-param-gather) land on
    TransformerConfig's fields of the same names; without Transformer Engine's layers (this machine)
    one problem names every FP8 flag given."""
    from megatron_zb.training.arguments import ArgumentError, build_parser

    fp8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max",
           "--fp8-param-gather", "--use-distributed-optimizer"]
    parsed = build_parser().parse_args(BASE + fp8)
    assert (parsed.fp8, parsed.fp8_amax_history_len, parsed.fp8_amax_compute_algo, parsed.fp8_param_gather,
            parsed.fp8_recipe, parsed.fp8_margin) == ("hybrid", 1024, "max", True, "delayed", 0)
    kwargs = dataclasses.replace(_config().model, fp8="hybrid", fp8_amax_history_len=1024, fp8_amax_compute_algo="max",
                                 fp8_param=True, tp_comm_overlap=True).transformer_config_kwargs()
    assert (kwargs["fp8"], kwargs["fp8_amax_history_len"], kwargs["fp8_amax_compute_algo"], kwargs["fp8_param"],
            kwargs["tp_comm_overlap"], kwargs["fp8_recipe"]) == ("hybrid", 1024, "max", True, True, "delayed")
    assert _config().model.transformer_config_kwargs()["fp8"] is None
    with pytest.raises(ArgumentError) as e:
        _config(*fp8)
    [problem] = e.value.problems
    assert problem.text.startswith("--fp8-format: --fp8-format, --fp8-amax-history-len, --fp8-amax-compute-algo, "
                                   "--fp8-param-gather: FP8 needs Transformer Engine's layers")
    with pytest.raises(ArgumentError, match="--tp-comm-overlap: overlaps through Transformer Engine's userbuffers"):
        _config("--tp-comm-overlap")


def test_data_and_replanning_flags_land_in_their_sections():
    """The data section (and its tokenizer) and the schedule section's re-planning fields hold the
    command line's values; without those flags they hold the defaults a section built directly has."""
    c = _config("--num-workers", "0", "--eval-interval", "5", "--eval-iters", "2", "--data-cache-path", "/tmp/c",
                "--no-mmap-bin-files", "--eod-mask-loss", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
                "--enable-zero-bubble", "--zero-bubble-pipeline-timers-start-iter", "3",
                "--zero-bubble-pipeline-timers-end-iter", "6", "--pipeline-timeout-seconds", "45",
                "--profile-out", "p.json")
    assert c.data.mock_data and c.data.data_blend is None and (c.data.num_workers, c.data.eval_interval) == (0, 5)
    assert (c.data.eval_iters, c.data.data_cache_path, c.data.mmap_bin_files, c.data.eod_mask_loss) == (
        2, "/tmp/c", False, True)
    assert (c.data.tokenizer.tokenizer_type, c.data.tokenizer.vocab_size) == ("NullTokenizer", 100)
    assert c.data.tokenizer.build().vocab_size == 101  # the NullTokenizer's ids plus its EOD id
    assert (c.schedule.zero_bubble_pipeline_timers_start_iter, c.schedule.zero_bubble_pipeline_timers_end_iter,
            c.schedule.pipeline_timeout_seconds, c.schedule.profile_out) == (3, 6, 45.0, "p.json")
    plain = _parsed(BASE[:-2], 1)
    # validation resolves --vocab-size to the tokenizer's: ByteLevel's 256 bytes, EOD and PAD
    assert plain.data == rc.DataConfig(mock_data=True, tokenizer=rc.TokenizerConfig(vocab_size=258))
    sched = rc.ScheduleConfig(name="1f1b", placement="plain", split_backward=False, cost_aware=False,
                              num_model_chunks=1, layers_per_stage=(4,), use_megatron_core_schedule=False)
    assert dataclasses.replace(plain.schedule, placement="plain", memory_limit=None,
                               max_pending_backward=None) == sched


def test_a_one_process_run_without_a_launcher_picks_no_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """World size 1 and no MASTER_PORT: an in-memory store (no port another process could take first);
    a launcher's MASTER_PORT, or more than one process: env:// rendezvous as torchrun sets it up."""
    import torch.distributed as dist

    from megatron_zb.training.distributed import single_process_store

    one = _parsed(BASE[:-2], 1).parallel
    monkeypatch.delenv("MASTER_PORT", raising=False)
    assert isinstance(single_process_store(one), dist.HashStore)
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert single_process_store(one) is None

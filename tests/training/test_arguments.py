"""pretrain_gpt_zb.py's command line: Megatron flags, zero-bubble flags, validation, launch scripts."""

from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
from pathlib import Path

import numpy
import pytest
import torch

from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from megatron_zb.schedules.ir import ScheduleError
from megatron_zb.schedules.registry import get_spec, schedule_names
from megatron_zb.training.arguments import zero_bubble as arguments
from megatron_zb.training.arguments import (ArgumentError, build_parser, initial_schedule, parse_args,
                                            parse_data_blend, validate_args)

REPO = Path(__file__).resolve().parents[2]
BASE = ("--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--global-batch-size 16 --train-iters 10 --lr 1e-4 --mock-data")


def resolve(extra: str = "", *, world_size: int = 1, base: str = BASE):
    return validate_args(parse_args(shlex.split(base + " " + extra)), world_size=world_size)


def make_prefix(tmp_path: Path, name: str, *, idx: bool = True) -> str:
    """A real 1000-document corpus of 40 tokens each (megatron-core's writer; every split of the default
    ``--split`` gets a sample's worth); without ``idx`` its ``.idx`` is removed."""
    prefix = tmp_path / name
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=numpy.int32)
    for _ in range(1000):
        builder.add_document(numpy.arange(40, dtype=numpy.int32), [40])
    builder.finalize(str(prefix) + ".idx")
    if not idx:
        os.remove(str(prefix) + ".idx")
    return str(prefix)


def v_names_available() -> bool:
    try:
        for name in arguments.V_MEM_SETUP_TO_SCHEDULE.values():
            get_spec(name)
    except ScheduleError:
        return False
    return True


needs_v = pytest.mark.skipif(not v_names_available(), reason="V schedules (zbv, v-half, v-min) are not in the registry")


# ---------------------------------------------------------------------------- the parser
BRIEF_FLAGS = """--num-layers --hidden-size --num-attention-heads --ffn-hidden-size --seq-length
--max-position-embeddings --vocab-size --hidden-dropout --attention-dropout --micro-batch-size --global-batch-size
--train-iters --lr --min-lr --lr-warmup-iters --lr-decay-iters --lr-decay-style --weight-decay --clip-grad
--adam-beta1 --adam-beta2 --adam-eps --optimizer --seed --fp16 --bf16 --loss-scale --initial-loss-scale
--tensor-model-parallel-size --pipeline-model-parallel-size --sequence-parallel --use-distributed-optimizer
--data-path --mock-data --split --tokenizer-type --tokenizer-model --save --load --save-interval --eval-interval
--eval-iters --log-interval --tensorboard-dir --distributed-backend --distributed-timeout-minutes
--enable-zero-bubble --zero-bubble-v-schedule --zero-bubble-v-schedule-mem-setup --zero-bubble-max-pending-backward
--zero-bubble-pipeline-timers-start-iter --zero-bubble-pipeline-timers-end-iter --enable-optimizer-post-validation
--enable-exactly-numeric-match --allow-padding-num-layers --schedule --pipeline-timeout-seconds""".split()


def test_every_flag_exists_and_has_help():
    parser = build_parser()
    by_flag = {s: a for a in parser._actions for s in a.option_strings}
    missing = [f for f in BRIEF_FLAGS if f not in by_flag]
    assert not missing
    for action in parser._actions:
        if action.option_strings != ["-h", "--help"]:
            assert action.help and len(action.help) > 10, action.option_strings


def test_megatron_defaults_and_choices():
    a = parse_args(shlex.split(BASE))
    assert (a.hidden_dropout, a.attention_dropout) == (0.1, 0.1)
    assert (a.adam_beta1, a.adam_beta2, a.adam_eps, a.weight_decay, a.clip_grad) == (0.9, 0.999, 1e-8, 0.01, 1.0)
    assert (a.lr_decay_style, a.optimizer, a.seed, a.initial_loss_scale) == ("linear", "adam", 1234, 2.0 ** 32)
    assert (a.eval_interval, a.eval_iters, a.log_interval, a.distributed_timeout_minutes) == (1000, 100, 100, 10)
    assert (a.tokenizer_type, a.distributed_backend) == ("ByteLevel", "auto")
    assert (a.zero_bubble_pipeline_timers_start_iter, a.zero_bubble_pipeline_timers_end_iter) == (2, 4)
    by_flag = {s: x for x in build_parser()._actions for s in x.option_strings}
    assert list(by_flag["--schedule"].choices) == schedule_names()
    assert set(by_flag["--lr-decay-style"].choices) == {"constant", "linear", "cosine", "WSD"}
    assert set(by_flag["--tokenizer-type"].choices) == {"ByteLevel", "GPT2BPETokenizer", "HuggingFaceTokenizer",
                                                            "NullTokenizer", "GPTSentencePieceTokenizer",
                                                            "Llama2Tokenizer", "TikTokenizer"}
    assert set(by_flag["--distributed-backend"].choices) == {"auto", "gloo", "nccl"}
    with pytest.raises(ArgumentError, match="^--schedule: invalid choice 'no-such-schedule'; choose from 1f1b, "):
        parse_args(shlex.split(BASE + " --schedule no-such-schedule"))


def test_extra_args_provider():
    a = parse_args(shlex.split(BASE + " --my-flag 3"),
                   extra_args_provider=lambda p: p.add_argument("--my-flag", type=int, help="a test flag"))
    assert a.my_flag == 3


# ---------------------------------------------------------------------------- good configurations
def test_defaults_resolve_to_1f1b_and_derived_values():
    a = resolve()
    assert a.schedule == "1f1b" and a.schedule_placement == "plain" and not a.split_backward
    assert (a.world_size, a.data_parallel_size, a.num_microbatches) == (1, 1, 8)
    assert (a.ffn_hidden_size, a.max_position_embeddings, a.kv_channels) == (256, 32, 16)
    assert a.params_dtype is torch.float32 and a.lr_decay_iters == 10
    assert a.num_layers_per_stage == [8] and a.num_model_chunks == 1 and a.virtual_pipeline_model_parallel_size is None
    assert (a.vocab_size, a.tokenizer_vocab_size, a.padded_vocab_size) == (258, 258, 384)
    assert a.distributed_backend == ("nccl" if torch.cuda.is_available() else "gloo")
    assert a.zero_bubble_max_pending_backward is None and a.schedule_memory_limit is None
    assert resolve("--bf16").params_dtype is torch.bfloat16 and resolve("--fp16").params_dtype is torch.float16


def test_global_batch_defaults_to_micro_times_dp():
    a = resolve(world_size=4, base=BASE.replace(" --global-batch-size 16", ""))
    assert (a.global_batch_size, a.data_parallel_size, a.num_microbatches) == (8, 4, 1)


def test_enable_zero_bubble_resolves_to_zb_with_memory_limit():
    a = resolve("--pipeline-model-parallel-size 4 --enable-zero-bubble", world_size=4)
    assert a.schedule == "zb" and a.split_backward and a.schedule_cost_aware
    assert a.zero_bubble_max_pending_backward == 4 and a.schedule_memory_limit == 4.0  # p: ZB-1p
    assert a.num_layers_per_stage == [2, 2, 2, 2] and a.num_microbatches == 8
    sched = initial_schedule(a)
    assert sched.name == "zb" and sched.splits_backward and sched.meta["memory_limit"] == 4.0
    b = resolve("--pipeline-model-parallel-size 4 --enable-zero-bubble --zero-bubble-max-pending-backward 8",
                world_size=4)
    assert b.zero_bubble_max_pending_backward == 8 and b.schedule_memory_limit == 8.0  # 2p: ZB-2p
    assert initial_schedule(b).meta["memory_limit"] == 8.0


@needs_v
@pytest.mark.parametrize("setup, name", [("zb", "zbv"), ("half", "v-half"), ("min", "v-min")])
def test_v_schedule_mem_setups(setup, name):
    a = resolve(f"--pipeline-model-parallel-size 2 --zero-bubble-v-schedule --zero-bubble-v-schedule-mem-setup {setup}",
                world_size=2)
    assert a.schedule == name and a.schedule_placement == "v"
    assert (a.num_model_chunks, a.virtual_pipeline_model_parallel_size, a.num_pipeline_stages) == (2, 2, 4)
    assert a.num_layers_per_stage == [2, 2, 2, 2] and a.schedule_memory_limit is None
    assert initial_schedule(a).name == name


@needs_v
def test_v_max_pending_backward_counts_whole_microbatches_per_rank():
    a = resolve("--pipeline-model-parallel-size 2 --zero-bubble-v-schedule --zero-bubble-max-pending-backward 1",
                world_size=2)
    assert a.zero_bubble_max_pending_backward == 1 and a.schedule_memory_limit == 2.0  # two chunks per rank


@needs_v
def test_v_padding_allows_odd_layer_count_per_rank():
    a = resolve("--num-layers 7 --pipeline-model-parallel-size 2 --zero-bubble-v-schedule --allow-padding-num-layers",
                world_size=2)
    per_stage = a.num_layers_per_stage
    assert sum(per_stage) == 7 and len(per_stage) == 4
    per_rank = [per_stage[0] + per_stage[3], per_stage[1] + per_stage[2]]  # V: rank r holds r and 2p-1-r
    assert per_rank == [3, 4]


def test_schedule_flag_and_interleaved_chunks():
    assert resolve("--pipeline-model-parallel-size 2 --schedule zb-h1", world_size=2).schedule == "zb-h1"
    a = resolve("--pipeline-model-parallel-size 2 --schedule interleaved-1f1b --num-virtual-stages-per-pipeline-rank 2",
                world_size=2)
    assert (a.schedule, a.num_model_chunks, a.virtual_pipeline_model_parallel_size) == ("interleaved-1f1b", 2, 2)
    assert a.num_layers_per_stage == [2, 2, 2, 2]
    b = resolve("--pipeline-model-parallel-size 2 --enable-zero-bubble --schedule zb-2p", world_size=2)
    assert b.schedule == "zb-2p"


def test_num_layers_per_virtual_pipeline_stage_as_megatron_lm_reads_it():
    """Megatron-LM's flag: 8 layers / PP 2 / 2 layers per chunk = 2 chunks per rank (with an
    ``--account-for-*`` flag one more layer counts: 10 / 2 / 1 = 5); refused with the other chunk flag, when
    the layers do not divide, and on a schedule of one placement that does not match."""
    pp = "--pipeline-model-parallel-size 2 --schedule interleaved-zb"
    a = resolve(f"{pp} --num-layers-per-virtual-pipeline-stage 2", world_size=2)
    assert (a.num_model_chunks, a.virtual_pipeline_model_parallel_size, a.num_layers_per_stage) == (2, 2, [2] * 4)
    a = resolve(f"{pp} --num-layers 9 --account-for-embedding-in-pipeline-split "
                "--num-layers-per-virtual-pipeline-stage 1", world_size=2)
    assert a.num_model_chunks == 5
    for extra, msg in (("--num-layers-per-virtual-pipeline-stage 2 --num-virtual-stages-per-pipeline-rank 2",
                        "give it or --num-virtual-stages-per-pipeline-rank, not both"),
                       ("--num-layers-per-virtual-pipeline-stage 3", "8 layers over --pipeline-model-parallel-size 2 "
                                                                     "do not split into chunks of 3 layers"),
                       ("--num-layers-per-virtual-pipeline-stage 4",
                        "interleaved schedule .interleaved-zb. needs >= 2 chunks per rank, got 1")):
        with pytest.raises(ArgumentError, match=f"--num-layers-per-virtual-pipeline-stage: {msg}"):
            resolve(f"{pp} {extra}", world_size=2)
    with pytest.raises(ArgumentError, match="--num-layers-per-virtual-pipeline-stage: schedule 'zb-h1' uses 1 model"):
        resolve("--pipeline-model-parallel-size 2 --schedule zb-h1 --num-layers-per-virtual-pipeline-stage 2",
                world_size=2)


def test_padding_splits_first_and_last_stage():
    a = resolve("--num-layers 10 --pipeline-model-parallel-size 4 --allow-padding-num-layers", world_size=4)
    assert a.num_layers_per_stage == [2, 3, 3, 2]


def test_validate_is_idempotent():
    a = resolve("--pipeline-model-parallel-size 2 --enable-zero-bubble", world_size=2)
    before = dict(vars(a))
    validate_args(a, world_size=2)
    assert vars(a) == before
    n = resolve("--tokenizer-type NullTokenizer --vocab-size 1000")
    assert (n.vocab_size, n.tokenizer_vocab_size, n.padded_vocab_size) == (1000, 1001, 1024)
    validate_args(n, world_size=1)
    assert (n.vocab_size, n.tokenizer_vocab_size, n.padded_vocab_size) == (1000, 1001, 1024)


def test_vocab_padding_uses_tp():
    a = resolve("--tensor-model-parallel-size 2 --vocab-size 300", world_size=2)
    assert (a.vocab_size, a.padded_vocab_size) == (300, 512)


def test_data_path_blends(tmp_path):
    p1, p2 = make_prefix(tmp_path, "a"), make_prefix(tmp_path, "b")
    base = BASE.replace(" --mock-data", "")
    assert resolve(f"--data-path {p1}", base=base).data_blend == ([p1], None)
    assert resolve(f"--data-path {p1} {p2}", base=base).data_blend == ([p1, p2], None)
    assert resolve(f"--data-path 0.3 {p1} 0.7 {p2}", base=base).data_blend == ([p1, p2], [0.3, 0.7])
    assert parse_data_blend(["30", "x", "70", "y"]) == (["x", "y"], [30.0, 70.0])


# ---------------------------------------------------------------------------- post-validation tuning
PV = "--pipeline-model-parallel-size 2 --enable-zero-bubble --enable-optimizer-post-validation"
PV_FLAGS = ("--post-validation-warmup-iters", "--post-validation-fallback-clean-iters")


def test_post_validation_tuning_flags_have_help_with_units_and_defaults():
    by_flag = {s: a for a in build_parser()._actions for s in a.option_strings}
    for flag in PV_FLAGS:
        action = by_flag[flag]
        assert action.type is int and action.default is None  # "not given"; validate_args fills in 10
        assert "Iterations, >= 0 (default 10)" in action.help and "--enable-optimizer-post-validation" in action.help
    assert all(flag in by_flag["--enable-optimizer-post-validation"].help for flag in PV_FLAGS)


def test_post_validation_tuning_defaults():
    a = parse_args(shlex.split(BASE + " " + PV))
    assert (a.post_validation_warmup_iters, a.post_validation_fallback_clean_iters) == (None, None)
    a = resolve(PV, world_size=2)
    assert (a.post_validation_warmup_iters, a.post_validation_fallback_clean_iters) == (10, 10)
    assert (arguments.POST_VALIDATION_WARMUP_ITERS, arguments.POST_VALIDATION_FALLBACK_CLEAN_ITERS) == (10, 10)
    # Without post-validation the values stay "not given", and validating again is still fine.
    b = resolve("--pipeline-model-parallel-size 2 --enable-zero-bubble", world_size=2)
    assert (b.post_validation_warmup_iters, b.post_validation_fallback_clean_iters) == (None, None)
    validate_args(b, world_size=2)


@pytest.mark.parametrize("warmup, clean", [(0, 0), (3, 1), (25, 4)])
def test_post_validation_tuning_values(warmup, clean):
    a = resolve(f"{PV} --post-validation-warmup-iters {warmup} --post-validation-fallback-clean-iters {clean}",
                world_size=2)
    assert (a.post_validation_warmup_iters, a.post_validation_fallback_clean_iters) == (warmup, clean)
    before = dict(vars(a))
    validate_args(a, world_size=2)  # idempotent
    assert vars(a) == before
    c = resolve(f"{PV} --enable-exactly-numeric-match --post-validation-fallback-clean-iters {clean}", world_size=2)
    assert (c.post_validation_warmup_iters, c.post_validation_fallback_clean_iters) == (10, clean)


# ---------------------------------------------------------------------------- bad configurations
BAD = [
    # (extra flags, world size, flag the message must name, another text it must contain)
    ("--zero-bubble-v-schedule", 1, "--zero-bubble-v-schedule", "--pipeline-model-parallel-size > 1"),
    # --zero-bubble-v-schedule with --enable-zero-bubble is the V, as the zero-bubble fork
    # (tests/training/test_fork_flags.py::test_enable_zero_bubble_with_v_schedule_is_the_v_with_a_log_line)
    ("--pipeline-model-parallel-size 2 --zero-bubble-v-schedule --schedule zb", 2, "--zero-bubble-v-schedule",
     "--schedule"),
    ("--global-batch-size 10", 2, "--global-batch-size", "multiple of 4"),
    ("--num-layers 6 --pipeline-model-parallel-size 4", 4, "--num-layers", "--allow-padding-num-layers"),
    ("--num-layers 5 --pipeline-model-parallel-size 4 --allow-padding-num-layers", 4, "--num-layers", "even with"),
    # only the loss counted in the split: the message names that flag (8 + 1 layers over 2 stages)
    ("--pipeline-model-parallel-size 2 --account-for-loss-in-pipeline-split", 2,
     "--account-for-loss-in-pipeline-split", "do not divide evenly"),
    ("--decoder-last-pipeline-num-layers 2", 1, "--decoder-last-pipeline-num-layers",
     "--pipeline-model-parallel-size > 1"),
    ("--enable-optimizer-post-validation", 1, "--enable-optimizer-post-validation", "--enable-zero-bubble"),
    # --sequence-parallel at TP 1 is now turned off with a log line, as Megatron-LM
    # (tests/training/test_command_line_report.py::test_sequence_parallel_at_tp1_is_turned_off_with_a_log_line)
    ("--fp16 --bf16", 1, "--bf16", "--fp16"),
    ("--pipeline-model-parallel-size 2 --enable-zero-bubble --zero-bubble-max-pending-backward 0", 2,
     "--zero-bubble-max-pending-backward", "raise"),
    ("--zero-bubble-max-pending-backward 2", 1, "--zero-bubble-max-pending-backward", "no effect"),
    ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2", 6, "--tensor-model-parallel-size",
     "world size 6"),
    ("--num-attention-heads 5", 1, "--num-attention-heads", "--hidden-size 64"),
    ("--tensor-model-parallel-size 3", 3, "--tensor-model-parallel-size", "--num-attention-heads 4"),
    # --enable-exactly-numeric-match alone is accepted with a WARNING
    # (tests/training/test_fork_flags.py::test_exactly_numeric_match_alone_is_accepted_with_a_warning)
    ("--enable-zero-bubble --schedule 1f1b", 1, "--schedule", "--enable-zero-bubble"),
    ("--pipeline-model-parallel-size 2 --enable-zero-bubble --zero-bubble-v-schedule-mem-setup half", 2,
     "--zero-bubble-v-schedule-mem-setup", "add --zero-bubble-v-schedule"),
    ("--schedule 1f1b --num-virtual-stages-per-pipeline-rank 2", 1, "--num-virtual-stages-per-pipeline-rank", "drop"),
    ("--zero-bubble-pipeline-timers-start-iter 4 --zero-bubble-pipeline-timers-end-iter 4", 1,
     "--zero-bubble-pipeline-timers-end-iter", "greater"),
    ("--max-position-embeddings 16", 1, "--max-position-embeddings", "--seq-length"),
    ("--min-lr 1", 1, "--min-lr", "--lr"),
    ("--split 0,1,1", 1, "--split", "training"),
    ("--split a,b", 1, "--split", "949,50,1"),
    ("--tokenizer-type NullTokenizer", 1, "--vocab-size", "NullTokenizer"),
    ("--vocab-size 100", 1, "--vocab-size", "258"),
    ("--tokenizer-type HuggingFaceTokenizer", 1, "--tokenizer-model", "local directory"),
    ("--tokenizer-type HuggingFaceTokenizer --tokenizer-model /no/such/tokenizer/dir", 1, "--tokenizer-model",
     "does not exist"),
    ("--tokenizer-type GPT2BPETokenizer", 1, "--vocab-file", "is required with --tokenizer-type GPT2BPETokenizer"),
    ("--merge-file merges.txt", 1, "--merge-file", "only read by --tokenizer-type GPT2BPETokenizer"),
    ("--recompute-granularity selective --recompute-modules core_attn mlp", 1, "--recompute-modules",
     "add --disable-bias-linear or drop mlp"),
    ("--post-validation-warmup-iters 3", 1, "--post-validation-warmup-iters",
     "add --enable-optimizer-post-validation or drop --post-validation-warmup-iters"),
    ("--pipeline-model-parallel-size 2 --enable-zero-bubble --post-validation-fallback-clean-iters 3", 2,
     "--post-validation-fallback-clean-iters",
     "add --enable-optimizer-post-validation or drop --post-validation-fallback-clean-iters"),
    ("--post-validation-warmup-iters 0 --post-validation-fallback-clean-iters 0", 1, "--post-validation-warmup-iters",
     "drop --post-validation-warmup-iters and --post-validation-fallback-clean-iters"),
    (f"{PV} --post-validation-warmup-iters -1", 2, "--post-validation-warmup-iters", "must be >= 0 iterations, got -1"),
    (f"{PV} --post-validation-fallback-clean-iters -2", 2, "--post-validation-fallback-clean-iters",
     "must be >= 0 iterations, got -2"),
]


@pytest.mark.parametrize("extra, world_size, flag, also", BAD, ids=[b[0] for b in BAD])
def test_bad_configuration_names_the_flag(extra, world_size, flag, also):
    if "--zero-bubble-v-schedule" in extra and world_size > 1 and not v_names_available():
        pytest.skip("V schedules are not in the registry")
    with pytest.raises(ArgumentError) as info:
        resolve(extra, world_size=world_size)
    msg = str(info.value)
    assert msg.startswith(flag + ":") and info.value.flag == flag
    assert also in msg


def test_required_flags():
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--micro-batch-size",
                 "--train-iters", "--lr"):
        argv = shlex.split(BASE)
        i = argv.index(flag)
        del argv[i:i + 2]
        # the training length: --train-iters or --train-samples, as Megatron-LM
        message = "give exactly one of --train-iters N and --train-samples N" if flag == "--train-iters" else "is required"
        with pytest.raises(ArgumentError, match=f"^{flag}: {message}"):
            validate_args(parse_args(argv), world_size=1)


def test_data_errors(tmp_path):
    base = BASE.replace(" --mock-data", "")
    with pytest.raises(ArgumentError, match="^--data-path: no training data.*--mock-data"):
        resolve(base=base)
    with pytest.raises(ArgumentError, match=r"^--data-path: .*missing .*nothing\.bin and .*nothing\.idx"):
        resolve(f"--data-path {tmp_path / 'nothing'}", base=base)
    half = make_prefix(tmp_path, "half", idx=False)
    with pytest.raises(ArgumentError, match=r"^--data-path: .*missing .*half\.idx"):
        resolve(f"--data-path {half}", base=base)
    good = make_prefix(tmp_path, "good")
    with pytest.raises(ArgumentError, match="^--mock-data: .*mutually exclusive"):
        resolve(f"--data-path {good}")
    with pytest.raises(ArgumentError, match="^--data-path: .*mixes weights and prefixes"):
        resolve(f"--data-path {good} 0.5", base=base)
    with pytest.raises(ArgumentError, match="^--data-path: .*positive"):
        resolve(f"--data-path 0 {good}", base=base)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_nccl_without_cuda():
    with pytest.raises(ArgumentError, match="^--distributed-backend: nccl needs CUDA"):
        resolve("--distributed-backend nccl")


def test_gloo_with_cuda_visible_is_refused(monkeypatch):
    """gloo is the CPU path; with a GPU visible megatron-core allocates on it (an H200 run crashed). CUDA's
    availability is monkeypatched: this machine has no GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ArgumentError, match="^--distributed-backend: gloo runs the CPU path, but CUDA is visible"):
        resolve("--distributed-backend gloo")


def test_unavailable_schedule_name_is_a_clear_error(monkeypatch):
    real = arguments.get_spec

    def get_spec_without_v(name):
        if name in ("zbv", "v-half", "v-min"):
            raise ScheduleError(f"unknown schedule {name!r}")
        return real(name)

    monkeypatch.setattr(arguments, "get_spec", get_spec_without_v)
    with pytest.raises(ArgumentError, match="^--zero-bubble-v-schedule: schedule 'v-half' is not available"):
        resolve("--pipeline-model-parallel-size 2 --zero-bubble-v-schedule --zero-bubble-v-schedule-mem-setup half",
                world_size=2)


# ---------------------------------------------------------------------------- launch scripts
def test_launch_scripts_parse():
    for script in ("pretrain_gpt_single_node.sh", "pretrain_gpt_slurm.sh", "lib/pretrain_gpt_common.sh"):
        subprocess.run(["bash", "-n", str(REPO / "scripts" / script)], check=True)


def test_common_launch_file_needs_the_callers_defaults():
    common = REPO / "scripts" / "lib" / "pretrain_gpt_common.sh"
    run = subprocess.run(["bash", "-c", 'set -euo pipefail; NUM_LAYERS=2; source "$1"; echo sourced', "bash",
                          str(common)], env={"PATH": os.environ["PATH"]}, capture_output=True, text=True)
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr == f"error: HIDDEN_SIZE must be set before sourcing {common}\n"


def _stub(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _launch(workdir: Path, script: str, **env_vars: str) -> tuple[list[str], list[str]]:
    """Run scripts/SCRIPT --distributed-backend gloo with torchrun, srun and scontrol stubbed.

    Returns the recorded torchrun command line split into (torchrun options, training script flags).
    """
    bindir = workdir / "bin"
    bindir.mkdir(parents=True)
    record = workdir / "argv"
    _stub(bindir / "torchrun", f'printf "%s\\0" "$@" > {shlex.quote(str(record))}\n')
    _stub(bindir / "scontrol", 'printf "node-a\\nnode-b\\n"\n')
    # srun stub: drop srun's own options, run the command once as node 1
    _stub(bindir / "srun", 'while [[ "$1" == -* ]]; do shift; done\nSLURM_NODEID=1 exec "$@"\n')
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", **env_vars)
    env.pop("MASTER_ADDR", None)
    run = subprocess.run(["bash", str(REPO / "scripts" / script), "--distributed-backend", "gloo"],
                         env=env, cwd=workdir, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    argv = record.read_text().split("\0")[:-1]
    i = next(k for k, a in enumerate(argv) if a.endswith("pretrain_gpt_zb.py"))
    return argv[:i], argv[i + 1:]


def _slurm_env(tmp_path: Path, nodes: int) -> dict[str, str]:
    """A SLURM allocation of `nodes` nodes, REPO_DIR a directory holding pretrain_gpt_zb.py."""
    repo = tmp_path / "repo"
    repo.mkdir(exist_ok=True)
    (repo / "pretrain_gpt_zb.py").write_text("")
    return dict(SLURM_JOB_NODELIST="node-[a-b]", SLURM_JOB_NUM_NODES=str(nodes), REPO_DIR=str(repo))


SMALL_GPT = dict(MOCK_DATA="1", NUM_LAYERS="16", HIDDEN_SIZE="64", NUM_HEADS="4", SEQ_LENGTH="32",
                 GLOBAL_BATCH="16", TP="2", PP="4")


@pytest.mark.parametrize("schedule, expect", [("zb", "zb"), ("1f1b", "1f1b"), ("v-half", "v-half")])
def test_single_node_script_passes_valid_flags(tmp_path, schedule, expect):
    if expect == "v-half" and not v_names_available():
        pytest.skip("V schedules are not in the registry")
    launcher, flags = _launch(tmp_path, "pretrain_gpt_single_node.sh", **SMALL_GPT, SCHEDULE=schedule,
                              CHECKPOINT_PATH=str(tmp_path / "ckpt"))
    assert launcher[launcher.index("--nproc_per_node") + 1] == "8"
    a = validate_args(parse_args(flags), world_size=8)
    assert a.schedule == expect and a.tensor_model_parallel_size == 2 and a.pipeline_model_parallel_size == 4
    assert a.params_dtype is torch.bfloat16 and a.distributed_backend == "gloo"  # the appended flag wins


def test_single_node_script_passes_gpt2_tokenizer_files(tmp_path):
    _, flags = _launch(tmp_path, "pretrain_gpt_single_node.sh", **SMALL_GPT, SCHEDULE="zb",
                       CHECKPOINT_PATH=str(tmp_path / "ckpt"), TOKENIZER_TYPE="GPT2BPETokenizer",
                       VOCAB_FILE="/data/gpt2-vocab.json", MERGE_FILE="/data/gpt2-merges.txt")
    given = {flags[k]: flags[k + 1] for k in range(len(flags) - 1) if flags[k].startswith("--")}
    assert given["--tokenizer-type"] == "GPT2BPETokenizer"
    assert (given["--vocab-file"], given["--merge-file"]) == ("/data/gpt2-vocab.json", "/data/gpt2-merges.txt")


def test_slurm_script_passes_valid_flags(tmp_path):
    launcher, flags = _launch(tmp_path, "pretrain_gpt_slurm.sh", **_slurm_env(tmp_path, 2), **SMALL_GPT,
                              SCHEDULE="zb", CHECKPOINT_PATH=str(tmp_path / "ckpt"))
    opt = {launcher[k]: launcher[k + 1] for k in range(0, len(launcher) - 1) if launcher[k].startswith("--")}
    assert (opt["--nnodes"], opt["--nproc_per_node"], opt["--node_rank"]) == ("2", "8", "1")
    assert (opt["--master_addr"], opt["--master_port"]) == ("node-a", "6000")
    a = validate_args(parse_args(flags), world_size=16)
    assert a.schedule == "zb" and a.data_parallel_size == 2 and a.data_cache_path == str(tmp_path / "ckpt" / "data_cache")


def _without_data_cache_path(flags: list[str]) -> list[str]:
    i = flags.index("--data-cache-path")
    return flags[:i] + flags[i + 2:]


def test_launch_scripts_build_the_same_training_flags(tmp_path):
    """Both scripts take their flags from scripts/lib/pretrain_gpt_common.sh: given the same settings,
    the training command lines agree except for the SLURM script's --data-cache-path."""
    same = dict(SMALL_GPT, MOCK_DATA="0", DATA_PATH="0.3 /data/a_text_document 0.7 /data/b_text_document",
                MICRO_BATCH="2", SCHEDULE="zb", MAX_PENDING_BACKWARD="8", POST_VALIDATION="1", PRECISION="fp16",
                TRAIN_ITERS="7", LR="1e-3", MIN_LR="1e-4", WARMUP_ITERS="2", TENSORBOARD_DIR=str(tmp_path / "tb"),
                CHECKPOINT_PATH=str(tmp_path / "ckpt"))
    _, single = _launch(tmp_path / "single", "pretrain_gpt_single_node.sh", **same)
    _, slurm = _launch(tmp_path / "slurm", "pretrain_gpt_slurm.sh", **_slurm_env(tmp_path, 2), **same)
    assert slurm[slurm.index("--data-cache-path") + 1] == str(tmp_path / "ckpt" / "data_cache")
    assert _without_data_cache_path(slurm) == single
    for flag in ("--num-layers 16", "--micro-batch-size 2", "--lr 1e-3", "--lr-decay-style cosine",
                 "--weight-decay 0.1", "--clip-grad 1.0", "--adam-beta1 0.9", "--adam-beta2 0.95", "--fp16",
                 "--enable-zero-bubble", "--zero-bubble-max-pending-backward 8",
                 "--enable-optimizer-post-validation", "--data-path 0.3 /data/a_text_document 0.7"):
        assert flag in " ".join(single), flag


def test_launch_scripts_keep_their_own_defaults(tmp_path):
    """Model size, global batch, TP, LR and checkpoint directory default per script; the rest is shared."""
    _, single = _launch(tmp_path / "single", "pretrain_gpt_single_node.sh", MOCK_DATA="1")
    _, slurm = _launch(tmp_path / "slurm", "pretrain_gpt_slurm.sh", **_slurm_env(tmp_path, 4), MOCK_DATA="1")
    a, b = parse_args(single), parse_args(_without_data_cache_path(slurm))
    own = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "max_position_embeddings",
           "global_batch_size", "tensor_model_parallel_size", "lr", "min_lr", "save")
    assert [getattr(a, k) for k in own] == [24, 2048, 16, 2048, 2048, 64, 1, 3e-4, 3e-5, "./checkpoints/gpt_zb"]
    assert [getattr(b, k) for k in own] == [32, 4096, 32, 4096, 4096, 256, 4, 1.5e-4, 1.5e-5,
                                            "./checkpoints/gpt_zb_slurm"]
    for k in own:
        setattr(a, k, None)
        setattr(b, k, None)
    assert vars(a) == vars(b)
    assert (a.micro_batch_size, a.pipeline_model_parallel_size, a.train_iters, a.lr_warmup_iters) == (1, 8, 500000, 2000)
    assert a.bf16 and a.enable_zero_bubble and a.tokenizer_type == "ByteLevel"


def test_in_place_post_validation_of_fused_adam_is_refused_before_any_process_group(monkeypatch):
    """Where Transformer Engine or apex is installed megatron-core builds their FusedAdam, which the
    in-place rollback cannot invert: pretrain_gpt_zb.py refuses it while validating its flags (one
    rule with Megatron-LM's loop, ``zero_bubble.check_post_validation``), not when the optimizer is
    built after the process groups start. Neither is installed here, so megatron-core's own
    ``USING_PYTORCH_OPTIMIZER`` is set as an installation of either sets it; exact mode is accepted."""
    import megatron.core.optimizer

    monkeypatch.setattr(megatron.core.optimizer, "USING_PYTORCH_OPTIMIZER", False)
    with pytest.raises(ArgumentError, match="^--enable-optimizer-post-validation: the in-place rollback inverts "
                                            "torch.optim Adam steps only"):
        resolve(PV, world_size=2)
    assert resolve(PV + " --enable-exactly-numeric-match", world_size=2).enable_exactly_numeric_match


# ---------------------------------------------------------------------------- weight-gradient groups
def test_wgrad_group_refusals_name_the_flag_and_the_fix():
    """``--zero-bubble-wgrad-group`` (PP=2, 8 micro batches): a fused-backward schedule, a K not dividing
    the micro batches, and an explicit limit the grouped schedule exceeds are refused. Grouped by 8, every
    W of a stage waits for the last B, so a rank holds more than the 4 micro batches allowed -- at most all
    8 (the simulator's count is in the message)."""
    pp2 = "--pipeline-model-parallel-size 2 "
    cases = {"--zero-bubble-wgrad-group 2": "groups the W passes .* but schedule '1f1b' fuses its backward; add "
                                            "--enable-zero-bubble",
             "--enable-zero-bubble --zero-bubble-wgrad-group 3": "3 does not divide the 8 micro batches per "
                                                                 "iteration .*use a divisor of 8",
             "--enable-zero-bubble --zero-bubble-wgrad-group 8 --zero-bubble-max-pending-backward 4":
                 "groups of 8 hold W inputs longer: the schedule then needs ([0-9]+) micro batches of activations "
                 "per rank, above --zero-bubble-max-pending-backward 4; raise that limit or use a smaller group"}
    for extra, message in cases.items():
        with pytest.raises(ArgumentError, match=f"^--zero-bubble-wgrad-group: {message}") as info:
            resolve(pp2 + extra, world_size=2)
    need = int(re.search(cases[extra], str(info.value)).group(1))
    assert 4 < need <= 8


def test_wgrad_group_above_the_default_limit_is_logged_and_kept():
    """Without an explicit limit, ZB's default (PP = 2 micro batches) gives way to the group, with a notice
    naming the peak (above 2, at most all 8); with a limit that holds it, no notice."""
    a = resolve("--pipeline-model-parallel-size 2 --enable-zero-bubble --zero-bubble-wgrad-group 8", world_size=2)
    assert a.zero_bubble_wgrad_group == 8
    [note] = [n for n in a.validation_notices if "--zero-bubble-wgrad-group 8" in n]
    need = int(re.search("holds up to ([0-9]+) micro batches of activations per rank", note).group(1))
    assert 2 < need <= 8
    b = resolve("--pipeline-model-parallel-size 2 --enable-zero-bubble --zero-bubble-wgrad-group 8 "
                "--zero-bubble-max-pending-backward 8", world_size=2)
    assert b.zero_bubble_wgrad_group == 8 and not any("wgrad-group" in n for n in b.validation_notices)


# ---------------------------------------------------------------------------- sharded gradients (ZeRO-2)
def test_sharded_gradients_refusals_come_in_one_report():
    """``--data-parallel-sharding-strategy optim_grads`` at TP=2 x PP=2 with sequence parallelism, tied
    embeddings, no distributed optimizer and megatron-zb's 1F1B: four problems, one report, each naming its
    flag; ``optim_grads_params`` (ZeRO-3) and ``optim`` without the distributed optimizer are refused."""
    with pytest.raises(ArgumentError) as info:
        resolve("--pipeline-model-parallel-size 2 --tensor-model-parallel-size 2 --sequence-parallel "
                "--data-parallel-sharding-strategy optim_grads", world_size=8)
    text = str(info.value)
    assert text.startswith("4 problems with the command line"), text
    for line in ("--data-parallel-sharding-strategy: optim_grads shards through megatron-core's distributed optimizer; "
                 "add --use-distributed-optimizer",
                 "--data-parallel-sharding-strategy: optim_grads reduces each bucket after the W's of a zero-bubble "
                 "schedule, but schedule '1f1b' fuses its backward; add --enable-zero-bubble",
                 "--sequence-parallel: not supported with --data-parallel-sharding-strategy optim_grads yet",
                 "--untie-embeddings-and-output-weights: needed with --data-parallel-sharding-strategy optim_grads at "
                 "--pipeline-model-parallel-size > 1"):
        assert f"\n  {line}" in text, text
    with pytest.raises(ArgumentError, match="^--data-parallel-sharding-strategy: optim_grads_params .* is not supported"):
        resolve("--data-parallel-sharding-strategy optim_grads_params")
    with pytest.raises(ArgumentError, match="^--data-parallel-sharding-strategy: optim shards through megatron-core's "
                                            "distributed optimizer; add --use-distributed-optimizer"):
        resolve("--data-parallel-sharding-strategy optim")


def test_sharded_gradients_are_accepted_with_a_zero_bubble_schedule_and_say_how_often_they_reduce():
    """Accepted with the distributed optimizer and a zero-bubble schedule; on the V a tied embedding is fine
    (both uses on rank 0). Without ``--zero-bubble-wgrad-group`` a start-up line says each W reduces (4 per
    bucket per iteration here: 4 micro batches per data-parallel rank); with it, nothing is said."""
    base = "--pipeline-model-parallel-size 2 --data-parallel-sharding-strategy optim_grads --use-distributed-optimizer "
    a = resolve(base + "--enable-zero-bubble --untie-embeddings-and-output-weights", world_size=4)
    assert a.data_parallel_sharding_strategy == "optim_grads"
    assert any("without --zero-bubble-wgrad-group" in n and "(4 per bucket per iteration)" in n
               for n in a.validation_notices)
    v = resolve(base + "--zero-bubble-v-schedule --zero-bubble-wgrad-group 4", world_size=4)
    assert not any("sharding-strategy" in n for n in v.validation_notices)

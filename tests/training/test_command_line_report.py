"""One report of everything wrong with a command line; Megatron-LM's kernel, legacy-model, context,
p2p and timing flags with Megatron-LM's meanings; the start-up notices; the flag table of docs/training.md."""

from __future__ import annotations

import json
import os
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from megatron.core.transformer.enums import AttnBackend

from megatron_zb.training import pretrain
from megatron_zb.training.arguments import ArgumentError, build_parser, validate_args_and_schedule
from megatron_zb.training.arguments.developer import DEVELOPER_CHECK, add_developer_args
from megatron_zb.training.arguments.megatron_flags import MEGATRON_LM_FLAGS

REPO = Path(__file__).resolve().parents[2]
BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--train-iters 2 --lr 1e-4 --mock-data")
FIVE = "--use-torch-fsdp2 --log-straggler --enable-cuda-graph --mtp-standalone --moe-enable-deepep"
"""Five Megatron-LM flags that megatron-zb does not support (yet)."""


def validate(extra: str, *, world_size: int = 1, base: str = BASE):
    """``pretrain_gpt_zb.py``'s own parse and validation (developer flags included), in process."""
    return pretrain.parse_command_line(shlex.split(base + " " + extra), world_size=world_size)


def report(extra: str, **kw) -> ArgumentError:
    with pytest.raises(ArgumentError) as e:
        validate(extra, **kw)
    return e.value


# ---------------------------------------------------------------------------- one report


def test_five_unsupported_flags_give_five_reasons_in_one_run_exit_2_under_10_s(tmp_path):
    """Under 10 s of CPU time (user + sys of the process, which is start-up: importing torch and
    megatron-core, about 5 s here); the wall time also counts other processes on a shared machine."""
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(REPO / "pretrain_gpt_zb.py"), *shlex.split(BASE + " " + FIVE)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    elapsed = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    header = [i for i, ln in enumerate(lines) if ln.startswith("pretrain_gpt_zb.py: error:")]
    assert len(header) == 1 and "5 problems with the command line" in lines[header[0]]
    reasons = lines[header[0] + 1:header[0] + 6]
    for reason, flag in zip(reasons, ("--use-torch-fsdp2", "--log-straggler", "--enable-cuda-graph",
                                      "--mtp-standalone", "--moe-enable-deepep")):
        assert reason.startswith(f"  {flag} is a Megatron-LM flag megatron-zb does not support yet")
    assert "initializing torch distributed" not in proc.stdout + proc.stderr
    assert cpu_s < 10.0, f"{cpu_s:.1f} s of CPU time ({elapsed:.1f} s wall)"
    assert elapsed < 60.0, f"{elapsed:.1f} s wall"


def test_unknown_flags_and_every_failing_check_in_one_report():
    """Unknown flags first (command-line order), then each failing check in validation's order."""
    err = report("--use-torch-fsdp2 --fp16 --bf16 --context-parallel-size 2 --qqqzz --min-lr 1 --split a,b")
    assert [p.flag for p in err.problems] == ["--use-torch-fsdp2", "--qqqzz", "--min-lr", "--context-parallel-size",
                                             "--bf16", "--split"]
    assert err.flag == "--use-torch-fsdp2"
    text = str(err)
    assert text.startswith("6 problems with the command line") and len(text.splitlines()) == 7
    assert "--context-parallel-size: 2 is not supported" in text and "use --context-parallel-size 1" in text


def test_checks_that_need_a_failed_check_are_skipped_not_reported():
    """A missing --num-layers fails the ranges check; the layer split, which needs it, is not run (no
    TypeError, no second message about the layers), while independent checks still report."""
    base = BASE.replace("--num-layers 2 ", "")
    err = report("--pipeline-model-parallel-size 2 --fp16 --bf16", world_size=2, base=base)
    assert [p.flag for p in err.problems] == ["--num-layers", "--bf16"]
    assert err.problems[0].text == "--num-layers: is required; add --num-layers VALUE to the command line"


def test_ranges_report_every_flag_out_of_range():
    err = report("--hidden-dropout 1.5 --eval-iters -1 --log-interval 0")
    assert {p.flag for p in err.problems} == {"--hidden-dropout", "--eval-iters", "--log-interval"}


def test_developer_checks_join_the_report():
    err = report("--use-torch-fsdp2 --exit-interval 0")
    assert [p.flag for p in err.problems] == ["--use-torch-fsdp2", "--exit-interval"]


def test_one_problem_keeps_the_one_line_format():
    err = report("--fp16 --bf16")
    assert str(err) == "--bf16: --fp16 and --bf16 are mutually exclusive; keep one of them"
    assert err.flag == "--bf16" and len(err.problems) == 1
    assert ArgumentError.combine([err]) is err


# ---------------------------------------------------------------------------- Megatron-LM's flags


def test_sequence_parallel_at_tp1_is_turned_off_with_a_log_line():
    validated = validate("--sequence-parallel")
    args = validated.args
    assert args.sequence_parallel is False and args.sequence_parallel_requested is True
    lines = [n for n in validated.notices if "sequence parallelism" in n]
    assert lines == ["WARNING: Disabling sequence parallelism because tensor model parallelism is disabled "
                     "(--sequence-parallel at --tensor-model-parallel-size 1)"]
    again = validate_args_and_schedule(args, world_size=1, extra_checks=(DEVELOPER_CHECK,))
    assert again.notices == validated.notices and args.sequence_parallel is False  # idempotent


def test_use_mcore_models_is_a_no_op_and_legacy_models_builds_megatron_core_gpt_with_a_log_line():
    plain, flagged = validate(""), validate("--use-mcore-models")
    assert flagged.notices == plain.notices and flagged.args.deprecated_use_mcore_models
    legacy = validate("--use-legacy-models")
    assert [n for n in legacy.notices if "--use-legacy-models" in n] == [
        "WARNING: --use-legacy-models: megatron-core has no legacy models; megatron-core's GPTModel (the same "
        "architecture as Megatron-LM's legacy GPT) is built, and checkpoints are megatron-core's (torch_dist), not "
        "the legacy format"]


def test_context_parallel_size_one_only():
    assert validate("--context-parallel-size 1").args.context_parallel_size == 1
    assert "use --context-parallel-size 1" in str(report("--context-parallel-size 4"))
    assert report("--context-parallel-size 0").flag == "--context-parallel-size"  # the positive-integer range


def test_no_overlap_p2p_communication_derives_megatron_core_fields_and_says_what_it_means():
    plain = validate("--pipeline-model-parallel-size 2 --global-batch-size 8", world_size=2).args
    assert (plain.overlap_p2p_comm, plain.batch_p2p_comm) == (False, True)  # one chunk per rank: Megatron-LM's
    inter = validate("--pipeline-model-parallel-size 2 --global-batch-size 8 --num-layers 4 --schedule "
                     "interleaved-1f1b", world_size=2).args
    assert (inter.overlap_p2p_comm, inter.batch_p2p_comm) == (True, False)  # Megatron-LM's default with VPP
    off = validate("--pipeline-model-parallel-size 2 --global-batch-size 8 --num-layers 4 --schedule "
                   "interleaved-1f1b --no-overlap-p2p-communication", world_size=2)
    assert (off.args.overlap_p2p_comm, off.args.batch_p2p_comm) == (False, True)
    assert any(n.startswith("WARNING: --no-overlap-p2p-communication changes nothing in megatron-zb's schedules")
               for n in off.notices)


def test_ckpt_format_torch_dist_only_and_no_position_embedding_with_rope_only():
    assert validate("--ckpt-format torch_dist").args.ckpt_format == "torch_dist"
    err = report("--ckpt-format torch")
    assert err.flag == "--ckpt-format" and "use --ckpt-format torch_dist" in str(err)
    assert validate("--position-embedding-type rope --no-position-embedding").args.add_position_embedding is False
    assert report("--no-position-embedding").flag == "--no-position-embedding"  # learned positions, as Megatron-LM


def test_barrier_with_level_1_timing_flag():
    assert validate("").args.barrier_with_L1_time is True
    assert validate("--no-barrier-with-level-1-timing").args.barrier_with_L1_time is False


@pytest.mark.parametrize("name", ["auto", "local"])
def test_attention_backends_that_run_here(name):
    args = validate(f"--attention-backend {name} --transformer-impl local").args
    assert args.attention_backend is AttnBackend[name]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU refusal")
@pytest.mark.parametrize("name", ["flash", "fused", "unfused"])
def test_transformer_engine_attention_backends_are_refused_naming_what_is_missing(name):
    err = report(f"--attention-backend {name}")
    assert err.flag == "--attention-backend" and len(err.problems) == 1
    assert f"{name} chooses Transformer Engine's attention" in str(err)
    assert "CUDA is not available" in str(err) or "Transformer Engine is not installed" in str(err)


def test_a_bad_attention_backend_value_is_argparses_error(capsys):
    with pytest.raises(SystemExit) as e:
        validate("--attention-backend flashy")
    assert e.value.code == 2 and "'flashy' is not one of flash, fused, unfused, local, auto" in capsys.readouterr().err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CPU resolution")
def test_fusions_megatron_lm_turns_on_are_off_here_with_one_line():
    validated = validate("--position-embedding-type rope")
    args = validated.args
    for field in ("masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion",
                  "persist_layer_norm"):
        assert getattr(args, field) is False, field
    [line] = [n for n in validated.notices if n.startswith("> fusions")]
    for part in ("masked_softmax_fusion (the fused softmax kernels: needs CUDA",
                 "apply_rope_fusion (Transformer Engine's fused RoPE: needs CUDA and transformer_engine)",
                 "persist_layer_norm (apex's persistent LayerNorm: needs CUDA and apex)"):
        assert part in line
    # switched off by Megatron-LM's own rules or flags: nothing to say
    quiet = validate("--no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion "
                     "--no-persist-layer-norm")  # learned positions: no RoPE fusion to turn off
    assert not [n for n in quiet.notices if n.startswith("> fusions")]
    assert "bias_activation_fusion" not in "".join(validate("--disable-bias-linear --no-masked-softmax-fusion "
                                                            "--no-bias-dropout-fusion --no-persist-layer-norm")
                                                   .notices)  # GeLU without biases: Megatron-LM turns it off


def test_cross_entropy_fusion_reaches_megatron_core_config():
    from megatron_zb.training.run_config import ModelConfig

    validated = validate("--cross-entropy-loss-fusion")
    assert validated.args.cross_entropy_loss_fusion is True
    kwargs = ModelConfig.from_args(validated.args).transformer_config_kwargs()
    assert kwargs["cross_entropy_loss_fusion"] is True and kwargs["cross_entropy_fusion_impl"] == "native"
    if validated.args.transformer_engine_version is None:
        err = report("--cross-entropy-loss-fusion --cross-entropy-fusion-impl te")
        assert err.flag == "--cross-entropy-fusion-impl" and "Transformer Engine" in str(err)


def test_validating_again_changes_nothing():
    """The adjusted flags keep their requested values, so a second validation gives the same args and lines."""
    validated = validate("--sequence-parallel --use-legacy-models --use-flash-attn --cross-entropy-loss-fusion "
                         "--no-overlap-p2p-communication --position-embedding-type rope --no-persist-layer-norm")
    before = {k: v for k, v in vars(validated.args).items() if k != "validation_notices"}
    again = validate_args_and_schedule(validated.args, world_size=1, extra_checks=(DEVELOPER_CHECK,))
    after = {k: v for k, v in vars(again.args).items() if k != "validation_notices"}
    assert after == before and again.notices == validated.notices and len(again.notices) == 5


def test_use_flash_attn_is_accepted_with_a_pointer_to_the_attention_backend():
    notices = validate("--use-flash-attn").notices
    assert any("--use-flash-attn has no effect on megatron-core's GPT" in n and "--attention-backend flash" in n
               for n in notices)


# Megatron-LM core_v0.16.1 (megatron/training/arguments.py line numbers; generated groups name the
# dataclass of megatron-core 0.16.1 they come from): dest -> (default, value with the flag).
MEGATRON_LM_MEANINGS: dict[str, tuple[str, object, object]] = {
    # add_megatron_arguments -> TransformerConfig group (arguments.py 1621): transformer_config.py 110
    "attention_backend": ("--attention-backend flash", AttnBackend.auto, AttnBackend.flash),
    # model_parallel_config.py 39, 45, 241, 246 (the same TransformerConfig group)
    "sequence_parallel": ("--sequence-parallel", False, True),
    "context_parallel_size": ("--context-parallel-size 1", 1, 1),
    "cross_entropy_loss_fusion": ("--cross-entropy-loss-fusion", False, True),
    "cross_entropy_fusion_impl": ("--cross-entropy-fusion-impl te", "native", "te"),
    # arguments.py 2030-2048: store_false flags, default True
    "masked_softmax_fusion": ("--no-masked-softmax-fusion", True, False),
    "bias_gelu_fusion": ("--no-bias-gelu-fusion", True, False),
    "bias_swiglu_fusion": ("--no-bias-swiglu-fusion", True, False),
    "bias_dropout_fusion": ("--no-bias-dropout-fusion", True, False),
    "apply_rope_fusion": ("--no-rope-fusion", True, False),
    "use_flash_attn": ("--use-flash-attn", False, True),  # 2053
    "no_persist_layer_norm": ("--no-persist-layer-norm", False, True),  # 2078
    "deprecated_use_mcore_models": ("--use-mcore-models", False, True),  # 2088-2089
    "use_legacy_models": ("--use-legacy-models", False, True),  # 2093
    "overlap_p2p_comm": ("--no-overlap-p2p-communication", True, False),  # 2232-2234
    "add_position_embedding": ("--no-position-embedding", True, False),  # 1674-1677
    # CheckpointConfig group (arguments.py 2152): training_config.py 411
    "ckpt_format": ("--ckpt-format torch_dist", "torch_dist", "torch_dist"),
    # LoggerConfig group (arguments.py 1812): training_config.py 285
    "barrier_with_L1_time": ("--no-barrier-with-level-1-timing", True, False),
    "timing_log_level": ("--timing-log-level 2", 0, 2),  # training_config.py 222
    "timing_log_option": ("--timing-log-option all", "minmax", "all"),  # 231
    # TrainingConfig (learning rate): training_config.py 151
    "lr_warmup_init": ("--lr-warmup-init 0.5", 0.0, 0.5),
    # _add_data_args: arguments.py 2476-2478, 2505-2507 (store_false flags, default True)
    "mmap_bin_files": ("--no-mmap-bin-files", True, False),
    "create_attention_mask_in_dataloader": ("--no-create-attention-mask-in-dataloader", True, False),
    # _add_tokenizer_args: arguments.py 2405, 2410-2416
    "tokenizer_special_tokens": ("--tokenizer-special-tokens <s> </s>", None, ["<s>", "</s>"]),
    "tiktoken_pattern": ("--tiktoken-pattern v2", None, "v2"),
    "tiktoken_num_special_tokens": ("--tiktoken-num-special-tokens 16", 1000, 16),
    "tiktoken_special_tokens": ("--tiktoken-special-tokens <unk> <s>", None, ["<unk>", "<s>"]),
}


def test_parsed_values_are_megatron_lm_s_defaults_and_meanings():
    """Each dest, parsed without and with its flag, has the value read in Megatron-LM's arguments.py."""
    parser = build_parser(extra_args_provider=add_developer_args)
    default = parser.parse_args(shlex.split(BASE))
    for dest, (extra, before, after) in MEGATRON_LM_MEANINGS.items():
        assert extra.split()[0] in MEGATRON_LM_FLAGS
        assert getattr(default, dest) == before, dest
        assert getattr(parser.parse_args(shlex.split(BASE + " " + extra)), dest) == after, dest


_MEGATRON_LM_PARSER = """
import argparse, json, sys, warnings
warnings.simplefilter("ignore")
scripts, megatron_lm, argvs, flags = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
sys.path.insert(0, scripts)
from update_megatron_lm_flags import _Stubs  # empty stand-ins for what the parser does not use
sys.meta_path.insert(0, _Stubs())
sys.path.insert(0, megatron_lm)
from megatron.training.arguments import add_megatron_arguments
parser = argparse.ArgumentParser(allow_abbrev=False)
add_megatron_arguments(parser)
dest_of = {o: a.dest for a in parser._actions for o in a.option_strings}  # a release may rename a dest
print(json.dumps([{f: repr(getattr(parser.parse_args(a), dest_of[f])) for f in flags} for a in argvs]))
"""


GONE_FROM: dict[str, set[str]] = {"core_v0.16.1": set(),
                                  "core_v0.19.0": {"use_legacy_models", "tiktoken_special_tokens"}}
"""Per Megatron-LM release: the dests above whose flag its arguments.py no longer has (core_v0.19.0:
``megatron/legacy`` removed; the tokenizer flags generated from ``TokenizerConfig``, without
``tiktoken_special_tokens``)."""


def test_parsed_values_equal_megatron_lm_s_own_parser():
    """The same command lines through the installed megatron-core's Megatron-LM release's own parser
    (core_v0.16.1 or core_v0.19.0, built in a subprocess from MEGATRON_LM_DIR): every value of the
    dests above equal (theirs found by the flag: core_v0.19.0 stores ``--tokenizer-special-tokens`` in
    ``special_tokens``), except those whose flag that release no longer has (:data:`GONE_FROM`)."""
    from megatron_zb.megatron_compat import megatron_lm_tag
    from harness.megatron_lm import SKIP_REASON, find_megatron_lm
    from megatron_zb.training.arguments.megatron_flags import megatron_lm_flags

    megatron_lm = find_megatron_lm()
    if megatron_lm is None:
        pytest.skip(SKIP_REASON)
    their_flags = megatron_lm_flags()[1]
    gone = {d for d, (extra, _, _) in MEGATRON_LM_MEANINGS.items() if extra.split()[0] not in their_flags}
    assert gone == GONE_FROM[megatron_lm_tag()]
    flags = [extra for d, (extra, _, _) in MEGATRON_LM_MEANINGS.items() if d not in gone]
    argvs = [[], shlex.split(" ".join(flags)), ["--attention-backend", "local", "--sequence-parallel"]]
    dests = [d for d in MEGATRON_LM_MEANINGS if d not in gone]
    flag_of = {d: MEGATRON_LM_MEANINGS[d][0].split()[0] for d in dests}
    proc = subprocess.run([sys.executable, "-c", _MEGATRON_LM_PARSER, str(REPO / "scripts"), str(megatron_lm),
                           json.dumps(argvs), json.dumps(list(flag_of.values()))], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    parser = build_parser(extra_args_provider=add_developer_args)
    for argv, their_values in zip(argvs, theirs):
        ours = parser.parse_args(shlex.split(BASE) + argv)
        assert {d: repr(getattr(ours, d)) for d in dests} == {d: their_values[flag_of[d]] for d in dests}, argv


# ---------------------------------------------------------------------------- start-up notices, flag table


def test_pretrain_prints_the_notices_on_rank_0_before_the_run(monkeypatch, capsys):
    """pretrain.main prints validation's notices before the Trainer starts. The Trainer is replaced by
    a double that records the call (the real one would start process groups and train)."""
    started = []

    class NoTrainer:
        def __init__(self, args, *, schedule):
            started.append(capsys.readouterr().out)

        def run(self):
            return 0

        def close(self):
            pass

    monkeypatch.setattr(pretrain, "Trainer", NoTrainer)
    for name, value in (("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)  # a launcher's environment: RANK 1 below is a real rank
    monkeypatch.setenv("RANK", "0")
    assert pretrain.main(shlex.split(BASE + " --sequence-parallel --use-legacy-models")) == 0
    out = started[0]
    assert "WARNING: Disabling sequence parallelism" in out and "WARNING: --use-legacy-models" in out
    monkeypatch.setenv("RANK", "1")
    assert pretrain.main(shlex.split(BASE + " --sequence-parallel")) == 0
    assert "WARNING" not in started[1]


def test_docs_flag_table_is_current():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import flag_table
    finally:
        sys.path.remove(str(REPO / "scripts"))
    doc = flag_table.DOC.read_text()
    assert flag_table.with_table(doc, flag_table.table()) == doc, "run python scripts/flag_table.py"
    assert "681 flags" in doc


LAUNCH = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.mark.parametrize("env, present, missing", [
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is", "RANK, MASTER_ADDR, MASTER_PORT are"),
    ({"WORLD_SIZE": "4", "RANK": "1", "MASTER_ADDR": "node0"}, "WORLD_SIZE=4, RANK=1, MASTER_ADDR=node0 are",
     "MASTER_PORT is"),
])
def test_partial_launch_environment_is_one_line_exit_2_before_any_process_group(monkeypatch, capsys, env, present,
                                                                                 missing):
    """``WORLD_SIZE`` without a launcher's other variables: one line naming what is set, what is missing and
    the fix, exit 2, no process group (else torch.distributed's ``env://`` error, or every process rank 0)."""
    import torch.distributed as dist

    for name in LAUNCH:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert pretrain.main(shlex.split(BASE)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"pretrain_gpt_zb.py: error: partial launch environment: {present} set but {missing} not "
                          f"(a launcher sets all of WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT): launch with torchrun "
                          f"(torchrun --nproc_per_node N pretrain_gpt_zb.py ...), or unset "), err
    assert err.rstrip().endswith(" to run one process"), err
    assert not dist.is_initialized()


def test_launch_environments_that_start():
    """None (one process), ``WORLD_SIZE=1`` alone, a launcher's four, a rendezvous address for one process;
    not an integer, or a rank past the world, is named too."""
    from megatron_zb.training.distributed import launch_environment_problem

    four = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}
    for env in ({}, {"WORLD_SIZE": "1"}, {"RANK": "0"}, four, {"MASTER_ADDR": "h", "MASTER_PORT": "29500"}):
        assert launch_environment_problem(env) is None, env
    assert launch_environment_problem({"WORLD_SIZE": "two"}) == \
        "WORLD_SIZE='two' in the environment is not an integer >= 0"
    assert launch_environment_problem(dict(four, RANK="2")).startswith(
        "RANK=2, WORLD_SIZE=2 in the environment (WORLD_SIZE unset counts 1): a rank must be below")

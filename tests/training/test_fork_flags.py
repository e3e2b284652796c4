"""Moving from the zero-bubble fork and VocabularyParallelism: their flags on ``pretrain_gpt_zb.py``.

Each of their own flags is answered by name (accepted with a start-up line, or refused saying what
megatron-zb offers instead, never with a did-you-mean hint); the fork's V invocation
(``--enable-zero-bubble --zero-bubble-v-schedule``) is the V; ``--enable-exactly-numeric-match``
alone is accepted with a WARNING; ``--enable-vocab-parallel`` with a family flag (or none) takes
the family's vocabulary-parallel form. Argument level only: nothing trains.
"""

from __future__ import annotations

import shlex

import pytest

from megatron_zb.training import pretrain
from megatron_zb.training.arguments import ArgumentError
from megatron_zb.training.arguments.fork_flags import FORK_FLAGS

BASE = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 "
        "--global-batch-size 4 --train-iters 2 --lr 1e-4 --mock-data --pipeline-model-parallel-size 2")


def validate(extra: str):
    """``pretrain_gpt_zb.py``'s parse and validation of ``BASE + extra`` at PP=2 (2 processes)."""
    return pretrain.parse_command_line(shlex.split(BASE + " " + extra), world_size=2)


def report(extra: str) -> ArgumentError:
    with pytest.raises(ArgumentError) as e:
        validate(extra)
    return e.value


OFFLOAD = ("megatron-zb has no activation offload; to fit activation memory use a V schedule with less of it "
           "(--zero-bubble-v-schedule --zero-bubble-v-schedule-mem-setup half|min), a lower "
           "--zero-bubble-max-pending-backward, or --recompute-granularity (docs/training.md \"Moving from the "
           "zero-bubble fork\"); remove it")


@pytest.mark.parametrize("extra,line", [
    ("--cpu-offload", "--cpu-offload is a flag of the zero-bubble fork, not of megatron-zb: " + OFFLOAD),
    ("--offload-chunk-num 2", "--offload-chunk-num is a flag of the zero-bubble fork, not of megatron-zb: " + OFFLOAD),
    ("--no-paired-barrier", "--no-paired-barrier is a flag of the zero-bubble fork, not of megatron-zb: " + OFFLOAD),
    ("--recompute-lgd", "--recompute-lgd is a flag of the zero-bubble fork, not of megatron-zb: the fork's "
                        "recomputation of layer norm, GeLU and dropout is not in megatron-zb; megatron-core's "
                        "selective recomputation is: --recompute-granularity selective --recompute-modules "
                        "layernorm (the layer norms; add mlp to recompute the whole MLP, GeLU included); remove it"),
    ("--schedule-timer-start 10", "--schedule-timer-start is a flag of VocabularyParallelism, not of megatron-zb: "
                                  "megatron-zb's profiling window is --zero-bubble-pipeline-timers-start-iter N "
                                  "(first profiled iteration, 1-based; default 2): use it instead; remove it"),
    ("--schedule-timer-end 20", "--schedule-timer-end is a flag of VocabularyParallelism, not of megatron-zb: "
                                "megatron-zb's profiling window is --zero-bubble-pipeline-timers-end-iter N "
                                "(profiling stops before it; default 4): use it instead; remove it"),
    ("--enable-1f1b-v", "--enable-1f1b-v is a flag of the zero-bubble fork, not of megatron-zb: use --schedule "
                        "1f1b-v (1F1B on the V placement); remove it"),
])
def test_a_fork_flag_is_answered_by_name_not_with_a_hint(extra, line):
    err = report(extra)
    assert [p.text for p in err.problems] == [line]
    assert "did you mean" not in str(err)


def test_every_refused_fork_flag_is_answered_with_its_origin_and_all_in_one_report():
    refused = [name for name, f in FORK_FLAGS.items() if not f.accepted]
    assert {"--cpu-offload", "--offload-time", "--auto-offload-time", "--offload-continuous-buffers",
            "--recompute-lgd", "--schedule-timer-start", "--schedule-timer-end", "--interleave-group-size",
            "--use-interlaced-schedule"} <= set(refused)
    extra = " ".join(n + (" 1" if FORK_FLAGS[n].action in ("int", "float") else "") for n in refused)
    err = report(extra)
    assert [p.flag for p in err.problems] == refused
    for p in err.problems:
        assert p.text.startswith(f"{p.flag} is a flag of ") and p.text.endswith("; remove it"), p.text


def test_use_tp_pp_dp_mapping_is_megatron_lm_s_flag_refused_with_its_reason():
    err = report("--use-tp-pp-dp-mapping")
    assert str(err).startswith("--use-tp-pp-dp-mapping is refused: megatron-zb builds megatron-core's default "
                               "rank order")


def test_accepted_fork_flags_say_what_they_do_here():
    notices = validate("--enable-zb-runtime --no-pre-communication-optimization --measure-activation-memory").notices
    assert ("WARNING: --enable-zb-runtime (the zero-bubble fork's flag): megatron-zb's runtime runs every schedule a "
            "zero-bubble flag chooses (megatron-core's own 1F1B runs without one), so the fork's unified runtime is "
            "always on; accepted, no effect") in notices
    assert ("WARNING: --no-pre-communication-optimization (the zero-bubble fork's flag): megatron-zb's runtime sends "
            "no tiny pre-communication before a transfer (it creates and warms up every communicator once, before "
            "the first iteration), which is what this flag asks of the fork; accepted, no effect") in notices
    assert any(n.startswith("WARNING: --measure-activation-memory (the zero-bubble fork's flag): megatron-zb "
                            "measures the activation bytes") for n in notices)
    assert not any("zero-bubble fork" in n for n in validate("").notices)


def test_enable_zero_bubble_with_v_schedule_is_the_v_with_a_log_line():
    """The fork's scripts pass both (ZERO_BUBBLE_V_SCHEDULE=1 sets ENABLE_ZERO_BUBBLE=1)."""
    validated = validate("--enable-zero-bubble --zero-bubble-v-schedule")
    assert validated.args.schedule == "zbv" and validated.args.schedule_placement == "v"
    assert validated.args.num_model_chunks == 2 and validated.args.zero_bubble_max_pending_backward is None
    assert ("--enable-zero-bubble --zero-bubble-v-schedule: the V schedule 'zbv' (the zero-bubble fork's reading "
            "of the pair; --zero-bubble-v-schedule alone means the same)") in validated.notices
    half = validate("--enable-zero-bubble --zero-bubble-v-schedule --zero-bubble-v-schedule-mem-setup half")
    assert half.args.schedule == "v-half"
    alone = validate("--zero-bubble-v-schedule")
    assert alone.args.schedule == "zbv" and not any("reading of the pair" in n for n in alone.notices)


def test_exactly_numeric_match_alone_is_accepted_with_a_warning():
    """Without post-validation (the fork's scripts with FP32 or SYNC_OPTIMIZER): nothing to do here."""
    for extra in ("--enable-exactly-numeric-match", "--enable-zero-bubble --enable-exactly-numeric-match"):
        validated = validate(extra)
        assert validated.args.enable_exactly_numeric_match
        assert ("WARNING: --enable-exactly-numeric-match without --enable-optimizer-post-validation has no effect: "
                "the zero-bubble fork's numeric-match mode makes its schedules reproduce its 1F1B baseline, while "
                "megatron-zb's schedules run megatron-core's own forward and backward steps and are bitwise equal "
                "to megatron-core's schedule wherever the arithmetic is the same (docs/compatibility.md); with "
                "dropout on, the masks follow the execution order, so compare with --attention-dropout 0 "
                "--hidden-dropout 0 (as the fork's scripts do)") in validated.notices


@pytest.mark.parametrize("extra,schedule,line", [
    ("", "1f1b-vocab-2", "--enable-vocab-parallel with no schedule flag (1F1B): schedule '1f1b-vocab-2', the "
                         "family's Vocab-2 form (one all-reduce barrier, as VocabularyParallelism by default; "
                         "--disable-backward-fusion: Vocab-1)"),
    ("--enable-zero-bubble", "zb-vocab-2", "--enable-vocab-parallel with --enable-zero-bubble: schedule "
                                           "'zb-vocab-2', the family's Vocab-2 form (one all-reduce barrier, as "
                                           "VocabularyParallelism by default; --disable-backward-fusion: Vocab-1)"),
    ("--zero-bubble-v-schedule", "zbv-vocab-2", "--enable-vocab-parallel with --zero-bubble-v-schedule: schedule "
                                                "'zbv-vocab-2', the family's Vocab-2 form (one all-reduce barrier, "
                                                "as VocabularyParallelism by default; --disable-backward-fusion: "
                                                "Vocab-1)"),
    ("--zero-bubble-v-schedule --disable-backward-fusion", "zbv-vocab-1",
     "--enable-vocab-parallel with --zero-bubble-v-schedule: schedule 'zbv-vocab-1', the family's Vocab-1 form "
     "(two all-reduce barriers, --disable-backward-fusion)"),
    ("--zero-bubble-v-schedule --zero-bubble-v-schedule-mem-setup min", "v-min-vocab-2",
     "--enable-vocab-parallel with --zero-bubble-v-schedule: schedule 'v-min-vocab-2', the family's Vocab-2 form "
     "(one all-reduce barrier, as VocabularyParallelism by default; --disable-backward-fusion: Vocab-1)"),
    ("--disable-backward-fusion", "1f1b-vocab-1", "--enable-vocab-parallel with no schedule flag (1F1B): schedule "
                                                  "'1f1b-vocab-1', the family's Vocab-1 form (two all-reduce "
                                                  "barriers, --disable-backward-fusion)"),
])
def test_vocab_parallel_takes_the_family_s_vocabulary_form(extra, schedule, line):
    validated = validate("--enable-vocab-parallel " + extra)
    assert validated.args.schedule == schedule and line in validated.notices


@pytest.mark.parametrize("extra,line", [
    ("--enable-vocab-parallel --schedule zb", "--enable-vocab-parallel: needs a schedule that places the vocabulary "
                                              "passes: --schedule zb-vocab-2 or zb-vocab-1 ('zb' places none)"),
    ("--disable-backward-fusion", "--disable-backward-fusion: only applies with --enable-vocab-parallel; add it or "
                                  "drop this flag"),
    ("--enable-vocab-parallel --schedule zb-vocab-2 --disable-backward-fusion",
     "--disable-backward-fusion: asks for a Vocab-1 schedule (two barriers), but --schedule is 'zb-vocab-2'; drop "
     "one of the two"),
])
def test_vocab_form_refusals_name_the_schedule_to_use(extra, line):
    assert str(report(extra)) == line


def test_the_docs_answer_every_fork_flag():
    """docs/training.md "Moving from the zero-bubble fork" names each flag of the table."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    section = doc.split("## Moving from the zero-bubble fork", 1)[1].split("\n## ", 1)[0]
    missing = [name for name in FORK_FLAGS if f"`{name}`" not in section]
    assert not missing, missing


@pytest.mark.parametrize("sizes,rows", [
    ("--vocab-size 8199", 8320),  # 8200 ids: Megatron-LM's 128 x 65 (before issue 41 the flag gave 256 x 33 = 8448)
    ("--vocab-size 8199 --tensor-model-parallel-size 2", 8448),  # 256 x 33 either way (4 slices of 2112)
    ("--vocab-size 1004 --make-vocab-size-divisible-by 5", 1005),  # 201 x 5: 2 slices of 503 and 502
])
def test_vocab_parallel_pads_as_megatron_lm(sizes, rows):
    """docs/vocab_parallel.md "Slices": the flag's padding is Megatron-LM's (``--make-vocab-size-divisible-by
    x TP``) whatever the vocabulary size; the slices split it as evenly as it goes."""
    world = 4 if "--tensor-model-parallel-size 2" in sizes else 2
    extra = f"--tokenizer-type NullTokenizer {sizes}"
    without = pretrain.parse_command_line(shlex.split(f"{BASE} {extra}"), world_size=world).args
    with_flag = pretrain.parse_command_line(shlex.split(f"{BASE} {extra} --enable-vocab-parallel"),
                                            world_size=world).args
    assert (without.padded_vocab_size, with_flag.padded_vocab_size) == (rows, rows)

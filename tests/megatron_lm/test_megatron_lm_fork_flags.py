"""The zero-bubble fork's flags inside Megatron-LM's loop: configure() on Megatron-LM's parsed flags
(no Megatron-LM run): the same answers as ``pretrain_gpt_zb.py`` (one table,
``training/arguments/fork_flags.py``), the fork's V invocation, start-up lines printed once on rank 0."""

from __future__ import annotations

import argparse
import re
from typing import Any

import pytest


@pytest.fixture(autouse=True)
def _fresh_start_up_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees its own start-up lines (the route prints each once per process)."""
    from megatron_zb.megatron_lm import route

    monkeypatch.setattr(route, "_SAID", set())


def _flags(*argv: str, **megatron_lm: Any) -> argparse.Namespace:
    """The zero-bubble flags parsed as on Megatron-LM's parser (:func:`add_flags`), beside the
    Megatron-LM values configure() reads (PP=2, 8 layers, TP=1, fp32, rank 0)."""
    from megatron_zb.megatron_lm import add_flags

    parser = argparse.ArgumentParser()
    add_flags(parser)
    values = dict(pipeline_model_parallel_size=2, tensor_model_parallel_size=1, num_layers=8, rank=0,
                  num_layers_per_virtual_pipeline_stage=None, num_virtual_stages_per_pipeline_rank=None,
                  num_experts=None, fp16=False, bf16=False, overlap_p2p_comm=True)
    return parser.parse_args(argv, namespace=argparse.Namespace(**{**values, **megatron_lm}))


@pytest.mark.parametrize("argv,line", [
    (("--cpu-offload",), "--cpu-offload is a flag of the zero-bubble fork, not of megatron-zb: megatron-zb has no "
                         "activation offload"),
    (("--enable-zero-bubble", "--offload-chunk-num", "4"), "--offload-chunk-num is a flag of the zero-bubble fork"),
    (("--recompute-lgd",), "--recompute-lgd is a flag of the zero-bubble fork, not of megatron-zb: the fork's "
                           "recomputation of layer norm, GeLU and dropout is not in megatron-zb"),
    (("--schedule-timer-start", "10"), "--schedule-timer-start is a flag of VocabularyParallelism, not of "
                                       "megatron-zb: megatron-zb's profiling window is "
                                       "--zero-bubble-pipeline-timers-start-iter N"),
])
def test_a_refused_fork_flag_gets_its_answer_not_argparse_s_error(argv, line):
    """Megatron-LM's parser would stop at the flag ("unrecognized arguments"); here it parses and
    configure() answers it (install() prints the line and exits 2)."""
    from megatron_zb.megatron_lm import configure
    from megatron_zb.training.arguments.common import ArgumentError

    with pytest.raises(ArgumentError, match="^" + re.escape(line)):
        configure(_flags(*argv))


def test_the_fork_s_v_invocation_is_the_v_and_said_once(capsys):
    from megatron_zb.megatron_lm import configure

    args = _flags("--enable-zero-bubble", "--zero-bubble-v-schedule", "--enable-zb-runtime")
    assert configure(args) == {"schedule": "zbv", "timeout": 300.0, "num_chunks": 2,
                               "v_flag": "--zero-bubble-v-schedule"}  # no memory limit: the V's own, as alone
    configure(_flags("--enable-zero-bubble", "--zero-bubble-v-schedule", "--enable-zb-runtime"))  # parsed again
    out = capsys.readouterr().out
    v_line = ("megatron-zb: --enable-zero-bubble --zero-bubble-v-schedule: the V schedule 'zbv' (the zero-bubble "
              "fork's reading of the pair; --zero-bubble-v-schedule alone means the same)")
    assert out.count(v_line + "\n") == 1
    assert out.count("megatron-zb: WARNING: --enable-zb-runtime (the zero-bubble fork's flag): ") == 1


def test_exactly_numeric_match_alone_is_accepted_with_a_warning(capsys):
    from megatron_zb.megatron_lm import configure

    assert configure(_flags("--enable-zero-bubble", "--enable-exactly-numeric-match"))["schedule"] == "zb"
    assert ("megatron-zb: WARNING: --enable-exactly-numeric-match without --enable-optimizer-post-validation has no "
            "effect") in capsys.readouterr().out


def test_other_ranks_print_nothing(capsys):
    from megatron_zb.megatron_lm import configure

    configure(_flags("--enable-zero-bubble", "--measure-activation-memory", rank=1))
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_refused_command_line_is_reported_by_rank_0_only(rank, monkeypatch, capsys):
    """install()'s exit path (``exit_refused``): status 2 on every rank; the report on global rank 0's
    stderr only, the other ranks silent after their wait (tested inside Megatron-LM's loop with its
    real wait: test_megatron_lm_loop.py::test_a_bad_zero_bubble_flag_exits_2_before_any_process_group)."""
    from megatron_zb.megatron_lm import refusals
    from megatron_zb.training.arguments.common import ArgumentError

    waited = []
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(refusals.time, "sleep", waited.append)
    with pytest.raises(SystemExit) as e:
        refusals.exit_refused(ArgumentError.combine([ArgumentError("--a", "one"), ArgumentError("--b", "two")]))
    assert e.value.code == 2
    out = capsys.readouterr()
    assert out.out == ""
    if rank == "0":
        assert out.err.startswith("megatron-zb: error: 2 problems with the command line") and waited == []
    else:
        assert out.err == "" and waited == [refusals.QUIET_RANKS_WAIT_S]

"""Public launch scripts run with pretrain_gpt_zb.py: NVIDIA's LLaMA-3 8B, Mixtral 8x7B and GPT-3 175B
examples, the zero-bubble fork's pretrain_zero_bubble.sh and pretrain_offload.sh, and
VocabularyParallelism's pretrain_gpt.sh, scaled to CPU (:mod:`harness.megatron_lm_examples`: sizes,
iteration counts and paths changed, CPU-only flags dropped with their reason, every other flag verbatim).

Each script trains with ``--use-megatron-core-schedule`` (the reference), ``--enable-zero-bubble``
(bitwise the same loss, grad norm and loss scale every iteration; the fork's scripts with the flags their
``ENABLE_ZERO_BUBBLE=1`` adds) and ``--zero-bubble-v-schedule`` (the fork's script: what its
``ZERO_BUBBLE_V_SCHEDULE=1`` adds; not Mixtral's nor the offload script's V: see :data:`SCRIPTS`).
The offload script is refused as published, in one report naming exactly its flags megatron-zb has no
counterpart of (:data:`~harness.megatron_lm_examples.ZB_OFFLOAD_REFUSED`), and trains without them.
VocabularyParallelism's script trains with its ``--enable-vocab-parallel`` against the same script on
megatron-core's schedule without it, within docs/vocab_parallel.md's half-precision tolerance.
The V placement puts the last stage's layers on rank 0, where the dropout streams are another
rank's, so V is compared within 1e-5 relative on the scripts without dropout (LLaMA-3, Mixtral:
hidden and attention dropout 0; the difference is the tied-gradient summation order and the
placement's other reduction order); on the scripts with Megatron-LM's default dropout 0.1 (GPT-3,
the fork; both fp16) V's losses are finite and its loss scaler decides as the reference's (the same
skipped iterations and loss scales).
The LLaMA-3 FP8 variant is refused on CPU with one message naming its four FP8 flags. With
megatron-core 0.19 (no batch-size ramp-up calculator) the GPT-3 script, which ramps its batch, is
refused up front naming ``--rampup-batch-size`` and the version instead of trained.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from harness.megatron_lm_examples import (GPT3_175B, LLAMA3_8B, LLAMA3_8B_FP8, MIXTRAL_8X7B, VP_GPT,
                                          VP_VOCAB_PARALLEL, ZB_FORK, ZB_FORK_V_SCHEDULE, ZB_FORK_ZERO_BUBBLE,
                                          ZB_OFFLOAD, ZB_OFFLOAD_REFUSED)
from megatron_zb.megatron_compat import rampup_calculator
from harness.trainer_run import in_process_many

SCRIPTS = {"llama3_8b": (LLAMA3_8B, True), "mixtral_8x7b": (MIXTRAL_8X7B, None), "gpt3_175b": (GPT3_175B, False),
           "zb_fork": (ZB_FORK, False), "zb_offload": (ZB_OFFLOAD, None)}
"""name -> (script, whether it trains without dropout; ``None``: no V run here -- Mixtral's 4-process V
run would add ~80 s to CI, and V with MoE and expert parallelism 2 at PP=2 is compared with
megatron-core in tests/training/test_deepseek_v3.py (PP=2 x DP=2, EP=2); the offload script's V is the fork
script's, run there)."""

ZERO_BUBBLE = {"zb_fork": ZB_FORK_ZERO_BUBBLE, "zb_offload": ZB_FORK_ZERO_BUBBLE}
"""The fork's scripts: what their ``ENABLE_ZERO_BUBBLE=1`` adds (the others: ``--enable-zero-bubble``)."""


def _curve(run: dict) -> list[tuple[int, float, float | None, float, bool]]:
    return [(r["iteration"], r["lm loss"], r["grad norm"], r["loss scale"], r["skipped"])
            for r in run["values"]["train"]]


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_launch_script_trains_with_every_schedule_family(tmp_path, name):
    script, no_dropout = SCRIPTS[name]
    if "--rampup-batch-size" in script.argv(tmp_path / "mcore", pretrain=True) and rampup_calculator() is None:
        _assert_ramp_refused(script, tmp_path)  # megatron-core 0.19: GPT-3's published ramp
        return

    flags = {"mcore": ["--use-megatron-core-schedule"], "zb": list(ZERO_BUBBLE.get(name, ["--enable-zero-bubble"]))}
    if no_dropout is not None:
        flags["zbv"] = list(ZB_FORK_V_SCHEDULE) if script is ZB_FORK else ["--zero-bubble-v-schedule"]
    # one launch for the script's runs, each with its flags added and its own folder (the scripts --save and
    # --load one path)
    runs = in_process_many(tmp_path, {label: script.argv(tmp_path / label, pretrain=True) + extra
                                      for label, extra in flags.items()}, script.world_size)
    ref = _curve(runs["mcore"])
    assert len(ref) >= 4 and all(math.isfinite(loss) for _, loss, *_ in ref), ref
    got = _curve(runs["zb"])
    assert got == ref, f"{name}: zero bubble {got} != megatron-core {ref}"
    if no_dropout is None:
        return
    v = _curve(runs["zbv"])
    assert [i for i, *_ in v] == [i for i, *_ in ref]
    if no_dropout:
        for (i, loss, *_), (_, want, *_) in zip(v, ref):
            assert loss == pytest.approx(want, rel=1e-5), f"{name} V iteration {i}: {loss} vs {want}"
    else:  # fp16 scripts: the loss scaler's decisions (skipped iterations, scale) are the reference's
        assert all(math.isfinite(loss) for _, loss, *_ in v), v
        assert [(i, scale, skipped) for i, _, _, scale, skipped in v] == \
            [(i, scale, skipped) for i, _, _, scale, skipped in ref], (v, ref)


def _assert_ramp_refused(script, tmp_path) -> None:
    """A script with ``--rampup-batch-size`` on a megatron-core without the ramp-up calculator (0.19):
    refused up front in one problem naming the flag and the installed version."""
    from megatron_zb.megatron_compat import megatron_core_version
    from megatron_zb.training.arguments import ArgumentError
    from megatron_zb.training.pretrain import parse_command_line

    argv = script.argv(tmp_path / "mcore", pretrain=True) + ["--use-megatron-core-schedule"]
    with pytest.raises(ArgumentError) as e:
        parse_command_line(argv, world_size=script.world_size)
    [problem] = e.value.problems
    assert problem.flag == "--rampup-batch-size", str(e.value)
    assert f"megatron-core {megatron_core_version()} has no batch-size ramp-up calculator" in problem.text


def test_llama3_fp8_variant_is_refused_naming_every_fp8_flag(tmp_path):
    from megatron_zb.training.arguments import ArgumentError
    from megatron_zb.training.pretrain import parse_command_line

    argv = LLAMA3_8B.argv(tmp_path / "run", pretrain=True) + list(LLAMA3_8B_FP8) + ["--enable-zero-bubble"]
    with pytest.raises(ArgumentError) as e:
        parse_command_line(argv, world_size=LLAMA3_8B.world_size)
    [problem] = e.value.problems  # one problem naming every FP8 flag of the script
    assert problem.flag == "--fp8-format"
    assert problem.text.startswith("--fp8-format: --fp8-format, --fp8-amax-history-len, --fp8-amax-compute-algo, "
                                   "--fp8-param-gather: FP8 needs Transformer Engine's layers"), problem.text


def test_offload_script_is_refused_naming_its_offload_flags(tmp_path):
    """pretrain_offload.sh as published (``OFFLOAD=1``, its zero-bubble flags): one report, one line per
    flag, exactly PipeOffload's ``--recompute-lgd``, ``--offload-continuous-buffers``, ``--cpu-offload`` and
    the rank order ``--use-tp-pp-dp-mapping``, each naming what megatron-zb offers instead; no other flag."""
    from megatron_zb.training.arguments import ArgumentError
    from megatron_zb.training.pretrain import parse_command_line

    published = dataclasses.replace(ZB_OFFLOAD, pretrain_dropped={})
    with pytest.raises(ArgumentError) as e:
        parse_command_line(published.argv(tmp_path, pretrain=True) + list(ZB_FORK_ZERO_BUBBLE),
                           world_size=ZB_OFFLOAD.world_size)
    assert [p.flag for p in e.value.problems] == list(ZB_OFFLOAD_REFUSED), str(e.value)  # the script's order
    for p in e.value.problems:
        assert p.text.startswith(p.flag) and p.text.endswith("; remove it") and "did you mean" not in p.text, p.text
    assert set(ZB_OFFLOAD.pretrain_dropped) == set(ZB_OFFLOAD_REFUSED)


def test_vocabulary_parallelism_script_matches_megatron_core(tmp_path):
    """VocabularyParallelism's pretrain_gpt.sh with its ``VOCAB_PARALLEL=1`` flag (``--enable-vocab-parallel``:
    ``1f1b-vocab-2``, one barrier, the paper's rescaled softmax) against the same script on megatron-core's
    1F1B without it (fp16, untied, distributed optimizer, 4 iterations of 3 micro batches): the same
    iterations, loss scales and skipped iterations; every loss within a relative 2^-12 and every grad norm
    within 2^-9 -- docs/vocab_parallel.md's half-precision bounds (each slice's part of the output layer's
    input gradient is rounded to fp16, then summed over the slices: another rounding than megatron-core's
    one GEMM; the softmax sums its slices in another order)."""
    runs = in_process_many(tmp_path, {"mcore": VP_GPT.argv(tmp_path / "mcore", pretrain=True)
                                      + ["--use-megatron-core-schedule"],
                                      "vocab": VP_GPT.argv(tmp_path / "vocab", pretrain=True) + list(VP_VOCAB_PARALLEL)},
                           2)
    ref, run = _curve(runs["mcore"]), runs["vocab"]
    assert "schedule 1f1b-vocab-2 (" in run["log"] and "vocabulary parallelism: 2 slices of 128 rows" in run["log"]
    got = _curve(run)
    assert len(ref) == 4 and all(math.isfinite(loss) for _, loss, *_ in ref), ref
    assert [(i, scale, skipped) for i, _, _, scale, skipped in got] == \
        [(i, scale, skipped) for i, _, _, scale, skipped in ref], (got, ref)
    for (i, loss, norm, *_), (_, want_loss, want_norm, *_) in zip(got, ref):
        assert loss == pytest.approx(want_loss, rel=2 ** -12), f"iteration {i}: loss {loss} vs {want_loss}"
        assert norm == pytest.approx(want_norm, rel=2 ** -9), f"iteration {i}: grad norm {norm} vs {want_norm}"

"""Optimizer post-validation inside NVIDIA Megatron-LM's own training loop (``pretrain_gpt.py`` of core_v0.16.1
or core_v0.19.0), through the flags route (``megatron_zb.megatron_lm.install()``,
``--enable-optimizer-post-validation``), on CPU.

The runs reuse tests/megatron_lm/test_megatron_lm_loop.py's harness, flag sets and checks. One configuration per
Megatron-LM release, tiny GPT at PP=2 in fp16, is chosen so that one run meets every case of
post-validation (the test asserts each happens; they are facts of the configuration, measured, not
assumed; :data:`CASES`). core_v0.16.1 with megatron-core 0.16.1:

* loss scale 2^19: stage 0's fp16 gradients overflow in iterations 2 and 3, stage 1's do not, so
  stage 1 has stepped eagerly and must roll its step back (inf/nan: skipped, and counted as a
  skipped iteration by Megatron-LM; the loss scale is halved after the second, as Megatron-LM's
  hysteresis does);
* ``--clip-grad 1.6``: iteration 1's global grad norm (1.507) is below it -- an eager step that
  stands -- and iteration 4's is above it while each stage's own part is below, so both stages
  stepped eagerly and redo the step with clipped gradients.

core_v0.19.0 with megatron-core 0.19.2 (other initial weights: 2^19 overflows in iterations 2-4
there): loss scale 2^18 overflows stage 0 in iteration 3 only (rolled back on stage 1), and
``--clip-grad 1.9`` lets iterations 1 and 2 (1.510, 1.853) stand and clips iteration 4 (1.998) on
both stages; the hysteresis halving is not met.

``--post-validation-warmup-iters 0 --post-validation-fallback-clean-iters 0`` make every step
eager. megatron-core's own 1F1B with the same flags, without post-validation, runs once (the
baseline); with ``--enable-exactly-numeric-match`` the run is bitwise equal to it, with the default
in-place rollback (Adam inverted algebraically) equal up to round-off.
"""

from __future__ import annotations

import math
import re

import pytest
import test_megatron_lm_loop
from test_megatron_lm_loop import FLAGS_PLUGIN, ITERS, MCORE_1F1B, PP2, REPLAN_FUNC, loop_flags, run_loop, assert_bitwise_equal

from megatron_zb.megatron_compat import megatron_lm_tag
from megatron_zb.megatron_lm.optimizer import REFUSED
from harness.megatron_lm import MegatronLMRun

pytestmark = test_megatron_lm_loop.pytestmark  # skipped without Megatron-LM's files or what they import

CASES = {
    "core_v0.16.1": dict(flags=("--fp16", "--initial-loss-scale", str(2 ** 19), "--clip-grad", "1.6"),
                         skipped=[False, True, True, False],
                         rollbacks={(2, 1, "inf"), (3, 1, "inf"), (4, 0, "clip"), (4, 1, "clip")}),
    "core_v0.19.0": dict(flags=("--fp16", "--initial-loss-scale", str(2 ** 18), "--clip-grad", "1.9"),
                         skipped=[False, False, True, False],
                         rollbacks={(3, 1, "inf"), (4, 0, "clip"), (4, 1, "clip")}),
}
"""Per Megatron-LM release (module docstring): the fp16 flags, which iterations the baseline skips
(fp16 overflow), and the rollbacks ``(iteration, rank, kind)`` post-validation makes -- measured."""
CASE = CASES[megatron_lm_tag()]
FP16: tuple[str, ...] = CASE["flags"]  # type: ignore[assignment]
"""fp16 with a loss scale that overflows stage 0 only (in some iterations); clipping that fires in 4 only."""
POST_VALIDATION = ("--enable-zero-bubble", "--enable-optimizer-post-validation", "--post-validation-warmup-iters", "0",
                   "--post-validation-fallback-clean-iters", "0")
"""Every step post-validated (no synchronous warm-up, no fallback after a rollback)."""
LOGGED = ("learning rate", "loss scale", "lm loss", "grad norm", "number of skipped iterations",
          "number of nan iterations")
"""The fields of Megatron-LM's iteration line compared with the baseline (the others are timings)."""
ROLLBACK = re.compile(r"^megatron-zb: post-validation rolled back the step of iteration (\d+) on rank (\d+): "
                      r"(an inf/nan was found|the gradients were clipped)", re.M)


@pytest.fixture(scope="module")
def mcore_fp16() -> MegatronLMRun:
    """megatron-core's own 1F1B with :data:`FP16`, no post-validation: the baseline."""
    return run_loop(PP2, world_size=2, extra=FP16)


def logged(run: MegatronLMRun) -> list[dict[str, str]]:
    """Per iteration, the :data:`LOGGED` fields of the last rank's printed line."""
    rows = []
    for it in run.iterations:
        fields = dict(part.split(":", 1) for part in it.line.split("|") if ":" in part)
        rows.append({key: fields.get(f" {key}", "").strip() for key in LOGGED})
    return rows


def rollbacks(run: MegatronLMRun) -> set[tuple[int, int, str]]:
    """``(iteration, rank, "inf" | "clip")`` of every rollback line of every rank."""
    return {(int(m[0]), int(m[1]), "inf" if "inf" in m[2] else "clip")
            for log in run.logs for m in ROLLBACK.findall(log)}


def assert_same_events(run: MegatronLMRun, base: MegatronLMRun) -> None:
    """The baseline skips iterations 2-3 (fp16 overflow) and clips; the post-validated run rolled back
    what the module docstring says, ran the zero-bubble schedule, and logged what the baseline logged
    (learning rate, loss scale, skipped-iteration count: Megatron-LM's own counting)."""
    assert [it.iteration for it in base.iterations] == list(range(1, ITERS + 1)), base.logs[-1][-2000:]
    skipped: list[bool] = CASE["skipped"]  # type: ignore[assignment]
    assert [n is None for n in base.grad_norms] == skipped  # Megatron-LM logs no norm when skipped
    assert [row["number of skipped iterations"] for row in logged(base)] == [str(int(x)) for x in skipped]
    assert rollbacks(run) == CASE["rollbacks"]
    assert {it.forward_backward for it in run.iterations} == {REPLAN_FUNC}
    assert {it.forward_backward for it in base.iterations} == {MCORE_1F1B}
    assert logged(run) == logged(base)


def test_post_validation_exact_is_bitwise_megatron_core(mcore_fp16: MegatronLMRun) -> None:
    """``--enable-exactly-numeric-match``: the eager step that stands (iteration 1), the skipped
    ones rolled back (2, 3) and the clipped one redone (4) give megatron-core's synchronous result
    bit for bit: every iteration's lm loss and grad norm, every rank's parameters."""
    run = run_loop(PP2, world_size=2, plugin=FLAGS_PLUGIN,
               extra=(*FP16, *POST_VALIDATION, "--enable-exactly-numeric-match"))
    assert "> optimizer post-validation (exact rollback): synchronous steps in the first 0 iteration(s)" in run.logs[0]
    assert_same_events(run, mcore_fp16)
    assert_bitwise_equal(run, mcore_fp16)


def test_post_validation_in_place_matches_megatron_core(mcore_fp16: MegatronLMRun) -> None:
    """The default in-place rollback: bitwise until the first rollback (iteration 2's loss is
    computed after iteration 1's eager step), then equal to fp32 round-off in the main params --
    which can move an fp16 model parameter by one unit in the last place (at most 2^-10 relative)."""
    run = run_loop(PP2, world_size=2, plugin=FLAGS_PLUGIN, extra=(*FP16, *POST_VALIDATION))
    assert "> optimizer post-validation (in-place rollback)" in run.logs[0]
    assert_same_events(run, mcore_fp16)
    assert run.lm_losses[:2] == mcore_fp16.lm_losses[:2] and run.grad_norms[0] == mcore_fp16.grad_norms[0]
    for mine, theirs in zip(run.lm_losses + run.grad_norms, mcore_fp16.lm_losses + mcore_fp16.grad_norms):
        assert (mine is None) == (theirs is None) and (mine is None or math.isclose(mine, theirs, rel_tol=1e-4))
    assert run.params is not None and mcore_fp16.params is not None
    for mine, theirs in zip(run.params, mcore_fp16.params):
        assert mine.keys() == theirs.keys()
        for name in mine:
            diff = (mine[name].float() - theirs[name].float()).abs()
            assert bool((diff <= 2 ** -10 * theirs[name].float().abs() + 1e-6).all()), name


# ---------------------------------------------------------------------- configure(): no Megatron-LM run
def _pv_flags(*argv: str, **megatron_lm: object) -> object:
    """The zero-bubble flags parsed as on Megatron-LM's parser, with the optimizer flags of
    Megatron-LM that :func:`~megatron_zb.megatron_lm.optimizer.check_flags` reads (defaults: adam,
    no offload / FSDP / expert parallelism) overridden by ``megatron_lm``."""
    args = loop_flags(*argv)
    for dest, value in {"optimizer": "adam", "expert_model_parallel_size": 1, **megatron_lm}.items():
        setattr(args, dest, value)
    return args


@pytest.mark.parametrize("argv,megatron_lm,message", [
    (("--enable-optimizer-post-validation",), {},
     "--enable-optimizer-post-validation: needs a zero-bubble schedule, but the schedule is megatron-core's own"),
    (("--schedule", "1f1b", "--enable-optimizer-post-validation"), {},
     "--enable-optimizer-post-validation: needs a zero-bubble schedule, but the schedule is '1f1b'"),
    (("--enable-zero-bubble", "--post-validation-warmup-iters", "2"), {},
     "--post-validation-warmup-iters: only applies with --enable-optimizer-post-validation"),
    (("--enable-zero-bubble", "--enable-optimizer-post-validation"), {"optimizer": "sgd"},
     "--optimizer: 'sgd': the in-place rollback inverts Adam steps only; add --enable-exactly-numeric-match"),
    (("--enable-zero-bubble", "--enable-optimizer-post-validation", "--enable-exactly-numeric-match"),
     {"optimizer": "dist_muon"}, "--optimizer: 'dist_muon': Megatron-LM builds Muon with get_megatron_muon_optimizer"),
    (("--enable-zero-bubble", "--enable-optimizer-post-validation"), {"expert_model_parallel_size": 2},
     "--expert-model-parallel-size: expert parallelism gives the expert optimizer another grad-stats group"),
])
def test_configure_refuses_what_post_validation_cannot_do(argv: tuple[str, ...], megatron_lm: dict,
                                                          message: str) -> None:
    """Refused with the flag named, before Megatron-LM initialises (install() prints it as one line
    and exits 2: tests/megatron_lm/test_megatron_lm_loop.py runs that path)."""
    from megatron_zb.megatron_lm import configure
    from megatron_zb.training.arguments.common import ArgumentError

    with pytest.raises(ArgumentError, match=re.escape(message)):
        configure(_pv_flags(*argv, **megatron_lm))


@pytest.mark.parametrize("dest", list(REFUSED))
def test_configure_refuses_megatron_lm_optimizer_flags_post_validation_does_not_mirror(dest: str) -> None:
    from megatron_zb.megatron_lm import configure
    from megatron_zb.training.arguments.common import ArgumentError

    args = _pv_flags("--enable-zero-bubble", "--enable-optimizer-post-validation", **{dest: True})
    flag = "--" + dest.replace("_", "-")
    with pytest.raises(ArgumentError, match=re.escape(f"{flag}: cannot be combined with "
                                                      f"--enable-optimizer-post-validation: {REFUSED[dest]}")):
        configure(args)


def test_configure_refuses_in_place_rollback_of_fused_adam(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where Transformer Engine or apex is installed megatron-core builds their FusedAdam, which the
    in-place rollback cannot invert: refused up front (neither is installed here, so megatron-core's
    own ``USING_PYTORCH_OPTIMIZER`` is set as an installation of either sets it); exact mode is accepted."""
    import megatron.core.optimizer

    from megatron_zb.megatron_lm import configure
    from megatron_zb.training.arguments.common import ArgumentError

    monkeypatch.setattr(megatron.core.optimizer, "USING_PYTORCH_OPTIMIZER", False)
    with pytest.raises(ArgumentError, match=re.escape("--enable-optimizer-post-validation: the in-place rollback "
                                                      "inverts torch.optim Adam steps only")):
        configure(_pv_flags("--enable-zero-bubble", "--enable-optimizer-post-validation"))
    assert configure(_pv_flags("--enable-zero-bubble", "--enable-optimizer-post-validation",
                               "--enable-exactly-numeric-match")) is not None


def test_configure_accepts_post_validation_with_a_zero_bubble_schedule() -> None:
    """Accepted with the zero-bubble schedule's options; the tuning flags default as in pretrain_gpt_zb.py."""
    from megatron_zb.megatron_lm import configure

    args = _pv_flags("--enable-zero-bubble", "--enable-optimizer-post-validation", "--enable-exactly-numeric-match",
                     optimizer="sgd")
    assert configure(args) == {"schedule": "zb", "timeout": 300.0, "memory_limit": 2.0}
    assert (args.post_validation_warmup_iters, args.post_validation_fallback_clean_iters) == (10, 10)

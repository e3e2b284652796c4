"""Training length in samples and the batch-size ramp-up, with Megatron-LM's meanings, end to end.

``pretrain_gpt_zb.py``'s trainer runs in-process on 2 ranks of ``run_distributed`` (the harness of
``tests/training/test_pretrain.py``; a few seconds per run): PP=2, DP=1, micro batch 2, tiny GPT, mock data,
Megatron-LM's default dropout (0.1).

* ``--train-samples`` / ``--lr-decay-samples`` / ``--lr-warmup-samples`` / ``--lr-wsd-decay-samples``
  train the same iterations with the same LR sequence and loss curve, bit for bit, as the
  equivalent ``--train-iters`` / ``--lr-decay-iters`` / ``--lr-warmup-iters`` / ``--lr-wsd-decay-iters``
  (``--lr-decay-style WSD``);
* ``--rampup-batch-size 4 2 16`` with ``--global-batch-size 8`` and ``--train-samples 64``: global
  batches 4, 4, 6, 6, 8, 8, 8, 8, 8 (megatron-core's calculator: 2 increments of 8 samples; the
  ramp's iterations and then (64 - 20) // 8 = 5, Megatron-LM's ``update_train_iters``), so 2, 3 and
  4 micro batches; greedy zero bubble (rebuilt at each change, re-planned from the measured costs
  after the profiling window) and megatron-core's 1F1B give the same curve bit for bit;
* the run saves a checkpoint before each change of the batch (Megatron-LM's rule); resuming the
  one of iteration 2 (before the ramp's first step) continues the ramp and the curve bit for bit.
"""

from __future__ import annotations

import math
import re
import shlex
import shutil

import pytest

from harness.pretrain_harness import SMALL, without, in_process, losses, train  # the end-to-end harness

from megatron_zb.megatron_compat import rampup_calculator

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]

BASE = without(SMALL, "--hidden-dropout", "--attention-dropout", "--global-batch-size") + [
    "--pipeline-model-parallel-size", "2", "--lr-decay-style", "cosine", "--min-lr", "2e-4"]
"""SMALL of test_pretrain with Megatron's default dropout, PP=2 (2 ranks: DP=1), cosine decay to 2e-4."""

RAMP = without(BASE, "--eval-iters") + [
    "--global-batch-size", "8", "--train-samples", "64", "--rampup-batch-size", "4", "2", "16",
    "--lr-warmup-samples", "8", "--eval-interval", "3", "--eval-iters", "1"]
"""Evaluation (one batch of --global-batch-size, as Megatron-LM's) after iterations 3 (mid-ramp), 6 and 9, then
the validation and test sets at the end."""
RAMP_BATCHES = [4, 4, 6, 6, 8, 8, 8, 8, 8]
"""The global batch of each iteration of RAMP, worked out by hand from megatron-core's rule."""
NEEDS_RAMP = pytest.mark.skipif(rampup_calculator() is None, reason=(
    "this megatron-core (0.19) has no batch-size ramp-up calculator: --rampup-batch-size is refused "
    "(test_rampup_batch_size_is_refused_naming_the_release)"))


def _lr_and_loss(run: dict) -> list[tuple]:
    return [(r["iteration"], r["lm loss"], r["learning rate"], r["grad norm"]) for r in train(run)]


def test_samples_flags_train_as_the_equivalent_iteration_flags(tmp_path):
    """48 samples of 8 = 6 iterations; warm-up 8 samples = 1 iteration; decay 32 samples = 4 iterations,
    WSD with a linear annealing phase of 16 samples = 2 iterations at its end (iterations 5 and 6 at --min-lr)."""
    wsd = ["--use-megatron-core-schedule", "--global-batch-size", "8", "--lr-decay-style", "WSD",
           "--lr-wsd-decay-style", "linear"]
    iters = in_process(tmp_path, "iters", 2, BASE + wsd + [
        "--train-iters", "6", "--lr-warmup-iters", "1", "--lr-decay-iters", "4", "--lr-wsd-decay-iters", "2"])
    samples = in_process(tmp_path, "samples", 2, BASE + wsd + [
        "--train-samples", "48", "--lr-warmup-samples", "8", "--lr-decay-samples", "32", "--lr-wsd-decay-samples", "16"])
    assert sorted(losses(samples)) == list(range(1, 7))
    assert _lr_and_loss(samples) == _lr_and_loss(iters)
    # after 8, 16, ... samples: warm-up to --lr; stable until 32 - 16; linear to --min-lr at 32; then --min-lr
    want = [2e-3, 2e-3, 2e-4 + 0.5 * 1.8e-3, 2e-4, 2e-4, 2e-4]
    assert [r["learning rate"] for r in train(samples)] == pytest.approx(want, rel=1e-12)
    assert all(r["global batch size"] == 8 for r in train(samples))
    assert "consumed samples:           48" in samples["log"]


def _ramp_lines(log: str) -> list[str]:
    return [ln for ln in log.splitlines() if re.match(r"> global batch size \d+ -> \d+ at iteration", ln)]


@NEEDS_RAMP
def test_rampup_batch_size_rebuilds_the_schedule_and_matches_megatron_core(tmp_path):
    """Both schedules see m = 2, 3, 4; zero bubble rebuilds its schedule at each change (the last one
    from the costs measured in iterations 2-3) and gives megatron-core's curve bit for bit. Then a
    resume from the checkpoint saved before the first change continues the ramp bit for bit."""
    from megatron_zb.schedules import CostModel
    from megatron_zb.schedules.registry import build_schedule

    zb = in_process(tmp_path, "zb", 2, RAMP + ["--enable-zero-bubble", "--save", str(tmp_path / "ckpt")])
    mcore = in_process(tmp_path, "mcore", 2, RAMP + ["--use-megatron-core-schedule"])
    for run in (zb, mcore):
        assert [r["global batch size"] for r in train(run)] == RAMP_BATCHES
    assert _lr_and_loss(zb) == _lr_and_loss(mcore)
    valid = [v["lm loss"] for v in zb["values"]["valid"]]
    assert len(valid) == 5 and valid == [v["lm loss"] for v in mcore["values"]["valid"]]  # 3, 6, 9, valid, test
    assert sorted(losses(zb)) == list(range(1, 10))
    # the LR scheduler counts the samples of each iteration: warm-up over 8 samples, cosine decay to
    # --min-lr over --train-samples (Megatron-LM's default --lr-decay-samples)
    consumed = [sum(RAMP_BATCHES[:k + 1]) for k in range(len(RAMP_BATCHES))]
    want_lr = [2e-3 * n / 8 if n <= 8 else 2e-4 + 1.8e-3 * 0.5 * (math.cos(math.pi * (n - 8) / 56) + 1.0)
               for n in consumed]
    assert [r["learning rate"] for r in train(zb)] == pytest.approx(want_lr, rel=1e-12)
    # Megatron-LM's line reports each iteration's global batch
    sizes = [int(m.group(1)) for m in re.finditer(r"\] iteration\s+\d+/\s+9 \|.* global batch size:\s+(\d+) \|",
                                                  zb["log"])]
    assert sizes == RAMP_BATCHES, zb["log"][-3000:]
    # each change is logged with the schedule it installs
    changes = _ramp_lines(zb["log"])
    assert [re.search(r"(\d+ -> \d+) at iteration (\d+)", ln).groups() for ln in changes] == [
        ("4 -> 6", "3"), ("6 -> 8", "5")]
    assert "schedule 'zb' rebuilt for 3 micro batches from unit costs (before profiling)" in changes[0]
    assert "schedule 'zb' rebuilt for 4 micro batches re-planned from the measured costs" in changes[1]
    assert "global batch size 4 to start with: schedule 'zb' rebuilt for 2 micro batches" in zb["log"]
    assert [re.search(r"(\d+ -> \d+)", ln).group(1) for ln in _ramp_lines(mcore["log"])] == ["4 -> 6", "6 -> 8"]
    assert "megatron-core's forward_backward_func runs 4 micro batches per iteration" in mcore["log"]
    # the installed schedule for m = 4 is the greedy schedule of the measured (checkpointed) costs
    costs = CostModel(**zb["costs"])
    want = build_schedule("zb", num_ranks=2, num_microbatches=4, costs=costs, memory_limit=costs.memory_limit)
    assert zb["installed"].ranks == want.ranks
    # checkpoints before each change (Megatron-LM), and at the end
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("iter_"))
    assert saved == ["iter_0000002", "iter_0000004", "iter_0000009"]

    shutil.copytree(tmp_path / "ckpt" / "iter_0000002", tmp_path / "ckpt2" / "iter_0000002")
    (tmp_path / "ckpt2" / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = in_process(tmp_path, "resumed", 2, RAMP + ["--enable-zero-bubble", "--load", str(tmp_path / "ckpt2")])
    assert "at iteration 2" in resumed["log"] and "random states are not restored" not in resumed["log"]
    assert [r["global batch size"] for r in train(resumed)] == RAMP_BATCHES[2:]
    assert _lr_and_loss(resumed) == _lr_and_loss(zb)[2:]
    assert [v["lm loss"] for v in resumed["values"]["valid"]] == valid  # iterations 3, 6, 9, valid and test
    # the checkpoint holds 8 consumed samples: the ramp resumes at 6 (megatron-core's calculator, as Megatron-LM)
    assert "global batch size 6 to start with: schedule 'zb' rebuilt for 3 micro batches" in resumed["log"]
    assert [re.search(r"(\d+ -> \d+) at iteration (\d+)", ln).groups() for ln in _ramp_lines(resumed["log"])] == [
        ("6 -> 8", "5")]


# ---------------------------------------------------------------------------- validation (no run)
def _validate(extra: str):
    from megatron_zb.training.pretrain import parse_command_line

    base = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 --lr 1e-3 " \
           "--mock-data --pipeline-model-parallel-size 2 --enable-zero-bubble"
    return parse_command_line(shlex.split(base + " " + extra), world_size=2)


@pytest.mark.parametrize("extra,flag,text", [
    ("--train-iters 4 --train-samples 32", "--train-iters", "exactly one of"),
    ("--global-batch-size 8", "--train-iters", "exactly one of"),
    ("--train-iters 4 --lr-decay-samples 16", "--lr-decay-samples", "use --lr-decay-iters"),
    ("--train-iters 4 --lr-warmup-samples 8", "--lr-warmup-samples", "use --lr-warmup-iters"),
    ("--global-batch-size 8 --train-iters 4 --rampup-batch-size 4 2 16", "--rampup-batch-size", "use --train-samples"),
    ("--train-samples 32 --lr-decay-iters 4", "--lr-decay-iters", "use --lr-decay-samples"),
    ("--train-samples 32 --lr-warmup-iters 1", "--lr-warmup-iters", "use --lr-warmup-samples"),
    ("--train-samples 32 --lr-warmup-samples 8 --lr-warmup-fraction 0.1", "--lr-warmup-fraction", "keep one"),
    ("--train-iters 4 --lr-warmup-iters 1 --lr-warmup-fraction 0.1", "--lr-warmup-fraction", "keep one"),
    ("--train-samples 32 --lr-warmup-fraction 1.5", "--lr-warmup-fraction", "[0, 1)"),
    ("--train-samples 32 --lr-warmup-samples 32", "--lr-warmup-samples", "shorter than the decay"),
    pytest.param("--global-batch-size 8 --train-samples 64 --rampup-batch-size 4 3 16", "--rampup-batch-size",
                 "does not reach", marks=NEEDS_RAMP),
    pytest.param("--global-batch-size 8 --train-samples 64 --rampup-batch-size 8 2 16", "--rampup-batch-size",
                 "does not reach", marks=NEEDS_RAMP),
    pytest.param("--global-batch-size 8 --train-samples 64 --rampup-batch-size 4 2 0", "--rampup-batch-size",
                 "must be >= 1", marks=NEEDS_RAMP),
    pytest.param("--global-batch-size 12 --train-samples 64 --rampup-batch-size 3 3 16", "--rampup-batch-size",
                 "multiples of --micro-batch-size", marks=NEEDS_RAMP),
    ("--global-batch-size 8 --train-samples 4", "--train-samples", "less than one global batch"),
    ("--train-iters 4 --lr-decay-style WSD", "--lr-decay-style", "add --lr-wsd-decay-iters N"),
    ("--train-iters 4 --lr-decay-style WSD --lr-wsd-decay-iters 5", "--lr-wsd-decay-iters", "within the decay"),
    ("--train-iters 4 --lr-decay-style WSD --lr-wsd-decay-samples 5", "--lr-wsd-decay-samples",
     "use --lr-wsd-decay-iters"),
    ("--train-samples 32 --lr-decay-style WSD --lr-wsd-decay-iters 1", "--lr-wsd-decay-iters",
     "use --lr-wsd-decay-samples"),
])
def test_training_length_flags_are_checked_as_megatron_lm(extra, flag, text):
    from megatron_zb.training.arguments import ArgumentError

    with pytest.raises(ArgumentError) as e:
        _validate(extra)
    assert e.value.flag == flag and text in str(e.value), str(e.value)


@pytest.mark.parametrize("extra,steps,iters", [
    ("--global-batch-size 8 --train-iters 6 --lr-decay-iters 4 --lr-warmup-fraction 0.25", (8.0, 32, 48, None), 6),
    ("--global-batch-size 8 --train-samples 52 --lr-decay-samples 32 --lr-warmup-fraction 0.25", (8.0, 32, 52, None),
     6),
    ("--global-batch-size 8 --train-samples 52 --lr-warmup-samples 5", (5, 52, 52, None), 6),
    ("--global-batch-size 8 --train-iters 6 --lr-decay-style WSD --lr-wsd-decay-iters 2", (0, 48, 48, 16), 6),
    pytest.param("--global-batch-size 8 --train-samples 64 --rampup-batch-size 4 2 16", (0, 64, 64, None), 9,
                 marks=NEEDS_RAMP),
])
def test_lr_schedule_lengths_in_samples(extra, steps, iters):
    """Megatron-LM's get_optimizer_param_scheduler: lengths in samples; --lr-warmup-fraction x the decay;
    train_iters from --train-samples as its update_train_iters (52 // 8 = 6; the ramp: 4 + (64 - 20) // 8)."""
    from megatron_zb.training.run_config import run_config

    validated = _validate(extra)
    config = run_config(validated.args)
    got = config.scheduler_steps()
    assert (got.lr_warmup_steps, got.lr_decay_steps, got.wd_incr_steps, got.wsd_decay_steps) == steps
    assert config.train_iters == iters == validated.args.train_iters
    before = dict(vars(validated.args))
    from megatron_zb.training.arguments import validate_args

    validate_args(validated.args, world_size=2)  # idempotent
    assert vars(validated.args) == before


@NEEDS_RAMP
def test_training_split_holds_what_the_iterations_read():
    """--train-samples inside the ramp: Megatron-LM's count gives 3 iterations of 4, 4 and 6 samples
    (14 > 10: the last batch starts at 8 <= 10); the training split is sized for all of them."""
    from megatron_zb.training.data import train_valid_test_num_samples
    from megatron_zb.training.run_config import run_config

    args = _validate("--global-batch-size 8 --train-samples 10 --rampup-batch-size 4 2 16 --eval-iters 0").args
    assert args.train_iters == 3
    assert train_valid_test_num_samples(run_config(args))[0] == 14


def test_training_split_of_a_constant_batch_is_train_samples():
    """Without a ramp the training split is --train-samples, as Megatron-LM's."""
    from megatron_zb.training.data import train_valid_test_num_samples
    from megatron_zb.training.run_config import run_config

    plain = _validate("--global-batch-size 8 --train-samples 60 --eval-iters 0").args
    assert (plain.train_iters, train_valid_test_num_samples(run_config(plain))[0]) == (7, 60)  # Megatron-LM: --train-samples


def test_rampup_batch_size_is_refused_naming_the_release():
    """megatron-core 0.19 has no batch-size ramp-up calculator (its step schedule replaced it):
    --rampup-batch-size is refused up front, naming the installed version and what to do instead."""
    from megatron_zb.megatron_compat import megatron_core_version
    from megatron_zb.training.arguments import ArgumentError

    if rampup_calculator() is not None:
        pytest.skip(f"megatron-core {megatron_core_version()} has the ramp-up calculator (the tests above use it)")
    with pytest.raises(ArgumentError) as e:
        _validate("--global-batch-size 8 --train-samples 64 --rampup-batch-size 4 2 16")
    assert e.value.flag == "--rampup-batch-size", str(e.value)
    assert f"megatron-core {megatron_core_version()} has no batch-size ramp-up calculator" in str(e.value)
    assert "use a constant --global-batch-size" in str(e.value)

"""End to end: ``pretrain_gpt_zb.py``'s trainer in-process (and the script under torchrun), tiny GPT, mock data.

Every run writes its exact per-iteration values with ``--loss-log-json``; the loss curves of
megatron-zb's schedules are compared with megatron-core's own 1F1B (``--use-megatron-core-schedule``)
on the same flags. The model (8 layers) and the data are the same at PP=2 and PP=4, so one
reference serves both. Runs are shared between tests (each starts once, on first use). Every run is the
trainer on the command line in-process (:func:`in_process`: ranks of ``run_distributed``, whose forkserver
has torch, megatron-core and the trainer already imported), a few seconds each; the script itself under
torchrun is :func:`test_bad_argument_under_torchrun_prints_one_line_and_starts_no_group`'s, and
tests/training/test_nan_check.py's, test_checkpoint_failures.py's and test_profile_out.py's:

PP=2, 12 iterations, validation every 6 (1 batch), checkpoints:
  ``ref2``          megatron-core 1F1B, saves at 6 and 12 -- the reference;
  ``1f1b2``         megatron-zb's runtime running 1F1B;
  ``zbh1_pv``       ZB-H1 with exact optimizer post-validation (eager steps after its 10 warm-up steps);
  ``zb_stop``       greedy zero-bubble (profiled at 2-3, re-planned), stopped by ``--exit-interval 6``;
  ``zb_resume``     greedy zero-bubble resuming ``zb_stop``'s checkpoint;
  ``zb_to_mcore``   megatron-core 1F1B resuming ``zb_stop``'s checkpoint;
  ``mcore_to_zbv``  ZB-V resuming megatron-core's iteration-6 checkpoint (plain -> V placement), saving at 9;
  ``zbv_to_zb``     greedy zero-bubble resuming ``mcore_to_zbv``'s iteration-9 checkpoint (V -> plain, tied).
PP=4, same flags, stopped at 5 by ``--exit-interval``: ``zb4`` (greedy), ``vhalf4`` (V-Half).

The post-validation flags test runs the trainer in-process on 2 ranks of ``run_distributed``
(2 layers, 5 iterations; a few seconds each).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harness.pretrain_harness import (DROPOUT, SCRIPT, SMALL, assert_curve, in_process, losses, torchrun,
                                                 train)
from harness.trainer_run import in_process_many

# megatron-core's import-time notices (the bad-input tests import it into this process).
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]

REPO = Path(__file__).resolve().parents[2]

MODEL = ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--hidden-dropout", "0", "--attention-dropout", "0"]
COMMON = MODEL + [
    "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "12",
    "--lr", "2e-3", "--min-lr", "2e-4", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine",
    "--clip-grad", "5.0", "--mock-data", "--num-workers", "0", "--log-interval", "1",
    "--eval-interval", "6", "--eval-iters", "1",
    "--distributed-backend", "gloo", "--pipeline-timeout-seconds", "60", "--distributed-timeout-minutes", "2"]
PP2 = COMMON + ["--pipeline-model-parallel-size", "2"]
PP4 = COMMON + ["--pipeline-model-parallel-size", "4", "--exit-interval", "5"]


class Runs:
    """Start each named run once; keep its JSON values and its log."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[str, dict[str, Any]] = {}

    def dir(self, name: str) -> Path:
        d = self.root / name
        d.mkdir(exist_ok=True)
        return d

    def get(self, name: str, nproc: int, argv: list[str], *, launch_torchrun: bool = False) -> dict[str, Any]:
        """Run ``argv`` on ``nproc`` ranks once: in-process (:func:`in_process`) or, with
        ``launch_torchrun``, ``pretrain_gpt_zb.py`` under torchrun."""
        if name not in self.done:
            if launch_torchrun:
                run = torchrun(nproc, argv + ["--loss-log-json", str(self.dir(name) / "values.json")],
                               cwd=self.dir(name))
                run["values"] = json.loads((self.dir(name) / "values.json").read_text())
            else:
                run = in_process(self.root, name, nproc, argv)
            self.done[name] = run
        return self.done[name]




@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("pretrain"))


# ---------------------------------------------------------------------------- run definitions
def ref2(runs: Runs) -> dict:
    return runs.get("ref2", 2, PP2 + ["--use-megatron-core-schedule", "--save", str(runs.dir("ref2") / "ckpt"),
                                      "--save-interval", "6"])


def zb_stop(runs: Runs) -> dict:
    return runs.get("zb_stop", 2, PP2 + ["--enable-zero-bubble", "--save", str(runs.dir("zb_stop") / "ckpt"),
                                         "--exit-interval", "6"])


def zb_resume(runs: Runs) -> dict:
    zb_stop(runs)
    ckpt = runs.dir("zb_stop") / "ckpt"
    return runs.get("zb_resume", 2, PP2 + ["--enable-zero-bubble", "--load", str(ckpt)])


def zb_to_mcore(runs: Runs) -> dict:
    zb_stop(runs)
    return runs.get("zb_to_mcore", 2, PP2 + ["--use-megatron-core-schedule", "--load",
                                             str(runs.dir("zb_stop") / "ckpt")])


def mcore_to_zbv(runs: Runs) -> dict:
    ref2(runs)
    # megatron-core's run saved iterations 6 and 12: point a copy's tracker at iteration 6.
    src, dst = runs.dir("ref2") / "ckpt", runs.dir("mcore_to_zbv") / "ckpt6"
    if not dst.exists():
        shutil.copytree(src / "iter_0000006", dst / "iter_0000006")
        (dst / "latest_checkpointed_iteration.txt").write_text("6")
    # It saves at 9 and 12 itself: a V-placement checkpoint of the tied embedding (zbv_to_zb loads it).
    return runs.get("mcore_to_zbv", 2, PP2 + ["--zero-bubble-v-schedule", "--load", str(dst),
                                              "--save", str(runs.dir("mcore_to_zbv") / "ckpt"), "--save-interval", "3"])


def zbv_to_zb(runs: Runs) -> dict:
    mcore_to_zbv(runs)
    ckpt = _at(runs.dir("mcore_to_zbv") / "ckpt", 9, runs.dir("zbv_to_zb") / "ckpt9")
    return runs.get("zbv_to_zb", 2, PP2 + ["--enable-zero-bubble", "--load", str(ckpt)])


def pp2(runs: Runs, name: str, *flags: str) -> dict:
    return runs.get(name, 2, PP2 + list(flags))




# ---------------------------------------------------------------------------- loss curves
def test_pp2_megatron_zb_1f1b_equals_megatron_core_1f1b(runs):
    ref, got = ref2(runs), pp2(runs, "1f1b2")
    assert sorted(losses(got)) == list(range(1, 13))
    assert_curve(losses(got), losses(ref), what="megatron-zb 1F1B", exact=True)
    for a, b in zip(train(got), train(ref)):
        assert (a["learning rate"], a["grad norm"]) == (b["learning rate"], b["grad norm"])
    refv = [v["lm loss"] for v in ref["values"]["valid"]]
    assert len(refv) == 4  # iterations 6 and 12, then the final validation and test sets
    assert [v["lm loss"] for v in got["values"]["valid"]] == refv
    # A schedule that is not cost-aware is profiled and reported, but kept.
    assert "schedule '1f1b' is not cost-aware: kept as is" in got["log"]
    assert re.search(r"measured costs \(ms\): T_F=[\d.]+, T_comm=[\d.]+, T_BW=[\d.]+", got["log"])


def test_pp2_zb_h1_with_optimizer_post_validation_equals_megatron_core_1f1b(runs):
    """Exact post-validation: eager steps after its 10 warm-up iterations, the same curve bit for bit."""
    got = pp2(runs, "zbh1_pv", "--schedule", "zb-h1", "--enable-optimizer-post-validation",
              "--enable-exactly-numeric-match", "--log-interval", "3")
    ref = ref2(runs)
    assert sorted(losses(got)) == list(range(1, 13))
    assert_curve(losses(got), losses(ref), what="zb-h1 + post-validation", exact=True)
    for a, b in zip(train(got), train(ref)):
        assert (a["learning rate"], a["grad norm"], a["skipped"]) == (b["learning rate"], b["grad norm"], False)
    assert [v["lm loss"] for v in got["values"]["valid"]] == [v["lm loss"] for v in ref["values"]["valid"]]
    lines = [ln for ln in got["log"].splitlines() if re.search(r"\] iteration\s+\d+/", ln)]
    assert len(lines) == 4 and all("number of rollbacks:   0 |" in ln for ln in lines)
    assert "> optimizer post-validation (rank 0): 2 eager steps, 10 synchronous steps, 0 rollbacks" in got["log"]


def test_pp2_greedy_zero_bubble_stop_resume_equals_uninterrupted(runs):
    """--exit-interval 6 then --load: iterations 7-12 are bit for bit those of an uninterrupted run."""
    ref, first, second = ref2(runs), zb_stop(runs), zb_resume(runs)
    assert sorted(losses(first)) == list(range(1, 7)) and sorted(losses(second)) == list(range(7, 13))
    assert_curve(losses(first), losses(ref), what="zb before the stop", exact=True)
    assert_curve(losses(second), losses(ref), what="zb after resuming", exact=True)
    for a, b in zip(train(first) + train(second), train(ref)):
        assert (a["learning rate"], a["grad norm"]) == (b["learning rate"], b["grad norm"])
    # Validation continues where it stopped (consumed validation samples are checkpointed).
    refv = [v["lm loss"] for v in ref["values"]["valid"]]
    assert [v["lm loss"] for v in first["values"]["valid"] + second["values"]["valid"]] == refv
    log = second["log"]
    assert "successfully loaded checkpoint" in log and "at iteration 6" in log
    assert "exiting program at iteration 6" in first["log"]
    # The stopped run profiled and re-planned; the resumed one rebuilt that schedule from the checkpoint.
    assert "schedule report after profiling iterations 2-3" in first["log"]
    assert "re-planned 'zb' from the measured costs" in first["log"]
    assert "rebuilt from the profiled costs stored in the checkpoint" in log
    assert "measured costs (ms): T_F=" in log


def test_zero_bubble_checkpoint_loads_in_megatron_core_1f1b(runs):
    got = zb_to_mcore(runs)
    assert sorted(losses(got)) == list(range(7, 13))
    assert_curve(losses(got), losses(ref2(runs)), what="megatron-core 1F1B from a zb checkpoint", exact=True)


def test_megatron_core_checkpoint_loads_in_zero_bubble_v(runs):
    """Global layer numbering: a plain-placement checkpoint maps onto the V placement (stages 0,3 | 1,2)."""
    got = mcore_to_zbv(runs)
    assert sorted(losses(got)) == list(range(7, 13))
    assert_curve(losses(got), losses(ref2(runs)), what="ZB-V from megatron-core's checkpoint", exact=False)
    assert "stages [0, 3]" in got["log"]
    assert "random states are not restored" not in got["log"]


def test_zero_bubble_v_tied_checkpoint_loads_in_plain_placement(runs):
    """The reverse direction: ZB-V's iteration-9 checkpoint (one tied embedding parameter on rank 0
    serving stages 0 and 3) resumes in the plain placement (embedding on rank 0, its output-layer
    copy on rank 1). Iterations 10-12 equal the uninterrupted megatron-core run's within 1e-6
    relative: V sums the tied embedding's gradient per microbatch in another order (fp32)."""
    got, ref = zbv_to_zb(runs), ref2(runs)
    assert sorted(losses(got)) == [10, 11, 12]
    assert "successfully loaded checkpoint" in got["log"] and "at iteration 9" in got["log"]
    assert "random states are not restored" not in got["log"]
    for a, b in zip(train(got), train(ref)[9:]):
        assert a["iteration"] == b["iteration"]
        for key in ("lm loss", "grad norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=0), (a["iteration"], key, a[key], b[key])


# ---------------------------------------------------------------------------- PP=4
@pytest.mark.parametrize("name,flags,exact", [
    ("zb4", ("--enable-zero-bubble",), True),
    ("vhalf4", ("--zero-bubble-v-schedule", "--zero-bubble-v-schedule-mem-setup", "half"), False),
], ids=["zb", "v-half"])
def test_pp4_profiles_replans_and_matches_megatron_core(runs, name, flags, exact):
    """Same model and data as PP=2: the PP=4 curve equals megatron-core's PP=2 1F1B curve."""
    ref = ref2(runs)
    run = runs.get(name, 4, PP4 + list(flags))
    assert sorted(losses(run)) == list(range(1, 6))
    assert_curve(losses(run), losses(ref), what=f"PP=4 {name}", exact=exact)
    log = run["log"]
    schedule = "zb" if name == "zb4" else "v-half"
    report = log[log.index("> schedule report after profiling iterations 2-3"):]
    assert f"schedule: {schedule}" in report
    assert re.search(r"measured costs \(ms\): T_F=[\d.]+, T_B=[\d.]+, T_W=[\d.]+, T_comm=[\d.]+", report)
    idle = re.search(r"measured idle fraction per rank: \[([^\]]*)\]", report).group(1).split(", ")
    assert len(idle) == 4 and all(0.0 <= float(x.rstrip("%")) <= 100.0 for x in idle)
    assert re.search(r"predicted bubble rate: [\d.]+%", report)
    assert f"re-planned {schedule!r} from the measured costs" in report, report[:2000]
    if name == "vhalf4":
        assert "stages [0, 7]" in log  # pipeline rank 0 holds both ends of the V


# ---------------------------------------------------------------------------- post-validation flags
# 2 layers, 5 iterations, profiling window after the last iteration (no profiling).
PV_TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
           "--hidden-dropout", "0", "--attention-dropout", "0", "--micro-batch-size", "2", "--global-batch-size", "4",
           "--train-iters", "5", "--lr", "1e-3", "--mock-data", "--num-workers", "0", "--eval-iters", "0",
           "--distributed-backend", "gloo", "--pipeline-model-parallel-size", "2", "--schedule", "zb-h1",
           "--zero-bubble-pipeline-timers-start-iter", "6", "--zero-bubble-pipeline-timers-end-iter", "7",
           "--enable-optimizer-post-validation", "--enable-exactly-numeric-match"]


def _post_validated_iterations(argv: list[str]) -> dict:
    """One rank of ``pretrain_gpt_zb.py`` (run_distributed already joined the ranks): which
    iterations took the post-validated (eager) path, and the optimizer's counters."""
    import torch.distributed as dist

    from megatron_zb.optimizer import PostValidationOptimizer
    from megatron_zb.training.pretrain import parse_and_validate
    from megatron_zb.training.trainer import Trainer

    eager: list[bool] = []
    real_step = PostValidationOptimizer.step

    def step(self):  # this rank's process only
        before = self.counters().eager_steps
        result = real_step(self)
        eager.append(self.counters().eager_steps > before)
        return result

    PostValidationOptimizer.step = step
    trainer = Trainer(parse_and_validate(argv, dist.get_world_size()))
    try:
        assert trainer.run() == 0
        cfg, counters = trainer.optimizer.pv_config, trainer.optimizer.counters()
    finally:
        trainer.close()
    return {"eager": eager, "warmup": cfg.warmup_iters, "clean": cfg.clean_iters_required, "counters": counters}


@pytest.mark.parametrize("flags, clip, eager", [
    (["--post-validation-warmup-iters", "3"], "0", [False, False, False, True, True]),
    (["--post-validation-warmup-iters", "0", "--post-validation-fallback-clean-iters", "2"], "1e-6",
     [True, False, False, False, False]),
    (["--post-validation-warmup-iters", "0", "--post-validation-fallback-clean-iters", "0"], "1e-6", [True] * 5),
], ids=["warmup3-noclip", "warmup0-fallback2-clip-always", "warmup0-fallback0-clip-always"])
def test_post_validation_flags_reach_the_optimizer(flags, clip, eager):
    """The two flags set the optimizer's warm-up and fallback: without clipping the first
    --post-validation-warmup-iters steps are synchronous; with clipping on every step, the first
    (eager) step's clip makes every later step synchronous unless --post-validation-fallback-clean-iters is 0."""
    from megatron_zb.testing import run_distributed

    out = run_distributed(_post_validated_iterations, world_size=2, args=(PV_TINY + ["--clip-grad", clip] + flags,),
                          timeout=180)
    warmup = int(flags[flags.index("--post-validation-warmup-iters") + 1])
    clean = int(flags[flags.index("--post-validation-fallback-clean-iters") + 1]) if len(flags) > 2 else 10
    for rank in out:
        assert (rank["warmup"], rank["clean"]) == (warmup, clean)
        assert rank["eager"] == eager
        c = rank["counters"]
        assert (c.eager_steps, c.sync_steps) == (sum(eager), len(eager) - sum(eager)), c
        assert c.clipped_iterations == (0 if clip == "0" else 5), c


# ---------------------------------------------------------------------------- log format
def test_log_lines_are_megatrons_and_parse(runs):
    from megatron_zb.training.logging_utils import parse_iteration_line

    run = ref2(runs)
    exact = losses(run)
    lines = [ln for ln in run["log"].splitlines() if re.search(r"\] iteration\s+\d+/", ln)]
    assert len(lines) == 12
    for ln in lines:
        rec = parse_iteration_line(ln)
        it = rec["iteration"]
        assert rec["train_iters"] == 12 and rec["consumed samples"] == 8 * it and rec["global batch size"] == 8
        assert rec["lm loss"] == pytest.approx(exact[it], rel=1e-6)
        assert rec["elapsed time per iteration (ms)"] > 0 and rec["throughput (samples/s)"] > 0
        assert rec["loss scale"] == 1.0 and rec["number of skipped iterations"] == 0
        assert {"learning rate", "grad norm", "number of nan iterations"} <= rec.keys()
    valid = re.findall(r"^ validation loss at iteration (\d+) \| lm loss value: (\S+) \| lm loss PPL: (\S+) \| $",
                       run["log"], flags=re.M)
    assert [int(v[0]) for v in valid] == [6, 12]
    assert float(valid[0][2]) == pytest.approx(2.718281828 ** float(valid[0][1]), rel=1e-5)
    assert " validation loss at iteration 12 on validation set |" in run["log"]
    assert " validation loss at iteration 12 on test set |" in run["log"]
    # Progress before the first iteration, in order (the script's own first line, before the trainer's:
    # test_nan_check.py's run under torchrun).
    marks = ["> building model", "> model built:", "> data ready", "> schedule report", "] iteration        1/"]
    pos = [run["log"].index(m) for m in marks]
    assert pos == sorted(pos)
    assert "successfully saved checkpoint from iteration       6" in run["log"]


# ---------------------------------------------------------------------------- bad input
def _main_in_process(argv: list[str], world_size: int, monkeypatch, capsys) -> tuple[int, str]:
    import torch.distributed as dist

    from megatron_zb.training.pretrain import main

    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    rc = main(argv)
    assert not dist.is_initialized(), "a process group was started before the arguments were checked"
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("argv,world,flag", [
    (PP2 + ["--num-layers", "5"], 2, "--num-layers"),  # 5 layers over 2 stages
    (PP2 + ["--use-megatron-core-schedule", "--enable-zero-bubble"], 2, "--use-megatron-core-schedule"),
    (PP2, 3, "--tensor-model-parallel-size"),  # 3 processes cannot hold PP=2
], ids=["layers-not-divisible", "megatron-core-with-zb", "world-size"])
def test_bad_arguments_exit_2_naming_the_flag(argv, world, flag, monkeypatch, capsys):
    rc, err = _main_in_process(argv, world, monkeypatch, capsys)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pretrain_gpt_zb.py: error: {flag}:"), err


def test_bad_argument_under_torchrun_prints_one_line_and_starts_no_group(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT),
           *PP2, "--schedule", "zb-h1", "--zero-bubble-max-pending-backward", "2"]  # zb-h1 is not memory-aware
    proc = subprocess.run(cmd, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("pretrain_gpt_zb.py: error:")]
    assert len(errors) == 1 and "--zero-bubble-max-pending-backward" in errors[0], proc.stderr[-3000:]
    assert "initializing torch distributed" not in proc.stdout


# ---------------------------------------------------------------------------- data
def test_mock_loss_mask_does_not_depend_on_the_first_sample_read():
    """megatron-core 0.16.1's GPTDataset mask cache kept the first sample's padding zeros
    (megatron_zb.training.data works around it); a resumed run reads a different first sample."""
    from megatron_zb.training.data import build_datasets
    from megatron_zb.training.pretrain import parse_and_validate
    from megatron_zb.training.run_config import run_config

    args = parse_and_validate(PP2[:-2] + ["--pipeline-model-parallel-size", "1"], 1)
    _, a, _ = build_datasets(run_config(args), pipeline_rank=0)
    _, b, _ = build_datasets(run_config(args), pipeline_rank=0)
    masks_a = [a[i]["loss_mask"] for i in range(16)]
    masks_b = [b[i]["loss_mask"] for i in range(15, -1, -1)][::-1]  # read in the opposite order
    assert any(m.sum() < len(m) for m in masks_a), "no padded label in these samples: the test proves nothing"
    for i, (x, y) in enumerate(zip(masks_a, masks_b)):
        assert (x == y).all(), f"sample {i}: loss mask depends on the read order"


# ---------------------------------------------------------------------------- in-process runs
# (harness.pretrain_harness: SMALL and in_process)


def test_replanned_schedule_is_the_greedy_schedule_of_the_logged_costs(tmp_path):
    """After profiling iterations 2-3 the installed schedule is exactly ``build_schedule("zb")`` of
    the costs the run reports (and checkpoints): the per-stage times in the log plus the logged
    runtime time per compute action are those costs.
    The memory limit is part of those costs (measured bytes: M_B per stage and the limit derived
    from it), not the unit-memory limit of the flags."""
    from megatron_zb.schedules import CostModel
    from megatron_zb.schedules.registry import build_schedule

    run = in_process(tmp_path, "replan", 2, SMALL + ["--pipeline-model-parallel-size", "2", "--train-iters", "4",
                                                      "--enable-zero-bubble"])
    assert run["costs"] is not None, run["log"][-2000:]
    costs = CostModel(**run["costs"])
    assert costs.memory_limit is not None and costs.memory_limit > run["memory_limit"]  # bytes, not M_B units
    want = build_schedule("zb", num_ranks=2, num_microbatches=run["m"], costs=costs,
                          memory_limit=costs.memory_limit)
    got = run["installed"]
    assert got.stage_to_rank == want.stage_to_rank and got.ranks == want.ranks
    line = re.search(r"measured per stage \(ms\): T_F=\[([^\]]*)\]; T_B=\[([^\]]*)\]; T_W=\[([^\]]*)\]", run["log"])
    assert line, run["log"][-3000:]
    # each action also lasts the measured runtime time per compute action (logged separately)
    over = re.search(r"runtime time per compute action \(ms, [^)]*\): ([0-9.]+)", run["log"])
    assert over, run["log"][-3000:]
    for logged, exact in zip(line.groups(), (costs.t_f, costs.t_b, costs.t_w)):
        assert [float(v) + float(over.group(1)) for v in logged.split(", ")] == pytest.approx(exact, abs=1.5e-3)


def _curve(run: dict) -> list[tuple[int, float, float, bool]]:
    return [(r["iteration"], r["lm loss"], r["loss scale"], r["skipped"]) for r in run["values"]["train"]]


@pytest.mark.parametrize("precision,extra", [
    ("bf16", []),
    ("fp16", ["--initial-loss-scale", str(2.0 ** 19)]),  # overflows at first: skipped iterations, scale halved
], ids=["bf16", "fp16-overflow"])
def test_mixed_precision_curves_equal_megatron_core(tmp_path, precision, extra):
    """bf16 and fp16 through the trainer: zb gives megatron-core 1F1B's loss curve, loss scale and
    skipped iterations bit for bit, zbv the same loss scales and skipped iterations and the loss
    within 1e-5 relative (tied embeddings, see below; clipping off: see docs/compatibility.md)."""
    argv = SMALL + [f"--{precision}", "--pipeline-model-parallel-size", "2", "--train-iters", "8",
                    "--clip-grad", "0", *extra]
    flags = {"mcore": ["--use-megatron-core-schedule"], "zb": ["--enable-zero-bubble"], "zbv": ["--zero-bubble-v-schedule"]}
    curves = {name: _curve(run) for name, run in
              in_process_many(tmp_path, {name: argv + f for name, f in flags.items()}, 2).items()}  # one launch
    ref = curves["mcore"]
    assert [it for it, *_ in ref] == list(range(1, 9))
    if precision == "fp16":
        skipped = [i for i, (_, _, _, s) in enumerate(ref) if s]
        assert skipped and not ref[-1][3], ref  # some iterations overflowed, training then went on
        scales = [scale for _, _, scale, _ in ref]
        assert any(b == a / 2 for a, b in zip(scales, scales[1:])), scales  # the loss scale was halved
    for name in ("zb", "zbv"):
        got = curves[name]
        if name == "zb":
            assert got == ref, f"{precision} {name}: {got} != {ref}"
            continue
        # V: the tied embedding is one parameter on rank 0 that gets the embedding's and the output
        # layer's gradient per microbatch in the schedule's order, where megatron-core sums each
        # copy first and then all-reduces; with fp16 gradients that reordering moves the loss in
        # the 6th-7th digit. Loss scale and skipped iterations must match exactly.
        assert [(i, sc, sk) for i, _, sc, sk in got] == [(i, sc, sk) for i, _, sc, sk in ref], (name, got, ref)
        for (i, loss, *_), (_, want, *_) in zip(got, ref):
            assert loss == pytest.approx(want, rel=1e-5), f"{precision} {name} iteration {i}: {loss} vs {want}"


# ---------------------------------------------------------------------------- checkpoints, in process
def _values(run: dict) -> list[tuple]:
    return [(r["iteration"], r["lm loss"], r["learning rate"], r["grad norm"], r["loss scale"], r["skipped"])
            for r in run["values"]["train"]]


def _at(root: Path, iteration: int, dst: Path) -> Path:
    """A copy of ``root``'s checkpoint of ``iteration`` whose tracker names it."""
    if not dst.exists():
        shutil.copytree(root / f"iter_{iteration:07d}", dst / f"iter_{iteration:07d}")
        (dst / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return dst


def test_resume_identity_dp2_post_validation(tmp_path):
    """PP=2 x DP=2, exact post-validation (eager after 2 warm-up steps), greedy zero bubble: stop at
    4 and resume == the uninterrupted run, value for value. The same with the distributed optimizer
    (and the Adam state itself) is tests/training/test_resume_distopt.py."""
    argv = SMALL + ["--pipeline-model-parallel-size", "2", "--train-iters", "8", "--enable-zero-bubble",
                    "--enable-optimizer-post-validation", "--enable-exactly-numeric-match",
                    "--post-validation-warmup-iters", "2"]
    whole = in_process(tmp_path, "whole", 4, argv)
    ckpt = tmp_path / "ckpt"
    first = in_process(tmp_path, "first", 4, argv + ["--save", str(ckpt), "--save-interval", "4",
                                                      "--exit-interval", "4"])
    second = in_process(tmp_path, "second", 4, argv + ["--load", str(ckpt)])
    assert [v[0] for v in _values(first)] == [1, 2, 3, 4] and [v[0] for v in _values(second)] == [5, 6, 7, 8]
    assert _values(first) + _values(second) == _values(whole)
    assert "eager steps" in whole["log"] and "rebuilt from the profiled costs stored in the checkpoint" in second["log"]


@pytest.fixture(scope="module")
def pp2_saved(tmp_path_factory) -> tuple[dict, Path]:
    """A PP=2 megatron-core 1F1B run of 8 layers, 8 iterations, saving at 4 and 8 (clipping off)."""
    tmp = tmp_path_factory.mktemp("pp2saved")
    argv = SMALL + ["--num-layers", "8", "--pipeline-model-parallel-size", "2", "--train-iters", "8",
                    "--clip-grad", "0", "--use-megatron-core-schedule", "--save", str(tmp / "ckpt"),
                    "--save-interval", "4"]
    return in_process(tmp, "ref", 2, argv), _at(tmp / "ckpt", 4, tmp / "ckpt4")


@pytest.mark.parametrize("flags,stages", [(["--enable-zero-bubble"], "[0]"),
                                          (["--zero-bubble-v-schedule"], "[0, 7]")], ids=["pp4-zb", "pp4-zbv"])
def test_pp2_checkpoint_loads_at_pp4_plain_and_v(tmp_path, pp2_saved, flags, stages):
    """A PP=2 checkpoint resumes at PP=4 (plain placement, and the V: 8 stages, rank 0 holds 0 and 7):
    iterations 5-8 equal the PP=2 run's; the layout changed, so the random states start afresh."""
    ref, ckpt = pp2_saved
    argv = SMALL + ["--num-layers", "8", "--pipeline-model-parallel-size", "4", "--train-iters", "8",
                    "--clip-grad", "0", "--load", str(ckpt), *flags]
    got = in_process(tmp_path, "pp4", 4, argv)
    want = _values(ref)[4:]
    # Everything bitwise but the reported grad norm: PP=4 sums the squares per pipeline rank in
    # another grouping than PP=2 (last-bit differences; clipping is off, so nothing uses it).
    assert [v[:3] + v[4:] for v in _values(got)] == [v[:3] + v[4:] for v in want]
    for a, b in zip(_values(got), want):
        assert a[3] == pytest.approx(b[3], rel=1e-6)
    assert "random states are not restored (dropout streams start afresh)" in got["log"]
    assert f"stages {stages}" in got["log"]


def test_fp16_checkpoint_before_any_successful_step_resumes(tmp_path):
    """fp16 whose first iterations all overflow (no Adam state yet) saves at 2 and resumes: the
    curve equals the uninterrupted run's (megatron-core would ask for exp_avg the save lacked)."""
    argv = SMALL + ["--fp16", "--initial-loss-scale", str(2.0 ** 22), "--pipeline-model-parallel-size", "2",
                    "--train-iters", "6", "--clip-grad", "0", "--enable-zero-bubble"]
    whole = in_process(tmp_path, "whole", 2, argv)
    assert [v[5] for v in _values(whole)][:2] == [True, True] and not _values(whole)[-1][5], _values(whole)
    ckpt = tmp_path / "ckpt"
    first = in_process(tmp_path, "first", 2, argv + ["--save", str(ckpt), "--save-interval", "2",
                                                      "--exit-interval", "2"])
    second = in_process(tmp_path, "second", 2, argv + ["--load", str(ckpt)])
    assert _values(first) + _values(second) == _values(whole)


# ---------------------------------------------------------------------------- exact resume with dropout




@pytest.mark.parametrize("world, flags", [
    (2, ["--pipeline-model-parallel-size", "2", "--enable-zero-bubble"]),
    (2, ["--pipeline-model-parallel-size", "2", "--zero-bubble-v-schedule"]),
    (4, ["--pipeline-model-parallel-size", "2", "--enable-zero-bubble", "--use-distributed-optimizer", "--bf16",
         "--enable-optimizer-post-validation"]),
], ids=["zb", "zbv", "zb-dp2-distopt-bf16-postval"])
def test_resume_with_dropout_is_bitwise_the_uninterrupted_run(tmp_path, world, flags):
    """Issue 23: every random state a run draws from is restored, so iterations 5-8 resumed from the
    checkpoint of iteration 4 are bit for bit those of the uninterrupted run, with dropout on. (The
    data iterators are built after loading; they draw their workers' seed from a generator of their
    own, not from the default CPU generator that dropout draws from -- before that, iteration 5's
    loss differed in the fourth digit.)"""
    full = in_process(tmp_path, "full", world, DROPOUT + flags + ["--save", str(tmp_path / "ckpt")])
    # a copy of the run's folder holding only the checkpoint of iteration 4, as if it had stopped there
    shutil.copytree(tmp_path / "ckpt" / "iter_0000004", tmp_path / "ckpt4" / "iter_0000004")
    (tmp_path / "ckpt4" / "latest_checkpointed_iteration.txt").write_text("4")
    resumed = in_process(tmp_path, "resumed", world, DROPOUT + flags + ["--load", str(tmp_path / "ckpt4")])
    assert "at iteration 4" in resumed["log"] and "random states are not restored" not in resumed["log"]
    assert sorted(losses(full)) == list(range(1, 9)) and sorted(losses(resumed)) == list(range(5, 9))
    assert_curve(losses(resumed), losses(full), what="resumed with dropout", exact=True)
    for a, b in zip(train(resumed), train(full)[4:]):
        assert (a["learning rate"], a["grad norm"]) == (b["learning rate"], b["grad norm"])

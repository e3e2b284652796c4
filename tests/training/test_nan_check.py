"""``--check-for-nan-in-loss-and-grad`` (issue 44, NaN/Inf): Megatron-LM's check of every micro batch's
loss and every gradient bucket's norm, on by default; a NaN/Inf stops every rank together with one error
line naming the iteration and the rank; ``--no-check-for-nan-in-loss-and-grad`` trains on.

End to end, ``pretrain_gpt_zb.py`` at PP=2 (greedy zero-bubble, the harness's tiny model): ``--lr 1e4``
diverges deterministically (mock data, fixed seed) -- in fp32 the loss of iteration 4 is NaN (and the
gradients), in bf16 the gradients of iteration 2 (its loss is still finite, 3e9). The script itself runs
once under torchrun (its exit status); the other runs call its ``main`` on 2 ranks of ``run_distributed``
(every rank's status; a rank left hanging fails the run's timeout). A NaN planted in the weight gradient a
deferred W computes (stage 0, iteration 3) is caught at that iteration, with and without
``--overlap-grad-reduce`` (bucket reduces launched from the W) and with post-validation's eager step
(rank 1 steps, rank 0 skips; rank 1 rolls back).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harness.pretrain_harness import RUN_TIMEOUT, SCRIPT, SMALL, without

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]

ARGV = without(SMALL, "--lr") + ["--pipeline-model-parallel-size", "2", "--enable-zero-bubble", "--train-iters", "6"]
"""2 ranks: stage 0 on rank 0, stage 1 (the loss) on rank 1."""
DIVERGE = ["--lr", "1e4"]
EAGER = ["--enable-optimizer-post-validation", "--post-validation-warmup-iters", "0",
         "--post-validation-fallback-clean-iters", "0"]
"""Post-validation stepping eagerly from the first iteration on (the path whose steps are rolled back)."""
RUN_S = 120.0
"""Seconds per in-process run (about 8 s on the shared 2-core machine): a hanging rank fails the test."""
ERROR = re.compile(r"pretrain_gpt_zb\.py: error: Rank (?P<rank>\d+), node \S+, device \S+, iteration (?P<it>\d+): "
                   r"Unexpected result (?P<value>\S+) \(message='(?P<what>[^']+)'\); every rank stops at iteration "
                   r"(?P=it), whose update is not applied \(--check-for-nan-in-loss-and-grad")
LOSS_NAN = "found NaN in local forward loss calculation"
GRAD_NAN = re.compile(r"found NaN in local grad norm for bucket #\d+ in backward pass before data-parallel "
                      r"communication collective")


def _main_rank(argv: list[str], out_dir: str, plant: tuple[int, int] | None) -> int:
    """One rank of ``pretrain_gpt_zb.py``'s ``main`` (its stdout and stderr to ``out_dir/rank<R>.log``);
    ``plant``: ``(global rank, iteration)`` whose deferred W's write NaN into the gradients they compute."""
    import warnings

    import torch.distributed as dist

    from megatron_zb.training.pretrain import main

    warnings.simplefilter("ignore")
    rank = dist.get_rank()
    os.environ.update(WORLD_SIZE=str(dist.get_world_size()), RANK=str(rank), LOCAL_RANK=str(rank))
    log = open(Path(out_dir, f"rank{rank}.log"), "w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    if plant is not None and plant[0] == rank:
        _plant_nan_in_w(plant[1])
    try:
        return main(argv)
    finally:
        log.flush()


def _plant_nan_in_w(iteration: int) -> None:
    """Every weight-gradient entry queued for a W in ``iteration`` writes NaN into the first element of the
    gradient it has just accumulated (``main_grad``): a NaN computed in a deferred W."""
    from megatron_zb.megatron_compat import rerun_current_iteration
    from megatron_zb.runtime.wgrad_store import WeightGradStore
    from megatron_zb.training.nan_check import rerun_state_machine

    put = WeightGradStore.put

    def planting_put(self: Any, fn: Any, *, params: tuple[Any, ...]) -> None:
        def w() -> None:
            fn()
            if rerun_state_machine().current_iteration == rerun_current_iteration(iteration):  # 0.19: 0-based
                for p in params:
                    p.main_grad.view(-1)[0] = float("nan")

        if hasattr(fn, "prefetch"):
            w.prefetch = fn.prefetch  # type: ignore[attr-defined]
        put(self, w, params=params)

    WeightGradStore.put = planting_put  # type: ignore[method-assign]


def _run(tmp_path: Path, argv: list[str], *, plant: tuple[int, int] | None = None) -> dict[str, Any]:
    """``main`` on 2 ranks with ``argv`` (+ ``--loss-log-json``): statuses, every rank's log, the values."""
    from megatron_zb.testing import run_distributed

    values = tmp_path / "values.json"
    statuses = run_distributed(_main_rank, world_size=2, args=(argv + ["--loss-log-json", str(values)],
                                                               str(tmp_path), plant), timeout=RUN_S)
    logs = [(tmp_path / f"rank{r}.log").read_text() for r in range(2)]
    return {"statuses": statuses, "logs": logs, "log": "".join(logs),
            "values": json.loads(values.read_text()) if values.exists() else None}


def _error(run: dict[str, Any]) -> re.Match:
    """The one error line of the run (every rank's output), parsed."""
    lines = [ln for ln in run["log"].splitlines() if "pretrain_gpt_zb.py: error:" in ln]
    assert len(lines) == 1, "expected one error line:\n" + "\n".join(lines) + "\n--- log ---\n" + run["log"][-4000:]
    m = ERROR.search(lines[0])
    assert m, lines[0]
    return m


def _last_line(run: dict[str, Any]) -> str:
    return [ln for ln in run["log"].splitlines() if re.search(r"iteration +\d+/ +\d+ \|", ln)][-1]


@pytest.mark.parametrize("precision,post_validation", [("fp32", False), ("bf16", False), ("fp32", True),
                                                       ("bf16", True)])
def test_a_diverging_run_stops_every_rank_naming_the_iteration(tmp_path, precision, post_validation):
    """fp32: the loss of iteration 4 is NaN (and its gradients); bf16: the gradients of iteration 2. Every
    rank exits 1 at that iteration, no update from it applied; the log counts it as Megatron-LM does
    (skipped, and a nan iteration when its loss is NaN)."""
    argv = ARGV + DIVERGE + (["--bf16"] if precision == "bf16" else []) + (EAGER if post_validation else [])
    run = _run(tmp_path, argv)
    assert run["statuses"] == [1, 1], run["log"][-4000:]
    m = _error(run)
    it = 4 if precision == "fp32" else 2
    assert int(m["it"]) == it and m["value"] == "nan", m[0]
    if precision == "fp32":  # loss and gradients NaN: the loss is named (the last stage's rank)
        assert (m["what"], m["rank"]) == (LOSS_NAN, "1"), m[0]
    else:  # the gradients only, on both ranks: the lowest is named
        assert GRAD_NAN.fullmatch(m["what"]) and m["rank"] == "0", m[0]
    train = run["values"]["train"]
    assert [r["iteration"] for r in train] == list(range(1, it + 1))
    assert [r["skipped"] for r in train] == [False] * (it - 1) + [True]
    last = _last_line(run)
    assert f"iteration {it:8d}/" in last and "number of skipped iterations:   1 |" in last, last
    assert f"number of nan iterations:   {1 if precision == 'fp32' else 0} |" in last, last
    assert "training done" not in run["log"]


def test_no_check_for_nan_trains_on(tmp_path):
    """``--no-check-for-nan-in-loss-and-grad``: the old behaviour, NaN trained on to the end (exit 0)."""
    run = _run(tmp_path, ARGV + DIVERGE + ["--no-check-for-nan-in-loss-and-grad"])
    assert run["statuses"] == [0, 0], run["log"][-4000:]
    assert "error:" not in run["log"]
    train = run["values"]["train"]
    assert [r["iteration"] for r in train] == list(range(1, 7)) and not any(r["skipped"] for r in train)
    last = _last_line(run)
    assert "lm loss: NAN" in last and "number of nan iterations:   0 |" in last, last


@pytest.mark.parametrize("flags", [[], ["--overlap-grad-reduce"], ["--overlap-grad-reduce", *EAGER]],
                         ids=["finalize", "overlap", "overlap-post-validation"])
def test_a_nan_computed_in_a_deferred_w_is_caught_at_its_iteration(tmp_path, flags):
    """Rank 0's W's of iteration 3 write NaN into the gradients they compute (its loss stays finite): the
    bucket check -- in ``finalize_model_grads``, or at the bucket's launch after its last W -- names rank 0
    and iteration 3. With post-validation's eager step rank 1 stepped and rolls it back."""
    run = _run(tmp_path, ARGV + ["--lr", "2e-3", "--clip-grad", "0"] + flags, plant=(0, 3))
    assert run["statuses"] == [1, 1], run["log"][-4000:]
    m = _error(run)
    assert (m["rank"], m["it"]) == ("0", "3") and GRAD_NAN.fullmatch(m["what"]), m[0]
    train = run["values"]["train"]
    assert [(r["iteration"], r["skipped"]) for r in train] == [(1, False), (2, False), (3, True)]
    last = _last_line(run)
    assert "number of skipped iterations:   1 | number of nan iterations:   0 |" in last, last
    if EAGER[0] in flags:
        assert "number of rollbacks:   1 |" in last, last


def test_the_script_exits_non_zero_under_torchrun(tmp_path):
    """``pretrain_gpt_zb.py`` itself (fp32, ``--lr 1e4``): the launcher's exit status is not 0, the error
    line is printed once, naming iteration 4; the launcher ends (no rank left waiting). Before that the
    script reported its progress in order: its own first line, then the trainer's set-up and iteration 1."""
    from megatron_zb.testing.distributed import cpu_run_env

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT),
           *ARGV, *DIVERGE]
    proc = subprocess.run(cmd, cwd=tmp_path, env=cpu_run_env(PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=RUN_TIMEOUT)
    assert proc.returncode != 0, proc.stdout[-4000:]
    m = _error({"log": proc.stdout})
    assert (m["it"], m["rank"], m["what"]) == ("4", "1", LOSS_NAN), m[0]
    marks = ["pretrain_gpt_zb.py: loading torch and megatron-core", "> building model", "> model built:",
             "> data ready", "> schedule report", "] iteration        1/"]
    pos = [proc.stdout.index(mark) for mark in marks]
    assert pos == sorted(pos), list(zip(marks, pos))


# ---------------------------------------------------------------------------- the flags
def _validated(*extra: str) -> Any:
    from megatron_zb.training.pretrain import parse_command_line

    argv = SMALL + ["--pipeline-model-parallel-size", "2", "--train-iters", "2", *extra]
    return parse_command_line(argv, world_size=2)


@pytest.mark.parametrize("extra,on", [((), True), (("--no-check-for-nan-in-loss-and-grad",), False),
                                      (("--check-for-nan-in-loss-and-grad",), True), (("--bf16",), True),
                                      (("--fp16", "--loss-scale", "1024"), True), (("--fp16",), False)])
def test_the_flag_pair_and_megatron_lms_fp16_rule(extra, on):
    """Megatron-LM's dest and default; off for fp16 with dynamic loss scaling, with Megatron-LM's warning;
    the run configuration's field, megatron-core DDP's ``check_for_nan_in_grad``."""
    from megatron_zb.training.arguments.training import DYNAMIC_LOSS_SCALE_NAN_CHECK_WARNING
    from megatron_zb.training.run_config import run_config
    from megatron_zb.training.wiring import ddp_config

    validated = _validated(*extra)
    config = run_config(validated.args)
    assert validated.args.check_for_nan_in_loss_and_grad is on
    assert config.precision.check_for_nan_in_loss_and_grad is on and config.precision.checks_nan is on
    assert ddp_config(config.parallel, config.precision).check_for_nan_in_grad is on
    assert (DYNAMIC_LOSS_SCALE_NAN_CHECK_WARNING in validated.notices) is (extra == ("--fp16",))


def test_the_megatron_lm_flag_is_no_longer_refused():
    """Both supported releases' flag tables list it; the parser now takes it (nothing refused)."""
    from megatron_zb.training.arguments import build_parser
    from megatron_zb.training.arguments.megatron_flags import MEGATRON_LM_FLAGS
    from megatron_zb.training.arguments.megatron_flags_0_19 import MEGATRON_LM_FLAGS as FLAGS_0_19

    flag = "--no-check-for-nan-in-loss-and-grad"
    assert flag in MEGATRON_LM_FLAGS and flag in FLAGS_0_19
    args, unknown = build_parser().parse_known_flags(SMALL + ["--train-iters", "2", flag])
    assert unknown is None and args.check_for_nan_in_loss_and_grad is False


def test_the_loss_check_is_megatron_lms():
    """Outside a run (no recorder installed) the loss check raises as Megatron-LM's does."""
    import torch

    from megatron_zb.training.gpt_step import loss_func

    output = torch.tensor([[1.0, float("nan")]])
    loss, _, _ = loss_func(torch.ones(1, 2), output)  # unchecked: as before
    assert torch.isnan(loss)
    with pytest.raises(RuntimeError, match=r"iteration -?\d+: Unexpected result nan \(message='found NaN in local "
                                           r"forward loss calculation'\)"):
        loss_func(torch.ones(1, 2), output, check_for_nan=True)

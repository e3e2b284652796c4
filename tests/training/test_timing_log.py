"""Megatron-LM's ``--timing-log-level``, ``--timing-log-option``, ``--no-barrier-with-level-1-timing``
and ``--lr-warmup-init`` in ``pretrain_gpt_zb.py`` runs (read from the log and ``--loss-log-json``).

Two runs of the trainer in-process on 2 ranks (PP=2, 4 layers, hidden 32, 4 micro batches, 4
iterations, a line every 2; a few seconds each):

  ``level2``  greedy zero bubble, ``--timing-log-level 2 --timing-log-option all --lr-warmup-init 1e-3``;
  ``level1``  megatron-core's 1F1B, ``--timing-log-level 1 --timing-log-option max
              --no-barrier-with-level-1-timing``.
"""

from __future__ import annotations

import re
import shlex

import pytest

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

BASE = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
        "--global-batch-size 8 --lr 2e-3 --lr-warmup-iters 2 --mock-data --num-workers 0 --eval-iters 0 "
        "--log-interval 2 --train-iters 4 --distributed-backend gloo --pipeline-timeout-seconds 60 "
        "--distributed-timeout-minutes 2 --pipeline-model-parallel-size 2 "
        "--zero-bubble-pipeline-timers-start-iter 8 --zero-bubble-pipeline-timers-end-iter 9")
"""PP=2, 4 micro batches of 2, 4 iterations (lines after 2 and 4); no re-planning window."""
RUNS = {
    "level2": "--enable-zero-bubble --timing-log-level 2 --timing-log-option all --lr-warmup-init 1e-3",
    "level1": "--use-megatron-core-schedule --timing-log-level 1 --timing-log-option max "
              "--no-barrier-with-level-1-timing",
}
_LINE = re.compile(r"\] iteration\s+(\d+)/.*elapsed time per iteration \(ms\): ([\d.]+)")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from harness.trainer_run import in_process

    root = tmp_path_factory.mktemp("timing")
    return {name: in_process(root, name, 2, shlex.split(BASE + " " + extra)) for name, extra in RUNS.items()}


def _blocks(log: str) -> list[tuple[int, float, str]]:
    """(iteration, elapsed ms per iteration, the timers block printed after that line), in log order."""
    lines = log.splitlines()
    out = []
    for i, line in enumerate(lines):
        m = _LINE.search(line)
        if m:
            block = []
            for nxt in lines[i + 1:]:
                if _LINE.search(nxt) or not (nxt.startswith(" ") or "time across ranks" in nxt
                                             or nxt.startswith("times across ranks")):
                    break
                block.append(nxt)
            out.append((int(m.group(1)), float(m.group(2)), "\n".join(block)))
    return out


def _all_ranks(block: str) -> dict[str, dict[int, float]]:
    """``--timing-log-option all``'s block: timer -> rank -> ms."""
    out: dict[str, dict[int, float]] = {}
    name = None
    for line in block.splitlines()[1:]:
        m = re.fullmatch(r"     rank\s+(\d+): ([\d.]+)", line)
        if m:
            out[name][int(m.group(1))] = float(m.group(2))  # type: ignore[index]
        else:
            name = line.strip().rstrip(":")
            out[name] = {}
    return out


def test_level_2_all_ranks_block_after_each_line(runs):
    """Level 2 with ``all``: after each iteration line Megatron-LM's "times across ranks (ms):" block with
    every rank's forward-backward, optimizer and the per-micro-batch timers (batch-generator on both
    ranks: the first stage reads tokens, the last labels); each per-iteration time is below the line's
    elapsed time per iteration, and forward-compute below forward-backward (it is part of it)."""
    blocks = _blocks(runs["level2"]["log"])
    assert [it for it, _, _ in blocks] == [2, 4]
    for it, elapsed, block in blocks:
        assert block.startswith("times across ranks (ms):"), block
        timers = _all_ranks(block)
        for name in ("forward-backward", "optimizer", "all-grads-sync", "optimizer-inner-step", "batch-generator",
                     "forward-compute", "backward-compute"):
            assert sorted(timers.get(name, {})) == [0, 1], (it, name, block)
        for r in (0, 1):
            assert 0 < timers["forward-compute"][r] < timers["forward-backward"][r] < elapsed, (it, r, block)
            assert 0 < timers["optimizer"][r] < elapsed
        assert "forward-recv" not in timers  # megatron-core's p2p timers: not megatron-zb's runtime


def test_level_1_max_block_under_megatron_core_schedule(runs):
    """Level 1 with ``max`` (and no barrier): "max time across ranks (ms):" with level-1 timers only, in
    Megatron-LM's format (name padded with dots to 48 columns); megatron-core's 1F1B times forward-backward."""
    blocks = _blocks(runs["level1"]["log"])
    assert [it for it, _, _ in blocks] == [2, 4]
    for it, elapsed, block in blocks:
        lines = block.splitlines()
        assert lines[0] == "max time across ranks (ms):", block
        names = {}
        for line in lines[1:]:
            m = re.fullmatch(r"    (\S+) \.+: ([\d.]+)", line)
            assert m and len(line.split(":")[0]) == 4 + 48, line
            names[m.group(1)] = float(m.group(2))
        assert {"forward-backward", "optimizer"} <= set(names), block
        assert not {"forward-compute", "backward-compute", "batch-generator"} & set(names)
        assert 0 < names["forward-backward"] < elapsed


def test_lr_warmup_init_starts_the_warm_up(runs):
    """--lr-warmup-init 1e-3, --lr 2e-3, warm-up 2 iterations of 8 samples (16), linear decay to 0 over
    4 iterations (32 samples). By hand, the learning rate after each step (the scheduler at 8, 16, 24,
    32 samples): 1e-3 + 1e-3 * 8/16 = 1.5e-3; 2e-3; decay halfway (24 - 16) / (32 - 16): 1e-3; 0."""
    lrs = [r["learning rate"] for r in runs["level2"]["values"]["train"]]
    assert lrs == pytest.approx([1.5e-3, 2e-3, 1e-3, 0.0], rel=1e-12, abs=1e-15)


# ---------------------------------------------------------------------------- without processes
def _validate(extra: str):
    from megatron_zb.training.pretrain import parse_command_line

    return parse_command_line(shlex.split(BASE + " " + extra), world_size=2)


def test_timing_flags_parse_as_megatron_lm_and_level_0_times_nothing():
    from megatron_zb.training.arguments import ArgumentError
    from megatron_zb.training.timing_log import TimingLog, timers_to_log

    args = _validate("").args
    assert (args.timing_log_level, args.timing_log_option, args.barrier_with_L1_time, args.lr_warmup_init) == \
        (0, "minmax", True, 0.0)  # Megatron-LM core_v0.16.1's defaults (training_config.py)
    assert timers_to_log(0) == [] and TimingLog(level=0, option="minmax", barrier=True).timers is None
    assert timers_to_log(1)[0] == "forward-backward" and timers_to_log(1)[-1] == "optimizer"
    assert len(timers_to_log(2)) == 24
    notices = "\n".join(_validate("--timing-log-option all --no-barrier-with-level-1-timing").notices)
    assert ("WARNING: --timing-log-option, --no-barrier-with-level-1-timing without --timing-log-level 1 or 2: "
            "no timers, no effect (as Megatron-LM)") in notices
    with pytest.raises(ArgumentError, match=r"^--timing-log-level: invalid choice 3; choose from 0, 1, 2$"):
        _validate("--timing-log-level 3")  # the choices of Megatron-LM's Literal[0, 1, 2], in the one report
    with pytest.raises(ArgumentError) as e:
        _validate("--lr-warmup-init 3e-3 --min-lr 5e-3")
    assert [p.flag for p in e.value.problems] == ["--min-lr", "--lr-warmup-init"]
    assert "3e-03 is not between 0 and --lr 0.002" in str(e.value) or "0.003 is not between 0 and --lr 0.002" in str(e.value)

"""Megatron's iteration log line, rank-aware printing, the schedule report, TensorBoard."""

from __future__ import annotations

import datetime
import importlib.util
import math
import re

import pytest

from megatron_zb.training.logging_utils import (TensorBoardWriter, format_iteration_line, format_schedule_report,
                                                parse_iteration_line, print_rank_0, print_rank_last,
                                                tensorboard_writer)

EXAMPLE = (" [2026-11-21 10:00:00] iteration       10/     100 | consumed samples:          320 | elapsed time per "
           "iteration (ms): 812.4 | throughput (samples/s): 39.4 | learning rate: 1.000000E-04 | global batch size:"
           "    32 | lm loss: 7.123456E+00 | loss scale: 1.0 | grad norm: 2.345 | number of skipped iterations:   0 |"
           " number of rollbacks:   0 |")

EXAMPLE_VALUES = dict(iteration=10, train_iters=100, consumed_samples=320, elapsed_ms=812.4, throughput=39.4,
                      learning_rate=1e-4, global_batch_size=32, losses={"lm loss": 7.123456}, loss_scale=1.0,
                      grad_norm=2.345, skipped_iterations=0, rollbacks=0)


def test_matches_the_megatron_example_exactly():
    ts = datetime.datetime(2026, 11, 21, 10, 0, 0)
    assert format_iteration_line(**EXAMPLE_VALUES, timestamp=ts) == EXAMPLE
    assert format_iteration_line(**EXAMPLE_VALUES, timestamp="2026-11-21 10:00:00") == EXAMPLE


def test_parse_the_example():
    d = parse_iteration_line(EXAMPLE)
    assert d == {"timestamp": "2026-11-21 10:00:00", "iteration": 10, "train_iters": 100, "consumed samples": 320,
                 "elapsed time per iteration (ms)": 812.4, "throughput (samples/s)": 39.4,
                 "learning rate": 1e-4, "global batch size": 32, "lm loss": 7.123456, "loss scale": 1.0,
                 "grad norm": 2.345, "number of skipped iterations": 0, "number of rollbacks": 0}


@pytest.mark.parametrize("values", [
    dict(iteration=1, train_iters=5, consumed_samples=8, elapsed_ms=12345.67, learning_rate=3.5e-7,
         global_batch_size=8, losses={"lm loss": 10.5}, loss_scale=4294967296.0),
    dict(iteration=123456, train_iters=500000, consumed_samples=987654321, elapsed_ms=0.04, learning_rate=0.0,
         global_batch_size=1536, losses={"lm loss": 2.25, "aux loss": 0.001953125}, loss_scale=65536.0, grad_norm=0.5,
         throughput=1234.5, num_zeros_in_grad=3.0, params_norm=271.125, skipped_iterations=2, nan_iterations=1,
         rollbacks=7),
    dict(iteration=3, train_iters=3, consumed_samples=0, elapsed_ms=1.0, learning_rate=1.0, global_batch_size=2,
         losses={}, loss_scale=1.0, grad_norm=float("inf"), nan_iterations=0),
])
def test_round_trip(values):
    line = format_iteration_line(**values)
    d = parse_iteration_line("[rank7]:" + line)  # launcher prefixes are ignored
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}", d["timestamp"])
    assert (d["iteration"], d["train_iters"]) == (values["iteration"], values["train_iters"])
    assert d["consumed samples"] == values["consumed_samples"]
    assert d["global batch size"] == values["global_batch_size"]
    assert d["elapsed time per iteration (ms)"] == pytest.approx(values["elapsed_ms"], abs=0.05)
    assert d["learning rate"] == pytest.approx(values["learning_rate"], rel=1e-6)
    for name, loss in values["losses"].items():
        assert d[name] == pytest.approx(loss, rel=1e-6)
    assert d["loss scale"] == values["loss_scale"]
    assert d["number of skipped iterations"] == values.get("skipped_iterations", 0)
    optional = {"grad_norm": "grad norm", "throughput": "throughput (samples/s)", "params_norm": "params norm",
                "num_zeros_in_grad": "num zeros", "nan_iterations": "number of nan iterations",
                "rollbacks": "number of rollbacks"}
    for arg, key in optional.items():
        if values.get(arg) is None:
            assert key not in d
        elif math.isinf(values[arg]):
            assert math.isinf(d[key])
        else:
            assert d[key] == pytest.approx(values[arg], abs=0.05)
    # every field printed is parsed back, nothing else
    assert len(d) == 3 + line.count("|") - 1


def test_parse_rejects_other_lines():
    with pytest.raises(ValueError, match="not a training iteration line"):
        parse_iteration_line(" > building train, validation, and test datasets ...")


def test_print_helpers_flush_on_single_process(capsys):
    print_rank_0("hello from rank 0")
    print_rank_last("hello from the last rank")
    assert capsys.readouterr().out == "hello from rank 0\nhello from the last rank\n"


def test_schedule_report():
    text = format_schedule_report(schedule="zb", num_ranks=4, num_microbatches=8, predicted_bubble_rate=0.0312,
                                  peak_activation_memory=[4, 4, 3.5, 2], memory_limit=4.0,
                                  measured_idle_fraction=[0.05, 0.02, 0.01, 0.04],
                                  measured_costs={"T_W": 0.9, "T_F": 1.2, "T_B": 1.3, "T_comm": 0.05})
    assert "schedule: zb" in text and "pipeline ranks: 4, micro batches per iteration: 8" in text
    assert "predicted bubble rate: 3.1%" in text
    assert "predicted peak activation memory per rank (M_B): [4.00, 4.00, 3.50, 2.00]" in text
    assert "measured idle fraction per rank: [5.0%, 2.0%, 1.0%, 4.0%]" in text
    assert "measured costs (ms): T_F=1.200, T_B=1.300, T_W=0.900, T_comm=0.050" in text
    bare = format_schedule_report(schedule="1f1b", num_ranks=2, num_microbatches=4)
    assert "not measured" in bare and "not profiled" in bare and "bubble" not in bare


def test_schedule_report_says_when_cpu_processes_share_cores(monkeypatch):
    """The CPU demo: 4 pipeline processes on 2 cores measure mostly time-slicing as idle time."""
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    report = dict(schedule="zb", num_ranks=4, num_microbatches=8, measured_idle_fraction=[0.5, 0.4, 0.3, 0.6])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert "note: 4 processes share 2 CPU core(s) on this machine" in format_schedule_report(**report)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert "note:" not in format_schedule_report(**report)


def test_tensorboard_writer_disabled_without_dir():
    w = tensorboard_writer(None)
    assert not w.enabled
    w.add_scalars({"lm loss": 1.0}, 1)  # no-op
    w.close()


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None, reason="tensorboard is installed")
def test_tensorboard_missing_is_reported(tmp_path, capsys):
    w = tensorboard_writer(str(tmp_path / "tb"))
    assert not w.enabled
    err = capsys.readouterr().err
    assert "WARNING" in err and "--tensorboard-dir" in err and "pip install tensorboard" in err


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed")
def test_tensorboard_writes(tmp_path):
    w = TensorBoardWriter(str(tmp_path / "tb"))
    assert w.enabled
    w.add_scalars({"lm loss": 1.0}, 1)
    w.close()
    assert any((tmp_path / "tb").iterdir())

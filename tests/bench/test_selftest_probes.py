"""The GPU self-test's diagnostic modules on CPU: the head-of-line probe and the host-bound diagnosis.

What a CPU can check of :mod:`megatron_zb.testing.hol_probe`: the verdict on fake timings, the
two-rank form end to end with gloo at 1 KiB (launch, both process groups, the issue order, the
bounded wait, the report; gloo completes it), its argument checks and the stream form's refusal
without CUDA. Of :mod:`megatron_zb.testing.host_bound`: the report parsing on recorded lines, the
side-by-side table, and one variant end to end at a tiny size with gloo. Not tested here: any
timing or queue behaviour of a GPU, NCCL at 64 MiB.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from megatron_zb.testing import hol_probe, host_bound

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------- head-of-line probe
@pytest.mark.parametrize("k1,k3,kind,text", [
    (200.0, 201.0, "blocking", "head-of-line blocking observed (K3 done after 201.00 ms, K1 200.0 ms)"),
    (200.0, 0.05, "none", "no head-of-line blocking (K3 done after 0.05 ms, K1 200.0 ms)"),
    (200.0, 100.0, "inconclusive", "inconclusive (K3 done after 100.00 ms, K1 200.0 ms: between 0.25 and 0.9 of K1)"),
    (0.0, 0.0, "inconclusive", "inconclusive: K1 took 0.00 ms (the long kernel did not run)"),
])
def test_verdict_on_fake_timings(k1, k3, kind, text):
    v = hol_probe.verdict(k1, k3)
    assert (v.kind, v.line) == (kind, text)


def test_verdict_thresholds_are_the_documented_ones():
    assert hol_probe.verdict(200.0, 0.9 * 200.0).kind == "blocking"
    assert hol_probe.verdict(200.0, 0.25 * 200.0).kind == "none"
    assert hol_probe.planned_seconds(["stream"]) == 2 * hol_probe.STREAM_CHILD_TIMEOUT_S
    assert hol_probe.planned_seconds(["stream", "nccl"]) == 2 * (hol_probe.STREAM_CHILD_TIMEOUT_S
                                                                  + hol_probe.NCCL_CHILD_TIMEOUT_S)


def test_two_rank_form_runs_on_gloo_under_both_settings(capsys, monkeypatch):
    """Two processes, one group per direction, two isends before the irecvs, 1 KiB: gloo completes it
    (the receives are posted by the host at once); the driver reports both settings."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert hol_probe.main(["--forms", "nccl", "--backend", "gloo", "--bytes", "1024", "--wait-s", "8"]) == 0
    out = capsys.readouterr().out
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1, nccl form" in out and "unset (CUDA's default, 8 queues), nccl form" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("head-of-line probe: ANSWERED: nccl, one hardware queue: two isends of 1024 B before "
                           "the irecvs: completed")
    assert "nccl, default queues: two isends of 1024 B before the irecvs: completed" in last


def test_arguments_are_checked(capsys):
    assert hol_probe.main(["--forms", "stream,bogus"]) == 2
    assert hol_probe.main(["--forms", "nccl", "--wait-s", "0"]) == 2
    assert "--forms takes stream and/or nccl" in capsys.readouterr().err


def test_stream_form_without_cuda_is_a_failure_that_says_why(capsys, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the stream form would run")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    assert hol_probe.main(["--forms", "stream"]) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("head-of-line probe: FAIL: stream, one hardware queue: stream form failed (exit 1)")
    assert "needs a CUDA GPU" in last


def test_settings_set_and_remove_the_variable(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    assert hol_probe.child_env("1")["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in hol_probe.child_env(None)
    assert hol_probe.CONNECTION_SETTINGS == ("1", None)


# ---------------------------------------------------------------------------- host-bound diagnosis
REPORT = """> schedule report (unit costs T_F = T_B = T_W = 1, before profiling):
    measured idle fraction per rank: not measured
    measured costs: not profiled
 [2026-12-07 03:41:15] iteration        4/       6 | consumed samples:           16 | elapsed time per iteration (ms): 470.0 | lm loss: 5.9E+00 |
> schedule report after profiling iterations 2-4 (costs: mean over stages, ms; idle: 1 - busy/elapsed per pipeline rank):
    measured idle fraction per rank: [31.0%]
    measured costs (ms): T_F=38.900, T_B=23.800, T_W=4.200, T_comm=0.000
    measured host time per action (ms): F 20.1; the rank is host-bound: the GPU waited 31% of the window
 [2026-12-07 03:41:16] iteration        5/       6 | consumed samples:           20 | elapsed time per iteration (ms): 455.0 | lm loss: 5.9E+00 |
 [2026-12-07 03:41:17] iteration        6/       6 | consumed samples:           24 | elapsed time per iteration (ms): 465.0 | lm loss: 5.9E+00 |
"""


def test_report_parsing_reads_the_report_after_the_window():
    rep = host_bound.read_report(REPORT.splitlines(keepends=True), window_end=5)
    assert rep["costs"] == {"T_F": 38.9, "T_B": 23.8, "T_W": 4.2, "T_comm": 0.0}
    assert rep["iteration_ms"] == 460.0  # iterations 5 and 6
    assert rep["host_bound"] == ["measured host time per action (ms): F 20.1; the rank is host-bound: the GPU "
                                 "waited 31% of the window"]
    assert rep["measured"][0] == "measured idle fraction per rank: [31.0%]" and len(rep["measured"]) == 3


def test_side_by_side_shows_every_variant_and_their_host_bound_lines():
    rep = host_bound.read_report(REPORT.splitlines(), window_end=5)
    table = host_bound.side_by_side({"before": {"status": "PASS", "report": rep}})
    rows = table.splitlines()
    assert rows[2].startswith("| before   |   38.9 |   23.8 |    4.2 |        460.0 | PASS")
    assert "(not run yet)" in rows[3] and "(not run yet)" in rows[4]
    assert rows[5].startswith("before: measured host time per action")
    flags = host_bound.variant_flags("no-mask", ["--x"], Path("/r"))
    assert flags == ["--x", "--num-workers", "0", "--no-create-attention-mask-in-dataloader", "--profile-out",
                     "/r/profile.json", "--loss-log-json", "/r/loss.json"]


def test_one_variant_runs_on_cpu_at_a_tiny_size(tmp_path, capsys, monkeypatch):
    """pretrain_gpt_zb.py at PP=1 under torchrun (gloo), the profiling window 2-4: the costs are read,
    the table is printed, the missing PP=1 profile is a note, not a failure."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    common = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
              "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "4",
              "--train-iters", "5", "--lr", "1e-4", "--mock-data", "--log-interval", "1", "--eval-iters", "0",
              "--distributed-backend", "gloo", "--pipeline-model-parallel-size", "1", "--enable-zero-bubble",
              "--zero-bubble-pipeline-timers-start-iter", "2", "--zero-bubble-pipeline-timers-end-iter", "4"]
    code = host_bound.main(["--variant", "no-mask", "--dir", str(tmp_path), "--timeout", "240", "--", *common])
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith("host-bound no-mask: PASS: T_F ") and "profile.json not written" in last
    assert "must be >= 2 to plan a pipeline schedule" in last  # the trainer's reason, quoted
    saved = json.loads((tmp_path / "no-mask.json").read_text())
    assert saved["status"] == "PASS" and set(saved["report"]["costs"]) >= {"T_F", "T_B", "T_W"}
    assert "| no-mask  |" in out and "| before   |      - |" in out
    assert os.path.isfile(tmp_path / "no-mask" / "train.log")

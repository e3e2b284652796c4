"""``scripts/gpu_selftest.sh`` on a CPU machine: its dry run prints commands that exist and parse.

No GPU here, so the script itself is only dry-run: every printed command must parse as bash,
name a Python module or script that exists, and -- for pytest -- select at least one test; every
``pretrain_gpt_zb.py`` flag list it would launch passes the trainer's validation (gloo instead of
nccl: no CUDA here), and the memory step's plan flags describe the model of the run it compares.
The modules the steps run are exercised here on CPU at tiny sizes: the benchmark
(:mod:`megatron_zb.testing.gpu_bench`), the p2p stress (:mod:`megatron_zb.testing.p2p_stress`),
the run checks of :mod:`megatron_zb.testing.pretrain_run` and the comparison of
:mod:`megatron_zb.testing.memory_check`; the summary machinery runs with a stub Python.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_zb.testing import gpu_bench, memory_check, p2p_stress, pretrain_run

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_selftest.sh"
TINY = p2p_stress.StressModel(seq=16, hidden=32, heads=4, ffn=64, vocab=64, dtype="bf16")


def _dry_run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(["bash", str(SCRIPT), "--dry-run", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def _commands(out: str) -> list[str]:
    return [line[2:] for line in out.splitlines() if line.startswith("+ ")]


def _python_argv(command: str) -> tuple[dict[str, str], list[str]] | None:
    """(environment, argv from ``python`` on) of a printed command, None if it does not run Python."""
    words = shlex.split(command)
    env: dict[str, str] = {}
    if words[0] == "env":
        words = words[1:]
        while words and "=" in words[0]:
            k, v = words.pop(0).split("=", 1)
            env[k] = v
    if not words or Path(words[0]).name not in ("python", "python3", Path(sys.executable).name):
        return None
    return env, words[1:]


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def _check_pretrain(argv: list[str], tmp_path: Path) -> list[str]:
    """Validate a pretrain_run command's pretrain_gpt_zb.py flags as the trainer does; return them."""
    from megatron_zb.training.pretrain import parse_command_line

    own, flags = _split(argv)
    nproc = int(own[own.index("--nproc") + 1])
    out = Path(own[own.index("--out") + 1])
    assert pretrain_run.flag_value(flags, "--loss-log-json") == str(out / "loss.json")
    assert "--mock-data" in flags and "--distributed-backend" in flags  # nothing to download
    assert "--bf16" in flags  # the production precision
    local = [a.replace(str(out.parent), str(tmp_path)) for a in flags]  # the run creates its --out first
    (tmp_path / out.name).mkdir(exist_ok=True)
    local[local.index("--distributed-backend") + 1] = "gloo"  # no CUDA here (validation refuses nccl)
    v = parse_command_line(local, world_size=nproc)
    assert v.args.pipeline_model_parallel_size * v.args.tensor_model_parallel_size == nproc
    if pretrain_run.flag_value(flags, "--profile-out") is not None:
        assert v.args.zero_bubble_pipeline_timers_end_iter < v.args.train_iters  # the window ends, then re-plans
    return flags


def test_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_dry_run_prints_commands_that_exist_and_parse(tmp_path):
    res = _dry_run("--gpus", "8", "--out", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    assert not (tmp_path / "out").exists(), "a dry run writes nothing"
    commands = _commands(res.stdout)
    assert len(commands) >= 14, res.stdout
    assert any("MEGATRON_ZB_TEST_DEVICE=cuda" in c and "tests/runtime/test_runtime.py" in c for c in commands)
    assert any("tests/runtime/test_te_real.py" in c for c in commands)
    assert any("megatron_zb.testing.gpu_bench --pp 8" in c for c in commands)
    assert any("MEGATRON_ZB_TEST_DEVICE=cuda" in c and "megatron_zb.testing.p2p_stress --pp 8" in c for c in commands)
    assert any("tests/runtime/test_runtime.py -k tp2_pp2" in c for c in commands)
    pretrains: dict[str, list[str]] = {}
    memory_argvs: list[list[str]] = []
    for command in commands:
        assert subprocess.run(["bash", "-n", "-c", command]).returncode == 0, command
        parsed = _python_argv(command)
        if parsed is None:
            assert shlex.split(command)[0] == "nvidia-smi", f"unexpected command {command!r}"
            continue
        env, argv = parsed
        assert env.get("MEGATRON_ZB_TEST_DEVICE", "cuda") == "cuda"
        if argv[0] == "-c":
            compile(argv[1], "<gpu_selftest -c>", "exec")
        elif argv[:2] == ["-m", "pytest"]:
            paths = [a for a in argv[2:] if a.startswith("tests/")]
            assert paths and all((ROOT / p).is_file() for p in paths), command
            keep = [a for a in argv[2:] if a not in ("-q", "-rs")]
            collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *keep], cwd=ROOT,
                                       env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                                       timeout=300)
            assert collected.returncode == 0, collected.stdout[-2000:]
            assert "::test_" in collected.stdout, f"{command!r} selects no test"
        elif argv[:2] == ["-m", "megatron_zb.testing.pretrain_run"]:
            own, _ = _split(argv[2:])
            pretrains[own[own.index("--label") + 1]] = _check_pretrain(argv[2:], tmp_path)
        elif argv[:2] == ["-m", "megatron_zb.testing.memory_check"]:
            memory_argvs.append(argv[2:])
        elif argv[0] == "-m":
            assert importlib.util.find_spec(argv[1]) is not None, command
            helped = subprocess.run([sys.executable, "-m", argv[1], "--help"], cwd=ROOT, capture_output=True,
                                    text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
            assert helped.returncode == 0 and "--pp" in helped.stdout
            assert all(o in helped.stdout for o in argv[2:] if o.startswith("--")), command
        else:
            assert (ROOT / argv[0]).is_file(), command
    # step 4: zb, zb-2p and zbv at PP=2 with the profile-then-replan window writing --profile-out
    for label, selector in (("zb", ["--enable-zero-bubble"]), ("zb-2p", ["--schedule", "zb-2p"]),
                            ("zbv", ["--zero-bubble-v-schedule"])):
        flags = pretrains[label]
        assert " ".join(selector) in " ".join(flags) and pretrain_run.flag_value(flags, "--profile-out")
        assert pretrain_run.flag_value(flags, "--pipeline-model-parallel-size") == "2"
    # step 5: TP=2 with sequence parallelism, at PP=1 (2 GPUs) and PP=2 (4 GPUs)
    for label in ("zb-tp2-sp", "zb-tp2-sp-pp2"):
        assert "--sequence-parallel" in pretrains[label]
        assert pretrain_run.flag_value(pretrains[label], "--tensor-model-parallel-size") == "2"
    # step 6: each plan describes its memory run's model and schedule, and accepts the flags: PP=2,
    # and TP=2 with sequence parallelism x PP=2 (local layers here, where TE is not installed)
    from megatron_zb.cli import main as cli_main

    checked = {}
    for memory_argv in memory_argvs:
        own, plan_flags = _split(memory_argv)
        run_dir = own[own.index("--run") + 1]
        schedule = own[own.index("--schedule") + 1]
        label = run_dir.rsplit("pretrain-", 1)[1]
        run_flags = pretrains[label]
        assert pretrain_run.flag_value(run_flags, "--schedule") == schedule
        assert pretrain_run.flag_value(run_flags, "--transformer-impl") == "local"  # what the plan models here
        for i, flag in enumerate(plan_flags):
            if flag.startswith("--") and flag != "--vocab-size":
                nxt = plan_flags[i + 1] if i + 1 < len(plan_flags) else "--"
                value = None if nxt.startswith("--") else nxt
                assert flag in run_flags and (value is None or pretrain_run.flag_value(run_flags, flag) == value), flag
        assert plan_flags[plan_flags.index("--vocab-size") + 1] == "258"  # ByteLevel: 256 bytes + EOD + PAD
        assert cli_main(["plan", *plan_flags, "--schedules", schedule, "--gpu", "H100",
                         "--json", str(tmp_path / "plan.json")]) == 0
        checked[label] = plan_flags
    assert set(checked) == {"zb-h1-memory", "zb-h1-tp2-sp-memory"}
    assert "--sequence-parallel" in checked["zb-h1-tp2-sp-memory"]
    assert pretrain_run.flag_value(checked["zb-h1-tp2-sp-memory"], "--tensor-model-parallel-size") == "2"
    assert "--transformer-impl" in checked["zb-h1-tp2-sp-memory"]  # the plan models the run's layers
    # the summary lists every step
    assert "== gpu_selftest summary (8 GPU(s), dry run: nothing was run)" in res.stdout
    for name in ("p2p stress, 64 MiB sends, every schedule (PP=8)", "pretrain zb PP=2 on CUDA",
                 "pretrain zb TP=2 SP PP=1 on CUDA", "memory vs megatron-zb plan (zb-h1 PP=2)",
                 "memory vs megatron-zb plan (zb-h1 TP=2 SP PP=2, local)"):
        assert f"WOULD RUN  {name}" in res.stdout


def test_one_gpu_node_runs_what_fits_and_says_what_it_skips():
    res = _dry_run("--gpus", "1")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "skipped: benchmark -- a pipeline needs 2 or more GPUs" in out
    assert "skipped: Transformer Engine parity -- needs 2 GPUs" in out
    assert "skipped: p2p stress -- needs 2 GPUs" in out
    assert "skipped: pretrain zb, zb-2p, zbv PP=2 on CUDA -- needs 2 GPUs: PP=1 cannot test the pipeline" in out
    assert "skipped: TP=2 with sequence parallelism -- needs 2 GPUs" in out
    assert "skipped: memory vs megatron-zb plan -- needs 2 GPUs" in out
    assert "SKIPPED  p2p stress (needs 2 GPUs)" in out  # in the summary too
    assert "every test that needs 2 or more ranks" in out
    commands = _commands(out)
    assert not any("gpu_bench" in c or "p2p_stress" in c for c in commands)
    assert any("tests/runtime/test_runtime.py" in c for c in commands)
    [pp1] = [c for c in commands if "pretrain_run" in c]
    assert "--nproc 1 " in pp1 and "--pipeline-model-parallel-size 1" in pp1 and "--profile-out" not in pp1


def test_two_gpu_node_runs_tp2_sp_without_a_pipeline():
    res = _dry_run("--gpus", "2")
    assert res.returncode == 0, res.stderr
    assert "skipped: TP=2 with sequence parallelism x PP=2 -- needs 4 GPUs" in res.stdout
    commands = _commands(res.stdout)
    assert any("p2p_stress --pp 2" in c for c in commands)
    assert any("--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1" in c
               for c in commands)
    assert not any("-k tp2_pp2" in c for c in commands)


def test_without_gpu_and_without_dry_run_it_refuses():
    res = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert res.returncode == 2 and "no CUDA device visible" in res.stderr


def test_summary_lists_each_step_with_its_reason_and_is_written_to_out(tmp_path):
    """The non-dry path with a stub Python (and no nvidia-smi): PASS / FAIL / SKIPPED with reasons,
    the summary also in OUT/summary.txt, one log per step, exit 1 when a step failed."""
    stub = tmp_path / "python"
    stub.write_text("#!/usr/bin/env bash\n"
                    "case \"$*\" in\n"
                    "  *p2p_stress*) echo 'p2p stress: FAIL: zb-2p (deadlock or hang)'; exit 1 ;;\n"
                    "  *) echo \"stub ran: ${*: -1}\" ;;\n"
                    "esac\n")
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHON=str(stub), PATH=f"{tmp_path}:/usr/bin:/bin")
    res = subprocess.run(["bash", str(SCRIPT), "--gpus", "2", "--skip-bench", "--out", str(out)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    summary = (out / "summary.txt").read_text()
    assert summary in res.stdout
    lines = summary.splitlines()
    assert any(ln.startswith("FAIL     p2p stress") and ln.endswith("p2p stress: FAIL: zb-2p (deadlock or hang)")
               for ln in lines), summary
    assert any(ln.startswith("FAIL     environment") for ln in lines), summary  # no nvidia-smi on PATH
    assert any(ln.startswith("PASS     pretrain zb PP=2 on CUDA") and "stub ran: " in ln for ln in lines), summary
    assert "SKIPPED  benchmark (--skip-bench)" in lines
    assert "SKIPPED  TP=2 with sequence parallelism x PP=2 (needs 4 GPUs)" in lines
    assert (out / "pretrain_zb_PP=2_on_CUDA.log").is_file()


def test_benchmark_runs_on_cpu_at_tiny_sizes(capsys):
    assert gpu_bench.main(["--pp", "2", "--iters", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "schedule" not in line]
    assert [r.split("|")[1].strip() for r in rows] == list(gpu_bench.VARIANTS)
    assert all(float(r.split("|")[2]) > 0 for r in rows)


@pytest.mark.parametrize("pp,gib,hidden", [(8, 80.0, 2048), (4, 24.0, 1024)])
def test_model_is_sized_for_the_gpus(pp, gib, hidden):
    sizes = gpu_bench.model_for(pp=pp, gpu_memory_gib=gib)
    assert sizes["hidden"] == hidden and sizes["layers"] == 4 * pp and sizes["layers"] % (2 * pp) == 0


# ---------------------------------------------------------------------------- p2p stress
def test_stress_sends_are_production_sized_by_default():
    assert p2p_stress.StressModel().send_bytes() >= 64 * 2**20


def test_p2p_stress_runs_on_cpu_at_tiny_sizes(capsys):
    """One schedule per placement, bf16 as on GPUs, through get_forward_backward_func; the
    consistency check finds the same losses and gradient norm within each placement."""
    argv = ["--pp", "2", "--seq", str(TINY.seq), "--hidden", str(TINY.hidden), "--heads", str(TINY.heads),
            "--ffn", str(TINY.ffn), "--vocab", str(TINY.vocab), "--timeout", "120",
            "--schedules", "1f1b,zb-2p,zbv,v-min,interleaved-zb"]
    assert p2p_stress.main(argv) == 0
    out = capsys.readouterr().out
    rows = {r.split("|")[1].strip(): r for r in out.splitlines() if r.startswith("| ") and "schedule" not in r}
    assert list(rows) == ["1f1b", "zb-2p", "zbv", "v-min", "interleaved-zb"]
    assert all(r.split("|")[3].strip() == "PASS" for r in rows.values()), out
    assert "equal 1f1b's" in rows["zb-2p"] and "equal zbv's" in rows["v-min"]
    assert out.strip().splitlines()[-1] == "p2p stress: PASS: 5 schedules (1.0 KiB per send, PP=2)"


def _hang(model: dict, schedule: object, p2p_timeout: float) -> dict:
    """A rank that never finishes (as a GPU-side deadlock looks from the host: blocked forever)."""
    import time

    time.sleep(600)
    return {}


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def test_a_hang_is_a_fail_naming_the_schedule():
    from megatron_zb.testing.distributed import run_distributed

    assert run_distributed(_rank, world_size=2, timeout=120) == [0, 1]  # warm processes: they start in < 1 s
    # 10 s: on a loaded machine a rank may take seconds to reach _hang, and the stack must show it there
    row = p2p_stress.run_schedule("zb", spec=TINY, pp=2, timeout=10, p2p_timeout=2, rank_fn=_hang)
    assert (row.schedule, row.status) == ("zb", "FAIL")
    assert "deadlock or hang: rank(s) [0, 1] did not finish within 10 s" in row.note
    assert "in _hang" in row.note  # where the ranks were blocked


def test_consistency_check_fails_a_schedule_whose_losses_differ():
    def row(name: str, losses: list[float], norm: float = 1.0) -> p2p_stress.Outcome:
        return p2p_stress.Outcome(name, "plain", "PASS", losses=losses, grad_norm=norm)

    rows = [row("1f1b", [1.0, 2.0]), row("zb", [1.0, 2.0]), row("zb-2p", [2.0, 1.0]), row("zb-h1", [1.0, 2.0], 1.1)]
    p2p_stress.check_consistency(rows, grad_rtol=1e-3)
    assert [r.status for r in rows] == ["PASS", "PASS", "FAIL", "FAIL"]
    assert "losses differ from 1f1b's" in rows[2].note and "gradient norm" in rows[3].note


# ---------------------------------------------------------------------------- pretrain runs and memory
def _fake_run(out: Path, *, peaks: list[int], loss: float = 5.0, profile: bool = True) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    for r, p in enumerate(peaks):
        (out / f"memory_rank{r}.json").write_text(json.dumps(
            {"rank": r, "exit": 0, "device": "cuda:0 H100", "total_bytes": 80 * 2**30, "max_allocated_bytes": p}))
    (out / "loss.json").write_text(json.dumps({"train": [{"lm loss": 5.5}, {"lm loss": loss}]}))
    if profile:  # rank 1 computes 4 x (2 + 2 + 2) = 24 ms per iteration
        (out / "profile.json").write_text(json.dumps({
            "parallel": {"num_microbatches": 4}, "stage_to_rank": [0, 1],
            "stages": [{"t_f_ms": 1, "t_b_ms": 1, "t_w_ms": 1}, {"t_f_ms": 2, "t_b_ms": 2, "t_w_ms": 2}]}))
    return ["--loss-log-json", str(out / "loss.json"), "--profile-out=" + str(out / "profile.json")]


def test_pretrain_run_checks_exit_losses_profile_and_memory_records(tmp_path):
    flags = _fake_run(tmp_path / "ok", peaks=[3 * 2**30, 2 * 2**30]) + ["--zero-bubble-pipeline-timers-end-iter", "4"]
    log = [f" [2026-11-22 01:13:41] iteration {i:8d}/      40 | consumed samples: {4 * i:12d} | elapsed time per "
           f"iteration (ms): {t} | lm loss: 5.0E+00 |" for i, t in ((3, 500.0), (4, 30.0), (5, 40.0), (6, 50.0))]
    res = pretrain_run.check_run(tmp_path / "ok", flags, nproc=2, exit_code=0, seconds=12.0, timeout=60, label="zb",
                                 log_lines=["other output", *log])
    assert res["status"] == "PASS" and res["peak_bytes"] == [3 * 2**30, 2 * 2**30]
    assert res["coverage"] == {"busy_ms": 24.0, "iteration_ms": 40.0, "ratio": 0.6}  # iterations 4-6 (after the window)
    line = pretrain_run.summary_line(res)
    assert line.startswith("pretrain zb (2 processes): PASS: 12 s; 2 iterations, lm loss 5.5000 -> 5.0000")
    assert "profiled compute of the busiest rank 24.0 ms = 60% of the measured iteration 40.0 ms" in line
    assert line.endswith("peak CUDA memory per rank 3.00, 2.00 GiB")
    assert json.loads((tmp_path / "ok" / "result.json").read_text())["status"] == "PASS"

    flags = _fake_run(tmp_path / "bad", peaks=[1], loss=float("nan"), profile=False)
    res = pretrain_run.check_run(tmp_path / "bad", flags, nproc=2, exit_code=0, seconds=1, timeout=60, label="zbv")
    assert res["status"] == "FAIL"
    line = pretrain_run.summary_line(res)
    assert "memory records from 1 of 2 ranks" in line and "non-finite lm loss" in line and "not written" in line
    (tmp_path / "hung").mkdir()
    hung = pretrain_run.check_run(tmp_path / "hung", [], nproc=2, exit_code=None, seconds=60, timeout=60, label="zb")
    assert hung["problems"] == ["did not finish within 60 s (killed; a hang?)"]


def test_plan_json_has_per_rank_memory():
    from megatron_zb.planning.hardware import resolve_hardware
    from megatron_zb.planning.model import make_model, make_parallel
    from megatron_zb.planning.planner import plan

    model = make_model(num_layers=8, hidden_size=2048, num_attention_heads=16, seq_length=2048, micro_batch_size=1,
                       vocab_size=258, precision="bf16")
    par = make_parallel(model, pp=2, num_microbatches=8)
    [fam] = plan(model=model, parallel=par, hardware=resolve_hardware(gpu="H100"), schedules=["zb-h1"]).families
    assert len(fam.peak_memory_per_rank_gib) == 2
    assert max(fam.peak_memory_per_rank_gib) == pytest.approx(fam.peak_memory_gib)
    for total, act, par_opt in zip(fam.peak_memory_per_rank_gib, fam.peak_activation_per_rank_gib,
                                   fam.param_optimizer_per_rank_gib):
        assert total == pytest.approx(act + par_opt)


def test_memory_check_fails_only_above_the_plans_headroom(tmp_path, capsys):
    row = {"name": "zb-h1", "peak_memory_per_rank_gib": [10.0, 8.0], "peak_activation_per_rank_gib": [6.0, 4.0],
           "param_optimizer_per_rank_gib": [4.0, 4.0]}
    margin = memory_check.DEFAULT_MARGIN
    assert margin == pytest.approx(1 / 0.9 - 1)
    _, problems = memory_check.compare([int(10.0 * 1.11 * 2**30), int(4.0 * 2**30)], row, margin)
    assert problems == []  # 11% over on rank 0 (inside 1/0.9), far under on rank 1: both pass
    table, problems = memory_check.compare([int(10.0 * 1.12 * 2**30), int(8.0 * 2**30)], row, margin)
    assert problems == ["rank 0: measured 11.20 GiB > predicted 10.00 GiB x 1.111"] and "OVER" in table
    # TP=2: four ranks, global ranks 0-1 on pipeline rank 0 and 2-3 on pipeline rank 1 (tp-cp-ep-dp-pp order)
    table, problems = memory_check.compare([int(10.0 * 2**30), int(10.5 * 2**30), int(8.5 * 2**30),
                                            int(8.0 * 1.2 * 2**30)], row, margin)
    assert problems == ["rank 3: measured 9.60 GiB > predicted 8.00 GiB x 1.111"] and "| 2 (pp 1) |" in table
    _, problems = memory_check.compare([int(2**30)] * 3, row, margin)
    assert problems == ["3 measured ranks but the plan has 2 pipeline ranks (not a multiple)"]

    # end to end: a recorded run against megatron-zb plan (run in-process)
    run = tmp_path / "run"
    flags = _fake_run(run, peaks=[6 * 2**30, 30 * 2**30])
    pretrain_run.check_run(run, flags, nproc=2, exit_code=0, seconds=1, timeout=60, label="zb-h1")
    plan_flags = ["--num-layers", "8", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
                  "--micro-batch-size", "1", "--global-batch-size", "8", "--bf16", "--pipeline-model-parallel-size",
                  "2", "--vocab-size", "258"]
    assert memory_check.main(["--run", str(run), "--schedule", "zb-h1", "--", *plan_flags]) == 1
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1].startswith("memory vs plan: FAIL: rank 1: measured 30.00 GiB > predicted")
    assert (run / "plan.json").is_file() and (run / "memory_vs_plan.txt").is_file()


def test_memory_check_fails_without_a_passing_run(tmp_path, capsys):
    assert memory_check.main(["--run", str(tmp_path), "--schedule", "zb-h1", "--", "--num-layers", "8"]) == 1
    assert "memory vs plan: FAIL: no result of the pretrain run" in capsys.readouterr().out

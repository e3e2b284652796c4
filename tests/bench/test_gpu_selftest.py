"""``scripts/gpu_selftest.sh`` on a CPU machine: its plan fits 9 minutes, its commands exist and parse,
no step is handed a schedule its runtime refuses, and its runner writes each result as it ends.

No GPU here, so the plan is only dry-run: for 1, 2, 4 and 8 GPUs the critical path is at most the
budget, every printed command parses as bash and names a Python module or test file that exists,
every ``pretrain_gpt_zb.py`` flag list passes the trainer's validation (gloo instead of nccl: no CUDA
here), the memory jobs' plan flags describe their runs' models, and every schedule the p2p stress
would run is accepted by the runtime itself (:func:`~megatron_zb.runtime.get_forward_backward_func`
and each rank's checked plan). The runner runs stub jobs (a failure, a timeout, a step that reads
the summary written so far), and the script runs with a stub interpreter. The modules the jobs run
are exercised here on CPU at tiny sizes: the benchmark, the p2p stress, ``pretrain_run``'s checks and
``memory_check``'s comparison (``tests/bench/test_selftest_probes.py``: the head-of-line probe and the
host-bound diagnosis).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from megatron_zb.testing import gpu_bench, host_bound, memory_check, p2p_stress, pretrain_run
from megatron_zb.testing.selftest import run_plan
from megatron_zb.testing.selftest_jobs import (AT_RISK_FAMILIES, BUDGET_S, COMMAND_LIMIT_S, STRESS_MODEL,
                                               VOCAB_FAMILIES, Command, Context, Job)
from megatron_zb.testing.selftest_plan import Placed, Plan, Step, make_plan
from megatron_zb.schedules.registry import get_spec

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_selftest.sh"
TINY = p2p_stress.StressModel(seq=16, hidden=32, heads=4, ffn=64, vocab=64, dtype="bf16")
NODES = (1, 2, 4, 8)


def _dry_run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(["bash", str(SCRIPT), "--dry-run", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def _commands(out: str) -> list[str]:
    return [line[4:] for line in out.splitlines() if line.startswith("  + ")]


def _python_argv(command: str) -> tuple[dict[str, str | None], list[str]] | None:
    """(environment changes -- None: unset --, argv from ``python`` on) of a printed command; None if
    it does not run Python."""
    words = shlex.split(command)
    env: dict[str, str | None] = {}
    if words[0] == "env":
        words = words[1:]
        while words and (words[0] == "-u" or "=" in words[0]):
            if words[0] == "-u":
                env[words[1]] = None
                words = words[2:]
            else:
                k, v = words.pop(0).split("=", 1)
                env[k] = v
    if not words or Path(words[0]).name not in ("python", "python3", Path(sys.executable).name):
        return None
    return env, words[1:]


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def _validate(flags: list[str], nproc: int, tmp_path: Path):
    """The trainer's validation of ``flags`` (nccl -> gloo: no CUDA here; paths under ``tmp_path``)."""
    from megatron_zb.training.pretrain import parse_command_line

    local = [re.sub(r"^/.*?-work/", f"{tmp_path}/", a) for a in flags]
    for a in local:
        if a.startswith(str(tmp_path)):
            Path(a).parent.mkdir(parents=True, exist_ok=True)
    local[local.index("--distributed-backend") + 1] = "gloo"
    return parse_command_line(local, world_size=nproc)


def _check_pretrain(argv: list[str], tmp_path: Path) -> list[str]:
    """Validate a pretrain_run command's pretrain_gpt_zb.py flags as the trainer does; return them."""
    own, flags = _split(argv)
    nproc = int(own[own.index("--nproc") + 1])
    out = Path(own[own.index("--out") + 1])
    assert pretrain_run.flag_value(flags, "--loss-log-json") == str(out / "loss.json")
    assert "--mock-data" in flags and "--distributed-backend" in flags  # nothing to download
    assert "--bf16" in flags  # the production precision
    v = _validate(flags, nproc, tmp_path)
    assert v.args.pipeline_model_parallel_size * v.args.tensor_model_parallel_size == nproc
    if pretrain_run.flag_value(flags, "--profile-out") is not None:
        assert v.args.zero_bubble_pipeline_timers_end_iter < v.args.train_iters  # the window ends, then re-plans
    return flags


def _plan(gpus: int, tmp_path: Path, **kw) -> Plan:
    return make_plan(Context(gpus=gpus, work=tmp_path / "w-work", python=sys.executable, cpus=16,
                             have_te=kw.pop("have_te", False)), **kw)


def _keys(plan: Plan) -> list[str]:
    return [p.job.key for s in plan.steps for p in s.placed]


def test_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


# ---------------------------------------------------------------------------- the plan
@pytest.mark.parametrize("gpus", NODES)
def test_dry_run_plan_fits_nine_minutes(gpus, tmp_path):
    """The printed plan: every step's timeout and parallel groups, the critical path within 540 s, and
    with every step's kill grace still below the device's 10-minute command limit; nothing written."""
    res = _dry_run("--gpus", str(gpus), "--out", str(tmp_path / "out"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "out-work").exists(), "a dry run writes nothing"
    m = re.search(r"^planned critical path: (\d+) s = ([\d +]+) \(the steps' timeouts", res.stdout, re.M)
    assert m, res.stdout
    steps = [float(t) for t in re.findall(r"^step \d+ of \d+ \(timeout (\d+) s", res.stdout, re.M)]
    assert float(m.group(1)) == sum(steps) <= BUDGET_S == 540
    plan = _plan(gpus, tmp_path)
    assert plan.critical_s == sum(steps) and plan.worst_s < COMMAND_LIMIT_S
    assert all(60 <= s.timeout_s <= 120 or s.placed[0].job.key in ("env", "hol") for s in plan.steps)
    for step in plan.steps:  # parallel jobs on disjoint GPUs of the node
        ids = [g for p in step.placed for g in p.gpus]
        assert len(ids) == len(set(ids)) and all(0 <= g < gpus for g in ids)
        assert all(p.job.timeout_s <= step.timeout_s for p in step.placed)


@pytest.mark.parametrize("gpus", NODES)
def test_plan_runs_the_steps_in_order_of_what_they_settle(gpus, tmp_path):
    plan = _plan(gpus, tmp_path)
    keys = _keys(plan)
    hb = ["host-bound-before", "host-bound-workers", "host-bound-no-mask"]
    assert keys[:2] == ["env", "hol"] and all(k in keys for k in hb)  # the probe first; host-bound everywhere
    if gpus == 1:
        assert keys == ["env", "hol", *hb]
        reasons = dict((j.key, why) for j, why in plan.skipped)
        assert "Duplicate GPU detected" in reasons["stress-1conn"] and "Duplicate GPU" in reasons["stress-default"]
        return
    assert {"stress-1conn", "stress-default", f"vocab-{VOCAB_FAMILIES[0]}"} <= set(keys)
    order = {k: i for i, s in enumerate(plan.steps) for k in (p.job.key for p in s.placed)}
    assert order["stress-1conn"] <= order["stress-default"] < order["host-bound-before"]
    if gpus >= 4:
        assert {"mem-pp2", "tp2-sp", "mem-tp2-sp-pp2"} <= set(keys)
    else:  # 2 GPUs: listed with the command that runs them
        deferred = {j.key: why for j, why in plan.deferred}
        assert {"mem-pp2", "tp2-sp"} <= set(deferred) and "--steps mem-pp2" in deferred["mem-pp2"]
    stress = [p for s in plan.steps for p in s.placed if p.job.key.startswith("stress")]
    groups = [p.gpus for p in stress]
    assert all(len(g) == (gpus // 2 if gpus >= 4 else 2) for g in groups)
    if gpus >= 4:  # both settings at once, on disjoint GPUs
        assert order["stress-1conn"] == order["stress-default"] and set(groups[0]).isdisjoint(groups[1])


def test_planned_critical_paths_are_the_documented_ones(tmp_path):
    """docs/verification.md quotes these (seconds; and what each node defers)."""
    paths = {n: _plan(n, tmp_path).critical_s for n in NODES}
    assert paths == {1: 220.0, 2: 540.0, 4: 530.0, 8: 450.0}
    deferred = {n: sorted(j.key for j, _ in _plan(n, tmp_path).deferred) for n in NODES}
    assert deferred == {1: [], 2: ["mem-pp2", "tp2-sp", "vocab-interleaved-zb-vocab-1"],
                        4: ["vocab-interleaved-zb-vocab-1"], 8: []}


def test_a_plan_of_named_steps_above_the_budget_is_refused(tmp_path):
    every = [j.key for j, _ in _plan(2, tmp_path).deferred] + _keys(_plan(2, tmp_path))
    res = _dry_run("--gpus", "2", "--steps", ",".join(every))
    assert res.returncode == 2 and "plan refused: its critical path" in res.stderr, res.stderr
    assert "ABOVE the budget of 540 s" in res.stdout
    ok = _dry_run("--gpus", "2", "--steps", "mem-pp2,tp2-sp")
    assert ok.returncode == 0 and "--tensor-model-parallel-size 2 --sequence-parallel" in ok.stdout
    bad = _dry_run("--gpus", "2", "--steps", "nonesuch")
    assert bad.returncode == 2 and "unknown step(s) nonesuch" in bad.stderr


@pytest.mark.parametrize("gpus", NODES)
def test_no_schedule_is_handed_to_a_step_that_refuses_it(gpus, tmp_path):
    """Every schedule the p2p stress would run is accepted by the runtime (the schedule built as the
    stress builds it, get_forward_backward_func, every rank's lowered and checked plan); the
    vocabulary forms go to a vocabulary-parallel pretrain run, validated by the trainer."""
    from megatron_zb.runtime import get_forward_backward_func
    from megatron_zb.schedules.registry import build_schedule, get_spec

    plan = _plan(gpus, tmp_path)
    seen = set()
    for placed in (p for s in plan.steps for p in s.placed):
        argv = list(placed.commands[0].argv)
        if "megatron_zb.testing.p2p_stress" in argv:
            pp = int(argv[argv.index("--pp") + 1])
            assert pp == len(placed.gpus) >= 2
            names = argv[argv.index("--schedules") + 1].split(",")
            assert names == list(AT_RISK_FAMILIES)  # nothing filtered silently
            for name in names:
                assert not get_spec(name).vocab_parallel and p2p_stress.stress_refusal(name) is None
                sched = build_schedule(name, num_ranks=pp, num_microbatches=2 * pp)
                fb = get_forward_backward_func(sched)
                fb.install(pp, 2 * pp)
                for rank in range(pp):
                    fb.plan_for(pp, 2 * pp, rank)
                seen.add(name)
        elif "--enable-vocab-parallel" in argv:
            _, flags = _split(argv[argv.index("megatron_zb.testing.pretrain_run") + 1:])
            assert get_spec(pretrain_run.flag_value(flags, "--schedule")).vocab_parallel
            _validate(flags, len(placed.gpus), tmp_path)
    assert seen == (set(AT_RISK_FAMILIES) if gpus >= 2 else set())
    for name in VOCAB_FAMILIES:  # the stress itself refuses them by name
        assert p2p_stress.stress_refusal(name) and "--enable-vocab-parallel" in p2p_stress.stress_refusal(name)


def test_stress_sends_of_the_plan_are_production_sized():
    size = p2p_stress.StressModel(seq=STRESS_MODEL["seq"], hidden=STRESS_MODEL["hidden"], heads=STRESS_MODEL["heads"],
                                  ffn=STRESS_MODEL["ffn"])
    assert size.send_bytes() >= 64 * 2**20


def _module_help(module: str, cache: dict[str, str]) -> str:
    if module not in cache:
        res = subprocess.run([sys.executable, "-m", module, "--help", "--"], cwd=ROOT, capture_output=True, text=True,
                             timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert res.returncode == 0, res.stderr
        cache[module] = res.stdout
    return cache[module]


@pytest.mark.parametrize("gpus", NODES)
def test_dry_run_prints_commands_that_exist_and_parse(gpus, tmp_path):
    res = _dry_run("--gpus", str(gpus), "--out", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    commands = _commands(res.stdout)
    assert len(commands) >= 6, res.stdout
    helps: dict[str, str] = {}
    pretrains: dict[str, list[str]] = {}
    memory_argvs: list[list[str]] = []
    for command in commands:
        assert subprocess.run(["bash", "-n", "-c", command]).returncode == 0, command
        parsed = _python_argv(command)
        if parsed is None:
            assert shlex.split(command) == ["nvidia-smi", "-L"], f"unexpected command {command!r}"
            continue
        env, argv = parsed
        assert env.get("MEGATRON_ZB_TEST_DEVICE", "cuda") == "cuda"
        if "CUDA_VISIBLE_DEVICES" in env:
            assert all(0 <= int(g) < gpus for g in env["CUDA_VISIBLE_DEVICES"].split(","))
        if argv[0] == "-c":
            compile(argv[1], "<gpu_selftest -c>", "exec")
            continue
        assert argv[0] == "-m" and importlib.util.find_spec(argv[1]) is not None, command
        own = argv[2:] if "--" not in argv else _split(argv[2:])[0]
        helped = _module_help(argv[1], helps)
        assert all(o in helped for o in own if o.startswith("--")), command
        if argv[:2] == ["-m", "megatron_zb.testing.pretrain_run"]:
            pretrains[own[own.index("--label") + 1]] = _check_pretrain(argv[2:], tmp_path)
        elif argv[:2] == ["-m", "megatron_zb.testing.memory_check"]:
            memory_argvs.append(argv[2:])
        elif argv[:2] == ["-m", "megatron_zb.testing.host_bound"]:
            own, common = _split(argv[2:])
            variant = own[own.index("--variant") + 1]
            flags = host_bound.variant_flags(variant, common, tmp_path / variant)
            assert _validate(flags, 1, tmp_path).args.pipeline_model_parallel_size == 1
            pretrains[f"host-bound-{variant}"] = flags
    if gpus >= 2:
        assert any("--enable-vocab-parallel" in f for f in pretrains.values())
    assert {f"host-bound-{v}" for v in host_bound.VARIANTS} <= set(pretrains)
    assert "--no-create-attention-mask-in-dataloader" in pretrains["host-bound-no-mask"]
    assert pretrain_run.flag_value(pretrains["host-bound-workers"], "--num-workers") == "2"
    _check_memory_plans(memory_argvs, pretrains, tmp_path, gpus)


def _check_memory_plans(memory_argvs: list[list[str]], pretrains: dict[str, list[str]], tmp_path: Path,
                        gpus: int) -> None:
    """Each memory check's plan flags describe its run's model and schedule, and megatron-zb plan accepts them."""
    from megatron_zb.cli import main as cli_main

    checked = {}
    for memory_argv in memory_argvs:
        own, plan_flags = _split(memory_argv)
        label = own[own.index("--run") + 1].rsplit("pretrain-", 1)[1]
        schedule = own[own.index("--schedule") + 1]
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
    both = {"zb-h1-memory", "zb-h1-tp2-sp-memory"}
    expected = {1: set(), 2: set(), 4: both, 8: both}
    assert set(checked) == expected[gpus]
    if "zb-h1-tp2-sp-memory" in checked:
        assert "--sequence-parallel" in checked["zb-h1-tp2-sp-memory"]
        assert pretrain_run.flag_value(checked["zb-h1-tp2-sp-memory"], "--tensor-model-parallel-size") == "2"


def test_full_plan_adds_the_opt_in_jobs_with_their_own_timeouts(tmp_path):
    """--full: the numerical suite, the profiled PP=2 runs, the TP=2 x PP=2 tests, TE parity (where TE
    is installed) and the benchmark, after the 9-minute plan; their pytest commands select tests."""
    plan = _plan(8, tmp_path, full=True, budget_s=3600.0, have_te=True)
    keys = _keys(plan)
    assert keys[:len(_keys(_plan(8, tmp_path)))] != [] and {"numeric", "pretrain-zb", "pretrain-zb-2p", "pretrain-zbv",
                                                          "tp2-pp2-tests", "te-parity", "bench"} <= set(keys)
    assert not plan.over_budget and plan.critical_s > BUDGET_S
    selections = []  # (test files, -k word or "") of each pytest job: collected together below (one start-up)
    for placed in (p for s in plan.steps for p in s.placed if p.job.full):
        argv = list(placed.commands[0].argv)
        if argv[1:3] == ["-m", "pytest"]:
            files = [a for a in argv[3:] if a.startswith("tests/")]
            assert files and all((ROOT / a).is_file() for a in files), argv
            word = argv[argv.index("-k") + 1] if "-k" in argv else ""
            assert word.isidentifier() or not word, word  # a plain word: selected by substring below, as pytest's -k
            selections.append((files, word))
        elif "megatron_zb.testing.pretrain_run" in argv:
            flags = _check_pretrain(argv[argv.index("megatron_zb.testing.pretrain_run") + 1:], tmp_path)
            assert pretrain_run.flag_value(flags, "--profile-out")
    files = sorted({f for fs, _ in selections for f in fs})
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                               cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                               timeout=300)
    ids = [ln for ln in collected.stdout.splitlines() if "::test_" in ln]
    assert collected.returncode in (0, 5) and ids, collected.stdout[-2000:]
    for fs, word in selections:  # every job selects tests of each of its files
        for f in fs:
            assert any(i.startswith(f + "::") and word.lower() in i.lower() for i in ids), (f, word)
    res = _dry_run("--gpus", "8")
    assert res.returncode == 0 and "opt-in (--full): [numeric]" in res.stdout


def test_without_gpu_and_without_dry_run_it_refuses():
    res = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert res.returncode == 2 and "no CUDA device visible" in res.stderr


# ---------------------------------------------------------------------------- the runner
def _stub_job(key: str, code: str, timeout: float) -> Placed:
    job = Job(key, f"stub {key}", 0, timeout, lambda ctx, ids: [])
    return Placed(job, (), [Command((sys.executable, "-c", code))])


def test_runner_writes_each_result_as_it_ends_and_names_the_failed_step(tmp_path):
    """A passing job, a failing one and one past its timeout in step 1; step 2 reads summary.txt while
    it runs: step 1's three lines are already there. The failures name their step and job."""
    out, work = tmp_path / "out", tmp_path / "work"
    step1 = Step([_stub_job("a", "print('a is fine')", 30),
                  _stub_job("b", "import sys; print('b broke'); sys.exit(3)", 30),
                  _stub_job("c", "import time; print('c waits', flush=True); time.sleep(600)", 2)])
    step2 = Step([_stub_job("d", f"print(open({str(out / 'summary.txt')!r}).read())", 30)])
    plan = Plan(2, 540.0, [step1, step2], [], [], [])
    assert run_plan(plan, out, work, head=["# stub"]) == 1
    summary = (out / "summary.txt").read_text().splitlines()
    assert summary[0] == "# stub"
    lines = {ln.split("[", 1)[1].split("]")[0]: ln for ln in summary if "] stub " in ln}
    assert lines["a"].startswith("PASS     step 1 [a]") and lines["a"].endswith("a is fine")
    assert lines["b"].startswith("FAIL     step 1 [b]") and lines["b"].endswith("exit 3: b broke")
    assert lines["c"].startswith("FAIL     step 1 [c]")
    assert "timed out after 2 s (killed); last output: c waits" in lines["c"]
    assert lines["d"].startswith("PASS     step 2 [d]")
    seen_by_d = (work / "d.log").read_text()
    assert all(lines[k] in seen_by_d for k in "abc")  # written before step 2 started
    assert summary[-1] == "result: 2 passed, 2 failed, 0 skipped, 0 deferred; exit 1"
    with tarfile.open(out / "logs.tar.gz") as t:
        assert {"work/a.log", "work/d.log"} <= set(t.getnames())
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "summary.txt"]  # two files come back


STOP_SCRIPT = """
import sys
from pathlib import Path
from megatron_zb.testing.selftest import run_plan
from megatron_zb.testing.selftest_jobs import Command, Job
from megatron_zb.testing.selftest_plan import Placed, Plan, Step
tmp = Path(sys.argv[1])
code = "import os, time; open({pid!r}, 'w').write(str(os.getpid())); print('sleeping', flush=True); time.sleep(600)"
job = Job("sleeper", "stub sleeper", 0, 300.0, lambda ctx, ids: [])
step = Step([Placed(job, (), [Command((sys.executable, "-c", code.format(pid=str(tmp / "pid"))))])])
sys.exit(run_plan(Plan(1, 540.0, [step], [], [], []), tmp / "out", tmp / "work"))
"""


def test_a_stopped_run_kills_its_jobs_and_says_so(tmp_path):
    """SIGTERM to the runner (the device's command limit): the running job's processes are killed,
    STOPPED and the result line are written, the logs packed, exit 1."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-c", STOP_SCRIPT, str(tmp_path)], cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE, text=True)
    pid_file = tmp_path / "pid"
    for _ in range(300):
        if pid_file.is_file() and pid_file.read_text():
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 1
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "STOPPED  the self-test received SIGTERM; the running jobs were killed" in summary
    assert summary.strip().splitlines()[-1].endswith("exit 1")
    time.sleep(0.5)
    stat_file = Path(f"/proc/{pid_file.read_text()}/stat")
    assert not stat_file.exists() or stat_file.read_text().split(")")[1].split()[0] == "Z"  # gone (or a zombie)
    assert (tmp_path / "out" / "logs.tar.gz").is_file()


def test_script_with_a_stub_interpreter_lists_every_job_with_its_reason(tmp_path):
    """The script end to end on the plan of a 2-GPU node, the jobs' interpreter a stub (and no
    nvidia-smi on PATH): PASS / FAIL / SKIPPED / DEFERRED lines, exit 1."""
    stub = tmp_path / "python"
    stub.write_text("#!/usr/bin/env bash\n"
                    "case \"$*\" in\n"
                    "  *p2p_stress*) echo 'p2p stress: FAIL: zb-2p (deadlock or hang)'; exit 1 ;;\n"
                    "  *) echo \"stub ran: ${*: -1}\" ;;\n"
                    "esac\n")
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHON=sys.executable, PATH="/usr/bin:/bin")
    res = subprocess.run(["bash", str(SCRIPT), "--gpus", "2", "--steps", "env,stress-1conn,host-bound-before",
                          "--python", str(stub), "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    summary = (out / "summary.txt").read_text()
    lines = summary.splitlines()
    assert any(ln.startswith("FAIL     step 1 [env]") and "cannot start nvidia-smi" in ln for ln in lines), summary
    assert any(ln.startswith("FAIL     step 1 [stress-1conn]") and ln.endswith("p2p stress: FAIL: zb-2p (deadlock "
                                                                              "or hang)") for ln in lines), summary
    assert any(ln.startswith("PASS     step 2 [host-bound-before]") and "(GPU 0; " in ln and "stub ran: " in ln
               for ln in lines), summary
    assert ">> step 1/2 start" in res.stdout and "<< step 2/2 end after" in res.stdout
    assert (Path(f"{out}-work") / "stress-1conn.log").is_file()
    plain = subprocess.run(["bash", str(SCRIPT), "--gpus", "1", "--python", str(stub), "--out", str(tmp_path / "o1"),
                            "--steps", "hol,stress-1conn"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=120)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert "SKIPPED  [stress-1conn]" in (tmp_path / "o1" / "summary.txt").read_text()


# ---------------------------------------------------------------------------- benchmark
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


def test_p2p_stress_refuses_schedules_the_runtime_refuses(capsys):
    """A vocabulary-parallel form named to the stress: exit 2 with the runtime's own refusal; the default
    list holds no such form."""
    assert p2p_stress.main(["--pp", "2", "--schedules", "1f1b,zbv-vocab-1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("p2p stress: cannot run zbv-vocab-1: schedule 'zbv-vocab-1' holds vocabulary-parallel passes")
    assert not any(get_spec(n).vocab_parallel for n in p2p_stress.stress_schedule_names())
    assert set(AT_RISK_FAMILIES) <= set(p2p_stress.stress_schedule_names())


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

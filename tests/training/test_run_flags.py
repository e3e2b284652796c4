"""Megatron-LM's loading, exit, logging, profiling and memory flags in ``pretrain_gpt_zb.py`` runs:
``--log-params-norm``, ``--log-num-zeros-in-grad``, ``--manual-gc*``, ``--empty-unused-memory-level``,
``--profile`` with PyTorch's profiler and megatron-zb's timeline of the window, ``--no-load-optim``, ``--no-load-rng``, ``--finetune`` and
``--exit-duration-in-mins``.

Six runs of the trainer (what ``pretrain_gpt_zb.py`` runs) in-process on 2 ranks of
``run_distributed`` (PP=2, 4 layers, Megatron-LM's default dropout 0.1), sharing one checkpoint:

  ``zb``      greedy zero bubble with every logging / GC / profiling flag, stopped at 3 (saves 3), with
              exact optimizer post-validation (eager steps after 1 warm-up step, also after a
              clipped one: the line's values are the validated ones);
  ``mcore``   megatron-core's 1F1B, 5 iterations, the same logging flags -- the reference;
  ``no_optim`` ``zb``'s checkpoint resumed with ``--no-load-optim`` (iterations 4-5);
  ``no_rng``  the same with ``--no-load-rng``;
  ``finetune`` the same with ``--finetune --exit-duration-in-mins 0.0001`` (exits after its first iteration);
  ``bf16_distopt`` DP=2 (PP=1), bf16, the distributed optimizer, ``--log-params-norm``, 1 iteration.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

SMALL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "2e-3", "--lr-warmup-iters", "2",
         "--mock-data", "--num-workers", "0", "--eval-iters", "0", "--log-interval", "1", "--train-iters", "5",
         "--distributed-backend", "gloo", "--pipeline-timeout-seconds", "60", "--distributed-timeout-minutes", "2",
         "--pipeline-model-parallel-size", "2", "--zero-bubble-pipeline-timers-start-iter", "8",
         "--zero-bubble-pipeline-timers-end-iter", "9", "--untie-embeddings-and-output-weights"]
"""PP=2, 4 micro batches, dropout 0.1 (Megatron-LM's default); the re-planning window after the last
iteration (these tests are about the flags, not profiling-then-re-planning); untied embeddings, so
that the input embedding's rows of tokens no batch holds get zero gradients (num zeros > 0)."""
LOGGED = ["--log-params-norm", "--log-num-zeros-in-grad", "--eval-interval", "2", "--eval-iters", "1"]
"""The logging flags of both first runs, with a validation batch after iteration 2 (--manual-gc's
collections around it)."""
TIMEOUT = 240


def _rank(argv: list[str], json_path: str) -> dict:
    """One rank of the trainer on ``argv``: its log, exit status and what the housekeeping did."""
    import contextlib
    import gc
    import io

    import torch.distributed as dist

    from megatron_zb.training.pretrain import parse_command_line
    from megatron_zb.training.trainer import Trainer

    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        validated = parse_command_line(argv + ["--loss-log-json", json_path], world_size=dist.get_world_size())
        print("\n".join(validated.notices))
        trainer = Trainer(validated.args, schedule=validated.schedule)
        try:
            status = trainer.run()
            gc_during = gc.isenabled()
            collections = trainer.hooks.memory.collections
            backend = trainer.hooks.profile.backend
            traces = list(getattr(backend, "written", []))
            eager = trainer.optimizer.counters().eager_steps if trainer.optim.post_validation else None
        finally:
            trainer.close()
    return {"log": log.getvalue(), "status": status, "gc_during": gc_during, "gc_after": gc.isenabled(),
            "collections": collections, "traces": traces, "eager_steps": eager}


def _run(root: Path, name: str, argv: list[str]) -> dict:
    from megatron_zb.testing import run_distributed

    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    ranks = run_distributed(_rank, world_size=2, args=(argv, str(d / "values.json")), timeout=TIMEOUT)
    return {"ranks": ranks, "log": "".join(r["log"] for r in ranks),
            "train": json.loads((d / "values.json").read_text())["train"]}


class Runs:
    """Each run starts once, on first use."""

    def __init__(self, root: Path) -> None:
        self.root, self.done = root, {}
        self.ckpt, self.tb = root / "ckpt", root / "tb"

    def get(self, name: str) -> dict:
        if name not in self.done:
            if name in ("no_optim", "no_rng", "finetune"):
                self.get("zb")  # the checkpoint
            flags = {
                "zb": ["--enable-zero-bubble", *LOGGED, "--enable-optimizer-post-validation",
                       "--enable-exactly-numeric-match", "--post-validation-warmup-iters", "1",
                       "--post-validation-fallback-clean-iters", "0", "--manual-gc", "--manual-gc-interval", "2",
                       "--empty-unused-memory-level", "1", "--profile", "--profile-step-start", "2",
                       "--profile-step-end", "3", "--use-pytorch-profiler", "--tensorboard-dir", str(self.tb),
                       "--save", str(self.ckpt), "--exit-interval", "3"],
                "mcore": ["--use-megatron-core-schedule", *LOGGED],
                "no_optim": ["--enable-zero-bubble", "--load", str(self.ckpt), "--no-load-optim"],
                "no_rng": ["--enable-zero-bubble", "--load", str(self.ckpt), "--no-load-rng"],
                "finetune": ["--enable-zero-bubble", "--load", str(self.ckpt), "--finetune", "--exit-duration-in-mins",
                             "0.0001", "--save", str(self.root / "ckpt_ft")],
                "bf16_distopt": ["--pipeline-model-parallel-size", "1", "--bf16", "--use-distributed-optimizer",
                                 "--log-params-norm", "--train-iters", "1", "--lr-warmup-iters", "0",
                                 "--save", str(self.root / "ckpt_bf16")],
            }[name]
            self.done[name] = _run(self.root, name, SMALL + flags)
        return self.done[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("runflags"))


def _by_iteration(run: dict, key: str) -> dict[int, object]:
    return {r["iteration"]: r[key] for r in run["train"] if key in r}


def _checkpoint_params_norm(path: Path) -> float:
    """The L2 norm of every model tensor a checkpoint holds (each parameter once: tied output weights
    and tensor-parallel copies are not stored twice), summed in float64 by this test. torch's
    ``dcp_to_torch_save`` reads megatron-core's torch_dist directory into one state dict."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = path.parent / (path.name + ".pt")
    dcp_to_torch_save(str(path), str(flat))
    state = torch.load(flat, weights_only=False)
    total = 0.0
    for key, value in state.items():  # model tensors under their own names; the optimizer's under "optimizer."
        if torch.is_tensor(value) and value.is_floating_point() and not key.startswith("optimizer."):
            total += float((value.double() ** 2).sum())
    return math.sqrt(total)


def test_logged_norms_and_zeros_equal_megatron_core_and_the_checkpoint(runs):
    """params norm and num zeros of the zero-bubble run (post-validated eager steps at 2 and 3) are
    megatron-core 1F1B's, value for value; the params norm after iteration 3 is the norm of the
    checkpoint saved there; the line has both."""
    zb, mcore = runs.get("zb"), runs.get("mcore")
    assert sorted(_by_iteration(zb, "lm loss")) == [1, 2, 3]
    for key in ("lm loss", "params norm", "num zeros", "grad norm"):
        got, want = _by_iteration(zb, key), _by_iteration(mcore, key)
        assert set(got) == {1, 2, 3}, (key, got)
        assert got == {it: want[it] for it in got}, key
    # At least the embedding rows of the vocabulary's padding (258 byte-level ids padded to 384) have
    # zero gradients: no input token selects them; at most every element of the input embedding.
    for it, zeros in _by_iteration(zb, "num zeros").items():
        assert zeros == int(zeros) and (384 - 258) * 32 <= zeros <= 384 * 32, (it, zeros)
    norms = _by_iteration(zb, "params norm")
    assert norms[3] == pytest.approx(_checkpoint_params_norm(runs.ckpt / "iter_0000003"), rel=1e-6)
    assert norms[1] != norms[2] != norms[3]  # the parameters move
    line = next(ln for ln in zb["log"].splitlines() if re.search(r"\] iteration\s+3/", ln))
    from megatron_zb.training.logging_utils import parse_iteration_line

    rec = parse_iteration_line(line)
    assert rec["params norm"] == pytest.approx(norms[3], abs=5e-4)
    assert rec["num zeros"] == _by_iteration(zb, "num zeros")[3]
    assert line.index("grad norm:") < line.index("num zeros:") < line.index("params norm:")  # Megatron-LM's order
    assert [r["eager_steps"] for r in zb["ranks"]] == [2, 2]  # iterations 2 and 3 stepped eagerly


def test_params_norm_of_sharded_bf16_main_params(runs):
    """bf16 with the distributed optimizer: the norm is over the fp32 main parameters, each DP rank's
    shard summed over the data-parallel group; the checkpoint holds the bf16 parameters, which
    differ from them by bf16's rounding (2^-9 relative at most per element). Half the shards alone
    would give 1/sqrt(2) of it."""
    run = runs.get("bf16_distopt")
    norms = _by_iteration(run, "params norm")
    assert sorted(norms) == [1]
    assert norms[1] == pytest.approx(_checkpoint_params_norm(runs.root / "ckpt_bf16" / "iter_0000001"), rel=2.0 ** -9)


def test_manual_gc_and_pytorch_profiler_trace(runs):
    """--manual-gc: the collector is off during the run and back on after it; collections at the start,
    before and after the evaluation of iteration 2 and after iteration 2 (--manual-gc-interval 2; the
    run stops at 3). --profile on rank 0 only:
    one Chrome trace naming iteration 2 (ProfilerStep#2), not 1 or 3. --empty-unused-memory-level on
    CPU: a start-up line says it is a no-op."""
    zb = runs.get("zb")
    r0, r1 = zb["ranks"]
    for r in (r0, r1):
        assert (r["gc_during"], r["gc_after"], r["collections"]) == (False, True, 4), r
    assert r1["traces"] == [] and len(r0["traces"]) == 1
    [trace] = r0["traces"]
    assert Path(trace).parent == runs.tb and Path(trace).name.startswith("rank0.") and trace.endswith(".pt.trace.json")
    assert f"> rank 0: PyTorch profiler trace of iterations 2-2 written to {trace}" in zb["log"]
    events = json.loads(Path(trace).read_text())["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2"}, steps
    assert any(e.get("name") == "aten::mm" for e in events)  # the iteration's work is in it
    assert "--empty-unused-memory-level 1: no CUDA device" in zb["log"] and "a no-op here" in zb["log"]


def test_profile_window_timeline_chrome_trace_and_png(runs):
    """megatron-zb's own view of the --profile window (iteration 2): a Chrome trace with one complete
    event per executed action per pipeline rank -- ZB on PP=2, m=4: each rank F, B and W of micro
    batches 0-3 once; rank 0 sends 4 activations and receives 4 gradients, rank 1 the reverse --
    compute events of a rank never overlapping; and a PNG of the measured iteration beside the
    prediction, in the op colours."""
    import matplotlib.image as mpimg
    import numpy as np

    from megatron_zb.schedules.plot import OP_COLORS, shade

    zb = runs.get("zb")
    doc = json.loads((runs.tb / "megatron_zb_timeline.json").read_text())
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert names[(0, 0)] == names[(1, 0)] == "compute (F/B/W)"
    for e in events:
        assert {"ph", "ts", "dur", "pid", "tid", "name"} <= set(e) and e["ts"] >= 0 and e["dur"] >= 0, e
        assert e["args"]["iteration"] == 2
    comm = {0: {"SEND_F": 4, "RECV_B": 4}, 1: {"RECV_F": 4, "SEND_B": 4}}
    for rank in (0, 1):
        compute = sorted((e for e in events if e["pid"] == rank and e["cat"] == "compute"), key=lambda e: e["ts"])
        assert sorted(e["name"] for e in compute) == sorted(f"{op}{mb}" for op in "FBW" for mb in range(4))
        assert all(e["tid"] == 0 and e["args"]["stage"] == rank for e in compute)
        for a, b in zip(compute, compute[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 0.01, (a, b)  # one action at a time [us, rounding]
        ops: dict[str, int] = {}
        for e in events:
            if e["pid"] == rank and e["cat"] == "comm":
                assert e["tid"] == 1
                op = e["name"].rstrip("0123456789")
                ops[op] = ops.get(op, 0) + 1
        assert ops == comm[rank], (rank, ops)
    png = runs.tb / "megatron_zb_timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    img = mpimg.imread(png)
    for op in "FBW":
        rgb = np.asarray(shade(OP_COLORS[op], 0, 1))
        assert int(np.all(np.abs(img[..., :3] - rgb) < 1.5 / 255, axis=-1).sum()) >= 50, op
    assert (f"> --profile: megatron-zb's timeline of iterations 2-2 (each rank's measured actions and waits) "
            f"written to {runs.tb / 'megatron_zb_timeline.json'}") in zb["log"]


def test_no_load_optim_restores_model_and_rng_but_not_optimizer_or_scheduler(runs):
    """Iteration 4's loss (computed before its step: model, data position and dropout streams) equals
    the uninterrupted run's bit for bit; its learning rate is a fresh scheduler's first (the
    uninterrupted run's iteration 1); iteration 5 then differs (fresh Adam moments)."""
    got, ref = runs.get("no_optim"), runs.get("mcore")
    loss, lr = _by_iteration(got, "lm loss"), _by_iteration(got, "learning rate")
    ref_loss, ref_lr = _by_iteration(ref, "lm loss"), _by_iteration(ref, "learning rate")
    assert sorted(loss) == [4, 5]
    assert loss[4] == ref_loss[4] and loss[5] != ref_loss[5]
    assert lr[4] == ref_lr[1] != ref_lr[4]
    assert ("--no-load-optim: not restored from the checkpoint: optimizer state and learning-rate scheduler"
            in got["log"])


def test_no_load_rng_restores_model_optimizer_and_scheduler_but_not_the_random_streams(runs):
    """Iteration 4's learning rate is the uninterrupted run's (scheduler restored); its loss is not
    (dropout draws from the fresh --seed streams, not the saved ones)."""
    got, ref = runs.get("no_rng"), runs.get("mcore")
    assert sorted(_by_iteration(got, "lm loss")) == [4, 5]
    assert _by_iteration(got, "learning rate") == {it: _by_iteration(ref, "learning rate")[it] for it in (4, 5)}
    assert _by_iteration(got, "lm loss")[4] != _by_iteration(ref, "lm loss")[4]
    assert "--no-load-rng: not restored from the checkpoint: random states" in got["log"]


def test_finetune_starts_at_iteration_0_and_exit_duration_saves_and_exits_0(runs):
    """--finetune: the model only, iteration 1 again (a fresh scheduler's learning rate, the first
    samples); its loss is lower than the untrained model's there (the trained weights were loaded).
    --exit-duration-in-mins 0.0001: exit status 0 after iteration 1, a checkpoint of iteration 1."""
    got, ref = runs.get("finetune"), runs.get("mcore")
    assert [r["status"] for r in got["ranks"]] == [0, 0]
    assert sorted(_by_iteration(got, "lm loss")) == [1]
    assert _by_iteration(got, "learning rate")[1] == _by_iteration(ref, "learning rate")[1]
    assert _by_iteration(got, "lm loss")[1] < _by_iteration(ref, "lm loss")[1]
    assert re.search(r"> exiting program at iteration 1 after [\d.]+ minutes \(--exit-duration-in-mins 0\.0001\)",
                     got["log"]), got["log"][-2000:]
    assert (runs.root / "ckpt_ft" / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert "starting at iteration 0 with no consumed samples (--finetune)" in got["log"]


# ---------------------------------------------------------------------------- without processes
class Recorder:
    """Stands in for a profiler backend: CUDA's capture range cannot run without a GPU; it records
    the calls :class:`ProfileWindow` (the code both backends share) makes."""

    def __init__(self, continuous: bool) -> None:
        self.continuous, self.calls = continuous, []

    def start(self, completed: int) -> None:
        self.calls.append(("start", completed))

    def step(self) -> None:
        self.calls.append("step")

    def stop(self) -> None:
        self.calls.append("stop")


def _drive(window, first: int, last: int) -> list:
    """Run iterations ``first..last`` (1-based) through ``window``; the calls per iteration."""
    backend = window.backend
    window.start(first - 1)
    seen = [("before run", list(backend.calls))]
    for it in range(first, last + 1):
        backend.calls.clear()
        window.before_iteration(it)
        window.after_iteration(it)
        seen.append((it, list(backend.calls)))
    backend.calls.clear()
    window.close()
    seen.append(("close", list(backend.calls)))
    return seen


def test_profile_window_capture_range_and_pytorch_profiler_as_megatron_lm():
    """CUDA's capture range: started before iteration start+1, stopped after iteration end (Megatron-LM's
    ``iteration == profile_step_start`` with 0-based completed iterations). PyTorch's profiler: started
    before the run, stepped every iteration (its schedule picks the window), stopped after iteration
    end; a run resumed at 3 starts it with the offset. Closing stops a window the run did not finish."""
    import torch

    from megatron_zb.training.profile_window import CudaCaptureRange, ProfileWindow, TorchProfiler, profile_window
    from megatron_zb.training.run_config import ProfilingConfig

    cfg = ProfilingConfig(profile=True, profile_step_start=2, profile_step_end=4, profile_ranks=(0, 1), trace_dir="t")
    assert _drive(ProfileWindow(cfg, Recorder(continuous=False)), 1, 5) == [
        ("before run", []), (1, []), (2, []), (3, [("start", 2)]), (4, ["stop"]), (5, []), ("close", [])]
    assert _drive(ProfileWindow(cfg, Recorder(continuous=True)), 1, 5) == [
        ("before run", [("start", 0)]), (1, ["step"]), (2, ["step"]), (3, ["step"]), (4, ["step", "stop"]), (5, []),
        ("close", [])]
    assert _drive(ProfileWindow(cfg, Recorder(continuous=True)), 4, 5)[0] == ("before run", [("start", 3)])
    assert _drive(ProfileWindow(cfg, Recorder(continuous=True)), 5, 6)[0] == ("before run", [])  # window passed
    assert _drive(ProfileWindow(cfg, Recorder(continuous=False)), 1, 3)[-1] == ("close", ["stop"])  # ended inside
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert isinstance(profile_window(cfg, rank=1, device=cuda).backend, CudaCaptureRange)
    cpu_backend = profile_window(cfg, rank=1, device=cpu).backend
    assert isinstance(cpu_backend, TorchProfiler) and not cpu_backend.with_stack  # no stacks: traces of MB, not GB
    pytorch = ProfilingConfig(profile=True, use_pytorch_profiler=True, profile_ranks=(0,), trace_dir="t")
    megatron_settings = profile_window(pytorch, rank=0, device=cuda).backend
    assert isinstance(megatron_settings, TorchProfiler) and megatron_settings.with_stack
    assert profile_window(pytorch, rank=1, device=cpu).backend is None
    assert profile_window(ProfilingConfig(), rank=0, device=cpu).backend is None


def test_pytorch_profiler_window_of_a_resumed_run_is_on_global_iterations(tmp_path):
    """Resumed after iteration 3 with the window 4-5 (--profile-step-start 4 --profile-step-end 6): the
    trace holds this run's first two iterations (global 4 and 5), not the third (6)."""
    import torch

    from megatron_zb.training.profile_window import profile_window
    from megatron_zb.training.run_config import ProfilingConfig

    cfg = ProfilingConfig(profile=True, profile_step_start=4, profile_step_end=6, trace_dir=str(tmp_path))
    window = profile_window(cfg, rank=0, device=torch.device("cpu"))
    window.start(3)
    for it in (4, 5, 6):
        window.before_iteration(it)
        torch.ones(8, 8) @ torch.ones(8, 8)
        window.after_iteration(it)
    window.close()
    [trace] = window.backend.written
    steps = sorted(e["name"] for e in json.loads(Path(trace).read_text())["traceEvents"]
                   if e.get("name", "").startswith("ProfilerStep#"))
    assert steps == ["ProfilerStep#1", "ProfilerStep#2"]


BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--train-iters 20 --lr 1e-4 --mock-data")


def _validate(extra: str, world_size: int = 2):
    import shlex

    from megatron_zb.training.pretrain import parse_command_line

    return parse_command_line(shlex.split(BASE + " " + extra), world_size=world_size)


def test_refusals_name_the_flag_and_the_fix_all_in_one_report():
    from megatron_zb.training.arguments import ArgumentError

    with pytest.raises(ArgumentError) as e:
        _validate("--profile --profile-step-start 3 --profile-step-end 3 --manual-gc-interval -1 "
                  "--exit-duration-in-mins -2")
    assert [p.flag for p in e.value.problems] == ["--exit-duration-in-mins", "--profile-step-end",
                                                 "--manual-gc-interval"]
    for extra, flag, fix in [
        ("--profile --profile-step-start 20 --profile-step-end 22 --tensorboard-dir t", "--profile-step-start",
         "give a smaller value"),
        ("--profile --profile-ranks 0 2 --tensorboard-dir t", "--profile-ranks", "[2] not among the job's ranks 0-1"),
        ("--profile", "--profile", "add --tensorboard-dir DIR"),
        ("--profile --use-pytorch-profiler", "--use-pytorch-profiler", "add --tensorboard-dir DIR"),
    ]:
        with pytest.raises(ArgumentError) as e:
            _validate(extra)
        assert e.value.flag == flag and fix in str(e.value), str(e.value)


def test_flags_without_their_switch_or_device_are_accepted_with_a_start_up_line():
    """As in Megatron-LM they do nothing there; a start-up line says so (never silently)."""
    import torch

    notices = "\n".join(_validate("--profile-step-start 2 --profile-ranks 1 --manual-gc-interval 3 "
                                  "--no-manual-gc-eval --no-load-optim --finetune --log-memory-to-tensorboard").notices)
    assert "WARNING: --profile-step-start, --profile-ranks without --profile: no effect" in notices
    assert "WARNING: --manual-gc-interval, --no-manual-gc-eval without --manual-gc: no effect" in notices
    assert "WARNING: --no-load-optim, --finetune without --load: nothing is loaded, no effect" in notices
    if not torch.cuda.is_available():
        assert "WARNING: --log-memory-to-tensorboard: no CUDA device" in notices
        assert "PyTorch's profiler is used" in "\n".join(_validate("--profile --profile-step-start 2 "
                                                                    "--tensorboard-dir t").notices)


def test_exit_duration_takes_megatron_lm_s_whole_minutes_and_fractions():
    args = _validate("--exit-duration-in-mins 5").args
    assert args.exit_duration_in_mins == 5 and isinstance(args.exit_duration_in_mins, int)
    assert _validate("--exit-duration-in-mins 0.25").args.exit_duration_in_mins == 0.25
    from megatron_zb.training.run_config import run_config

    assert run_config(_validate("--exit-duration-in-mins 0").args).checkpoint.exit_duration_in_mins is None  # off


def test_memory_scalars_are_megatron_lm_s_four():
    from megatron_zb.training.training_log import cuda_memory_scalars

    stats = {"reserved_bytes.all.current": 4096, "allocated_bytes.all.current": 1024,
             "allocated_bytes.all.peak": 2048, "allocation.all.current": 3, "other": 1}
    assert cuda_memory_scalars(stats) == {"mem-reserved-bytes": 4096, "mem-allocated-bytes": 1024,
                                          "mem-max-allocated-bytes": 2048, "mem-allocated-count": 3}


def test_timeline_window_follows_the_backend_and_says_when_it_is_not_written(capsys):
    """megatron-zb's timeline covers the iterations the --profile backend records: PyTorch's profiler
    START..END-1 (always on CPU), CUDA's capture range START+1..END; with megatron-core's schedule
    (no per-action timing) or without --tensorboard-dir a start-up line says it is not written."""
    import torch

    from megatron_zb.training.measured_timeline import MeasuredTimeline, window_iterations
    from megatron_zb.training.run_config import ProfilingConfig

    cfg = ProfilingConfig(profile=True, profile_step_start=4, profile_step_end=6, trace_dir="t")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert list(window_iterations(cfg, device=cpu)) == [4, 5]
    assert list(window_iterations(cfg, device=cuda)) == [5, 6]
    pytorch = ProfilingConfig(profile=True, profile_step_start=4, profile_step_end=6, use_pytorch_profiler=True)
    assert list(window_iterations(pytorch, device=cuda)) == [4, 5]
    for config, why in ((cfg, "--use-megatron-core-schedule: megatron-core's schedules do not time each action"),
                        (pytorch, "no --tensorboard-dir to write it into")):
        runtime = None if config is cfg else object()
        timeline = MeasuredTimeline(config, runtime=runtime, device=cpu, pp_group=None, train_iters=10)
        assert list(timeline.iterations) == []
        assert f"> --profile: megatron-zb's timeline of the window is not written ({why})" in capsys.readouterr().out


def test_measured_iteration_as_a_sim_result_and_chrome_trace():
    """Fabricated events of 1F1B on 2 ranks, m=1 (times in s): the measured SimResult puts each action at
    its own start/end in ms from the earliest action; the trace has one "X" event per action, in us."""
    from megatron_zb.schedules import CostModel
    from megatron_zb.schedules.generators.baselines import one_f_one_b
    from megatron_zb.training.measured_timeline import chrome_trace, measured_result

    sched = one_f_one_b(num_ranks=2, num_microbatches=1)
    per_rank = [[(7, "compute", "F", 0, 0, 10.000, 10.002), (7, "comm", "SEND_F", 0, 0, 10.002, 10.0021),
                 (7, "compute", "BW", 0, 0, 10.010, 10.014)],
                [(7, "compute", "F", 0, 1, 10.003, 10.005), (7, "compute", "BW", 0, 1, 10.005, 10.009)]]
    res = measured_result(sched, per_rank, 7, CostModel())
    assert [[round(x, 6) for x in row] for row in res.start] == [[0.0, 10.0], [3.0, 5.0]]
    assert [[round(x, 6) for x in row] for row in res.end] == [[2.0, 14.0], [5.0, 9.0]]
    assert res.total_time == pytest.approx(14.0) and res.busy == pytest.approx([6.0, 6.0])
    doc = chrome_trace(per_rank, origin=10.0, metadata={"m": 1})
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert [(e["pid"], e["tid"], e["name"], e["ts"], e["dur"]) for e in xs] == [
        (0, 0, "F0", 0.0, 2000.0), (0, 1, "SEND_F0", 2000.0, 100.0), (0, 0, "BW0", 10000.0, 4000.0),
        (1, 0, "F0", 3000.0, 2000.0), (1, 0, "BW0", 5000.0, 4000.0)]
    assert doc["otherData"] == {"m": 1}

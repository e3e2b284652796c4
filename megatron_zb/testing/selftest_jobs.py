"""The GPU self-test's jobs: what each runs, on how many GPUs, within how many seconds, in which order.

One place for every rule the plan, the dry run and the tests read: the 9-minute budget, the
schedule families the p2p stress runs, the vocabulary families, each job's timeout and its commands.
:func:`jobs` lists them most informative first; :mod:`megatron_zb.testing.selftest_plan` packs them
into steps on a node of 1 to 8 GPUs. A job's commands run one after the other; a job passes when
each exits 0. No torch here (the plan is made and tested on any machine).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from . import hol_probe
from .host_bound import VARIANTS

__all__ = ["AT_RISK_FAMILIES", "BUDGET_S", "COMMAND_LIMIT_S", "Command", "Context", "FULL_BUDGET_S", "Job",
           "KILL_GRACE_S",
           "STRESS_MODEL", "VOCAB_FAMILIES", "jobs"]

BUDGET_S = 540.0
"""The plan's critical path may not exceed 9 minutes (the device's command limit is 10)."""
COMMAND_LIMIT_S = 600.0
"""The device's limit for one command: the plan's worst case (critical path + kill graces) stays below it."""
FULL_BUDGET_S = 3600.0
"""The budget with ``--full`` (every job, for a machine without the 10-minute limit)."""
KILL_GRACE_S = 3.0
"""Seconds a job's processes get between SIGTERM and SIGKILL once its timeout passed."""
AT_RISK_FAMILIES: tuple[str, ...] = ("1f1b", "interleaved-zb", "v-half", "zbv", "zb-2p", "1f1b-v")
"""The p2p stress's schedules: 1f1b (the control), then the families the NCCL model found most at risk."""
VOCAB_FAMILIES: tuple[str, ...] = ("zbv-vocab-1", "interleaved-zb-vocab-1")
"""Vocabulary-parallel forms run by ``pretrain_gpt_zb.py --enable-vocab-parallel`` at PP=2 (the stress cannot)."""
STRESS_MODEL: dict[str, int] = {"seq": 8192, "hidden": 4096, "heads": 4, "ffn": 4096}
"""The stress's GPT: 8192 x 4096 bf16 = 64 MiB per send; one layer of 100 M parameters per stage."""
STRESS_WARMUP_S = 25.0
"""The stress's warm-up launch (process pool, NCCL), seconds."""
STRESS_SCHEDULE_S = 12.0
"""The stress's hard limit per schedule, seconds (the runtime's p2p timeout is half of it)."""
CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"
PRETRAIN_SLACK_S = 8.0
"""Seconds of a pretrain job's timeout left to torchrun's stop (``--kill-grace``) and the process start."""
MEMORY_CHECK_S = 20.0
"""Seconds kept for ``memory_check`` (``megatron-zb plan``) after the memory run."""

PT_MODEL = ("--num-layers 8 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 "
            "--max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 8 --bf16").split()
"""The earlier PP=1 run's model: 8 layers, hidden 2048, sequence 2048, bf16, 8 micro batches of 1."""


def pt_train(iters: int, window: tuple[int, int]) -> list[str]:
    """Training flags: ``iters`` iterations, the profiling window ``[start, end)``, mock data, no evaluation."""
    return ["--train-iters", str(iters), "--lr", "1e-4", "--min-lr", "1e-5", "--lr-warmup-iters", "1",
            "--lr-decay-style", "cosine", "--mock-data", "--log-interval", "1", "--eval-iters", "0",
            "--distributed-backend", "nccl", "--zero-bubble-pipeline-timers-start-iter", str(window[0]),
            "--zero-bubble-pipeline-timers-end-iter", str(window[1])]


@dataclass(frozen=True)
class Command:
    """One process: its argv and its environment changes (a value ``None`` removes the variable)."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str | None], ...] = ()

    def shell(self) -> str:
        """The command as one shell line (``env -u X A=B argv...``)."""
        if not self.env:
            return shlex.join(self.argv)
        unset = [w for k, v in self.env if v is None for w in ("-u", k)]
        sets = [f"{k}={v}" for k, v in self.env if v is not None]
        return shlex.join(["env", *unset, *sets, *self.argv])

    def environ(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` with this command's changes."""
        out = dict(base)
        for k, v in self.env:
            if v is None:
                out.pop(k, None)
            else:
                out[k] = v
        return out


@dataclass(frozen=True)
class Context:
    """What the commands depend on: the node and where files go."""

    gpus: int
    work: Path
    python: str
    cpus: int
    have_te: bool = False


Builder = Callable[[Context, tuple[int, ...]], list[Command]]


@dataclass(frozen=True)
class Job:
    """One line of the summary: commands on ``gpus`` GPUs within ``timeout_s`` seconds.

    ``key`` names it (``--steps``, its log ``WORK/<key>.log``); ``build(ctx, gpu_ids)`` gives its
    commands; ``needs``: GPUs the node must have (``why`` says why, where it has fewer); ``isolated``:
    it runs alone on the node (timing); ``full``: only with ``--full``; ``needs_te``: only with
    Transformer Engine; ``together``: consecutive jobs of one tag share a step where they fit.
    """

    key: str
    title: str
    gpus: int
    timeout_s: float
    build: Builder = field(repr=False)
    needs: int = 0
    why: str = ""
    isolated: bool = False
    full: bool = False
    needs_te: bool = False
    together: str = ""


def _cuda(ids: Sequence[int], **extra: str | None) -> tuple[tuple[str, str | None], ...]:
    env: dict[str, str | None] = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, ids)), **extra}
    return tuple(env.items())


def _test_env(ids: Sequence[int], **extra: str | None) -> tuple[tuple[str, str | None], ...]:
    return _cuda(ids, MEGATRON_ZB_TEST_DEVICE="cuda", MEGATRON_ZB_TEST_BACKEND="nccl", **extra)


ENV_SNIPPET = (
    "import importlib.metadata as m, importlib.util as u, torch; "
    "from megatron_zb.runtime.te_route import transformer_engine_version as te; "
    "print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'NCCL', "
    "torch.cuda.nccl.version() if torch.cuda.is_available() else None, 'GPUs', torch.cuda.device_count(), "
    "'megatron-core', m.version('megatron-core'), 'transformer_engine', te(), "
    "'apex fused_weight_gradient_mlp_cuda', u.find_spec('fused_weight_gradient_mlp_cuda') is not None)")


def _env_job(ctx: Context, ids: tuple[int, ...]) -> list[Command]:
    return [Command(("nvidia-smi", "-L")), Command((ctx.python, "-c", ENV_SNIPPET))]


def _hol_forms(ctx: Context) -> list[str]:
    return ["stream", "nccl"] if ctx.gpus >= 2 else ["stream"]


def _hol_job(ctx: Context, ids: tuple[int, ...]) -> list[Command]:
    forms = ",".join(_hol_forms(ctx))
    return [Command((ctx.python, "-m", "megatron_zb.testing.hol_probe", "--forms", forms), _cuda(ids))]


def stress_group(gpus: int) -> int:
    """GPUs per p2p-stress group (= PP): two groups, one per connection setting, where the node has 4+."""
    return gpus // 2 if gpus >= 4 else 2


def _stress(value: str | None) -> Builder:
    def build(ctx: Context, ids: tuple[int, ...]) -> list[Command]:
        sizes = [w for k, v in STRESS_MODEL.items() for w in (f"--{k}", str(v))]
        argv = (ctx.python, "-m", "megatron_zb.testing.p2p_stress", "--pp", str(len(ids)), "--schedules",
                ",".join(AT_RISK_FAMILIES), *sizes, "--timeout", f"{STRESS_SCHEDULE_S:g}", "--warmup-timeout",
                f"{STRESS_WARMUP_S:g}", "--threads", str(max(1, ctx.cpus // max(ctx.gpus, 1))))
        return [Command(argv, _test_env(ids, **{CONNECTIONS: value}))]
    return build


def pretrain_command(ctx: Context, ids: tuple[int, ...], label: str, flags: Sequence[str], timeout_s: float
                     ) -> Command:
    """``pretrain_run`` of ``pretrain_gpt_zb.py flags`` on ``ids``, output in ``work/pretrain-LABEL``."""
    out = ctx.work / f"pretrain-{label}"
    argv = (ctx.python, "-m", "megatron_zb.testing.pretrain_run", "--nproc", str(len(ids)), "--label", label,
            "--out", str(out), "--timeout", f"{timeout_s - PRETRAIN_SLACK_S:g}", "--kill-grace", f"{KILL_GRACE_S:g}",
            "--", *flags, "--loss-log-json", str(out / "loss.json"))
    return Command(argv, _cuda(ids, **{CONNECTIONS: "1"}))


def _pretrain(label: str, flags: Sequence[str], timeout_s: float) -> Builder:
    return lambda ctx, ids: [pretrain_command(ctx, ids, label, flags, timeout_s)]


def _host_bound(variant: str, timeout_s: float) -> Builder:
    common = [*PT_MODEL, *pt_train(6, (2, 5)), "--pipeline-model-parallel-size", "1", "--enable-zero-bubble"]

    def build(ctx: Context, ids: tuple[int, ...]) -> list[Command]:
        argv = (ctx.python, "-m", "megatron_zb.testing.host_bound", "--variant", variant, "--dir",
                str(ctx.work / "host-bound"), "--timeout", f"{timeout_s - PRETRAIN_SLACK_S:g}", "--kill-grace",
                f"{KILL_GRACE_S:g}", "--", *common)
        return [Command(argv, _cuda(ids, **{CONNECTIONS: "1"}))]
    return build


def _memory(label: str, layout: list[str], impl: Callable[[Context], str], timeout_s: float) -> Builder:
    def build(ctx: Context, ids: tuple[int, ...]) -> list[Command]:
        flags = [*PT_MODEL, *pt_train(3, (2, 3)), "--num-workers", "0", *layout, "--schedule", "zb-h1",
                 "--transformer-impl", impl(ctx)]
        run = pretrain_command(ctx, ids, label, flags, timeout_s - MEMORY_CHECK_S)
        check = (ctx.python, "-m", "megatron_zb.testing.memory_check", "--run", str(ctx.work / f"pretrain-{label}"),
                 "--schedule", "zb-h1", "--", *PT_MODEL, *layout, "--transformer-impl", impl(ctx),
                 "--vocab-size", "258")
        return [run, Command(check)]
    return build


def _local(ctx: Context) -> str:
    return "local"


def _te_or_local(ctx: Context) -> str:
    return "transformer_engine" if ctx.have_te else "local"


def _short(layout: list[str], extra: Sequence[str] = ()) -> list[str]:
    return [*PT_MODEL, *pt_train(3, (2, 3)), "--num-workers", "0", *layout, *extra]


PP2 = ["--pipeline-model-parallel-size", "2"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
PAIR = "two NCCL ranks cannot share one GPU (NCCL: 'Duplicate GPU detected')"


def core_jobs(ctx: Context) -> list[Job]:
    """The 9-minute plan's jobs, most informative first."""
    hol_s = hol_probe.planned_seconds(_hol_forms(ctx)) + 10
    stress_s = STRESS_WARMUP_S + len(AT_RISK_FAMILIES) * STRESS_SCHEDULE_S + 3
    group = stress_group(ctx.gpus)
    out = [Job("env", "environment: GPUs, versions, TE / apex presence", 0, 20.0, _env_job),
           Job("hol", f"head-of-line probe ({' + '.join(_hol_forms(ctx))} form, both {CONNECTIONS} settings)",
               min(ctx.gpus, 2), hol_s, _hol_job, needs=1)]
    for key, value in (("stress-1conn", "1"), ("stress-default", None)):
        setting = f"{CONNECTIONS}={value}" if value else f"{CONNECTIONS} unset"
        out.append(Job(key, f"p2p stress, 64 MiB sends, {len(AT_RISK_FAMILIES)} at-risk schedules, PP={group}, "
                            f"{setting}", group, stress_s, _stress(value), needs=2, why=PAIR, together="stress"))
    vocab, *more_vocab = VOCAB_FAMILIES
    out.append(_vocab_job(vocab))
    for name, variant in VARIANTS.items():
        out.append(Job(f"host-bound-{name}", f"host-bound diagnosis PP=1: {variant.what}", 1, 60.0,
                       _host_bound(name, 60.0), needs=1, isolated=True))
    out += [Job("mem-pp2", "memory vs megatron-zb plan (zb-h1 PP=2, local layers)", 2, 80.0,
                _memory("zb-h1-memory", PP2, _local, 80.0), needs=2,
                why="megatron-zb plan models pipelines of PP >= 2; " + PAIR),
            Job("tp2-sp", "pretrain zb TP=2 SP PP=1", 2, 60.0,
                _pretrain("zb-tp2-sp", _short([*TP2_SP, "--pipeline-model-parallel-size", "1", "--enable-zero-bubble"]),
                          60.0), needs=2, why=PAIR),
            Job("mem-tp2-sp-pp2", "memory vs megatron-zb plan (zb-h1 TP=2 SP x PP=2)", 4, 80.0,
                _memory("zb-h1-tp2-sp-memory", [*TP2_SP, *PP2], _te_or_local, 80.0), needs=4,
                why="TP=2 x PP=2 needs 4 GPUs")]
    out += [_vocab_job(name) for name in more_vocab]
    return out


def _vocab_job(schedule: str) -> Job:
    flags = _short(PP2, ["--schedule", schedule, "--enable-vocab-parallel"])
    return Job(f"vocab-{schedule}", f"pretrain --enable-vocab-parallel {schedule} PP=2", 2, 70.0,
               _pretrain(schedule, flags, 70.0), needs=2, why=PAIR)


NUMERIC_TESTS = ("tests/runtime/test_runtime.py", "tests/runtime/test_routes.py", "tests/runtime/test_te_contract.py",
                 "tests/runtime/test_dp_overlap.py", "tests/training/test_model_flags.py")
"""The numerical suite run on CUDA with ``--full``."""


def _pytest(*args: str, all_gpus: bool = False) -> Builder:
    def build(ctx: Context, ids: tuple[int, ...]) -> list[Command]:
        argv = (ctx.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *args)
        return [Command(argv, _test_env(ids, CUBLAS_WORKSPACE_CONFIG=":4096:8"))]
    return build


def _bench(ctx: Context, ids: tuple[int, ...]) -> list[Command]:
    argv = (ctx.python, "-m", "megatron_zb.testing.gpu_bench", "--pp", str(len(ids)), "--warmup", "2", "--iters", "5",
            "--timeout", "560")
    return [Command(argv, _test_env(ids))]


def full_jobs(ctx: Context) -> list[Job]:
    """What else exists, opt-in (``--full``): the numerical suite, the earlier pretrain runs, TE, benchmark."""
    profiled = [*PT_MODEL, *pt_train(10, (3, 7)), "--num-workers", "0", *PP2]
    out = [Job("numeric", "numerical test suite on CUDA (one GPU per rank; what needs more is skipped)", ctx.gpus,
               900.0, _pytest(*NUMERIC_TESTS), needs=1, isolated=True, full=True)]
    for label, flags in (("zb", ["--enable-zero-bubble"]), ("zb-2p", ["--schedule", "zb-2p"]),
                         ("zbv", ["--zero-bubble-v-schedule"])):
        profile = ["--profile-out", "PROFILE"]
        out.append(Job(f"pretrain-{label}", f"pretrain {label} PP=2 with --profile-out", 2, 150.0,
                       _profiled(label, [*profiled, *flags, *profile]), needs=2, why=PAIR, full=True))
    out += [Job("tp2-pp2-tests", "TP=2 (+SP) x PP=2 numerical tests on CUDA", 4, 300.0,
                _pytest("tests/runtime/test_runtime.py", "-k", "tp2_pp2"), needs=4, why="TP=2 x PP=2", full=True),
            Job("te-parity", "Transformer Engine parity (tests/runtime/test_te_real.py)", 2, 900.0,
                _pytest("tests/runtime/test_te_real.py"), needs=2, why=PAIR, full=True, needs_te=True),
            Job("bench", "benchmark: megatron-core 1F1B vs zb, zb-2p, zbv at PP = GPUs", ctx.gpus, 600.0, _bench,
                needs=2, why="a pipeline needs 2 or more GPUs", isolated=True, full=True)]
    return out


def _profiled(label: str, flags: list[str]) -> Builder:
    def build(ctx: Context, ids: tuple[int, ...]) -> list[Command]:
        real = [str(ctx.work / f"pretrain-{label}" / "profile.json") if f == "PROFILE" else f for f in flags]
        return [pretrain_command(ctx, ids, label, real, 150.0)]
    return build


def jobs(ctx: Context) -> list[Job]:
    """Every job, most informative first (the ``--full`` ones last)."""
    return core_jobs(ctx) + full_jobs(ctx)

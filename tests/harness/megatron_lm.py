"""Run NVIDIA Megatron-LM's own training loop (``pretrain_gpt.py``) on CPU with gloo, for tests.

Test code, not the product's run path. :func:`run_megatron_lm` starts ``world_size`` processes on
127.0.0.1 (torchrun's environment: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``; the rendezvous store hosted by the harness, as torchrun's agent hosts it). Each runs
:mod:`harness.megatron_lm_main` as its ``__main__``, which

1. applies the CPU workarounds (:mod:`harness.megatron_lm_workarounds`; each names the
   Megatron-LM / megatron-core line it answers) and installs the recorders below;
2. runs the optional *plugin step* -- the lines a user would add to ``pretrain_gpt.py``, e.g.
   ``"import megatron_zb; megatron_zb.patch_megatron('zb')"`` (a code string) or
   ``"package.module:function"`` (an importable callable, called with no argument);
3. executes Megatron-LM's unmodified ``pretrain_gpt.py`` inside that same ``__main__`` module, so
   dist-checkpointing's results process (spawn start method, re-imports ``__main__``) imports
   the harness's entry script, not a bare ``pretrain_gpt.py`` without the workarounds.

Megatron-LM's files -- the release that goes with the installed megatron-core
(``megatron_compat.megatron_lm_tag()``: core_v0.16.1 for 0.16.1, core_v0.19.0 for 0.19.x) -- are
found through ``MEGATRON_LM_DIR`` or ``../shared/megatron-lm-<tag>`` relative to the project root
(:func:`find_megatron_lm`); they are never copied or edited.

What comes back (:class:`MegatronLMRun`): per iteration the ``lm loss`` and ``grad norm`` as
Megatron-LM prints them (the last rank's `` iteration N/ M | ...`` lines), the same values exactly
(``training_log``'s arguments, recorded on every rank; :attr:`IterationLog.exact`), and, with
``params=True``, every rank's parameters after training.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = [
    "CPU_FLAGS", "LLAMA_FLAGS", "MEGATRON_LM_ENV", "MOCK_DATA_FLAGS", "PLUGIN_CALLABLE", "SKIP_REASON",
    "TINY_GPT_FLAGS",
    "IterationLog", "MegatronLMError", "MegatronLMRun", "bitwise_differences", "exception_line", "find_megatron_lm",
    "parse_iteration_lines", "plugin_spec", "run_megatron_lm",
]

MEGATRON_LM_ENV = "MEGATRON_LM_DIR"
"""Environment variable naming a Megatron-LM checkout holding ``pretrain_gpt.py``, of the release that
goes with the installed megatron-core (core_v0.16.1 for 0.16.1, core_v0.19.0 for 0.19.x)."""
PROJECT_ROOT = Path(__file__).resolve().parents[2]
TESTS_DIR = PROJECT_ROOT / "tests"
"""Where :mod:`harness` is importable from (the ranks' ``PYTHONPATH`` holds it after the project root)."""
SKIP_REASON = (f"Megatron-LM not found: set {MEGATRON_LM_ENV} to a checkout holding pretrain_gpt.py of the release "
               f"that goes with the installed megatron-core (core_v0.16.1 for 0.16.1, core_v0.19.0 for 0.19.x), "
               f"or provide ../shared/megatron-lm-<that tag> beside the project root")
"""The one sentence tests skip with when :func:`find_megatron_lm` finds nothing."""

CPU_FLAGS: tuple[str, ...] = (
    "--distributed-backend", "gloo",  # NCCL needs GPUs
    "--transformer-impl", "local",  # no Transformer Engine on CPU
    "--no-gradient-accumulation-fusion",  # the fused wgrad kernel needs apex (CUDA)
    "--no-persist-layer-norm",  # apex's persistent LayerNorm kernel
    "--no-masked-softmax-fusion",  # the fused softmax kernel (used with --bf16/--fp16)
    "--no-rope-fusion",  # the fused RoPE kernel (needed with --position-embedding-type rope)
    # Speed only: each avoids ~10 s of torch.compile on CPU at the first iteration.
    "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-bias-swiglu-fusion",
)
"""Flags every CPU run of Megatron-LM's loop needs (``../shared/notes/megatron-lm-loop-on-cpu.md``).
Do not add ``--attention-backend local``: Megatron-LM accepts it only with ``--spec local``."""

MOCK_DATA_FLAGS: tuple[str, ...] = (
    "--mock-data",  # megatron-core's MockGPTDataset: no files, deterministic
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "127",  # offline; padded vocab 128
    "--log-interval", "1",  # one log line per iteration (parsed by run_megatron_lm)
    "--eval-interval", "1000000", "--eval-iters", "0",  # --train-iters requires an eval interval
    "--seed", "1234",
)
"""Data, tokenizer and logging for a self-contained run (no data files, no network)."""

TINY_GPT_FLAGS: tuple[str, ...] = (
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "2", "--lr", "1e-3", "--min-lr", "1e-4", "--weight-decay", "0.01",
    "--clip-grad", "1.0",
)
"""A tiny GPT-2-style model (learned positions, LayerNorm, GeLU, biases, tied embeddings);
default dropout. Add ``--global-batch-size`` and ``--train-iters``."""

LLAMA_FLAGS: tuple[str, ...] = (
    "--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "176", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2",
    "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--no-rope-fusion",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "2", "--lr", "1e-3", "--min-lr", "1e-4", "--weight-decay", "0.1",
    "--adam-beta2", "0.95", "--clip-grad", "1.0",
)
"""A tiny LLaMA-style model (RMSNorm, SwiGLU, RoPE, GQA, no biases, untied embeddings), as in
Megatron-LM's LLaMA example scripts but with default dropout. Add ``--global-batch-size`` and
``--train-iters``."""

_PLUGIN_ENV = "MEGATRON_ZB_MLM_PLUGIN"
_OUT_ENV = "MEGATRON_ZB_MLM_OUT"
_PARAMS_ENV = "MEGATRON_ZB_MLM_PARAMS"
_SCRIPT_EDIT_ENV = "MEGATRON_ZB_MLM_SCRIPT_EDIT"
PLUGIN_CALLABLE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
"""A plugin step matching this is ``module:function`` (imported and called); anything else is code."""
_ITERATION_RE = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|(.*)$")


def shared_relative() -> Path:
    """Where Megatron-LM's files are looked for, relative to the project root, without
    ``MEGATRON_LM_ENV``: ``../shared/megatron-lm-<tag>``, the tag going with the installed
    megatron-core (``megatron_compat.megatron_lm_tag()``)."""
    from megatron_zb.megatron_compat import megatron_lm_tag

    return Path("..") / "shared" / f"megatron-lm-{megatron_lm_tag()}"


def find_megatron_lm(project_root: str | Path | None = None) -> Path | None:
    """The Megatron-LM folder to run: ``$MEGATRON_LM_DIR`` when set (and holding ``pretrain_gpt.py``),
    else :func:`shared_relative` relative to ``project_root`` (default: this project's root); None
    when neither holds ``pretrain_gpt.py``. Whether the folder is the right release is checked when a
    rank starts (``megatron_lm_workarounds.apply_workarounds``)."""
    root = Path(project_root) if project_root is not None else PROJECT_ROOT
    candidates = [Path(os.environ[MEGATRON_LM_ENV])] if os.environ.get(MEGATRON_LM_ENV) else []
    candidates.append(root / shared_relative())
    for folder in candidates:
        if (folder / "pretrain_gpt.py").is_file():
            return folder.resolve()
    return None


# ---------------------------------------------------------------------- results
@dataclass(frozen=True)
class IterationLog:
    """One training iteration as Megatron-LM logged it and as it computed it.

    ``lm_loss`` / ``grad_norm`` are read from the printed line (loss to 7 significant digits, grad
    norm to 3 decimals; None when not printed). The printed loss is Megatron-LM's average over the
    log window, and at this tag the first iteration does not reset it, so iteration 2 prints the
    mean of iterations 1 and 2 (with ``--log-interval 1``). ``exact`` holds the values
    ``training_log`` received for this iteration alone (``"lm loss"``, ``"grad norm"``; floats).
    """

    iteration: int
    lm_loss: float | None
    grad_norm: float | None
    line: str
    exact: dict[str, float | None] = field(default_factory=dict)
    forward_backward: str = ""
    """``module.qualname`` of the ``forward_backward_func`` Megatron-LM's ``train_step`` ran."""


@dataclass
class MegatronLMRun:
    """What :func:`run_megatron_lm` returns.

    Attributes:
        iterations: the last rank's logged iterations, in order.
        grad_norms_by_rank: per rank, the exact grad norm of each iteration (``training_log``'s argument).
        params: per rank, ``{"chunk<i>.<name>": tensor}`` after training (``params=True``), else None.
        logs: per rank, the process's whole output (stdout and stderr).
        wall_s: seconds from the first process start to the last exit.
    """

    iterations: list[IterationLog]
    grad_norms_by_rank: list[list[float | None]]
    params: list[dict[str, Any]] | None
    logs: list[str]
    wall_s: float

    @property
    def lm_losses(self) -> list[float | None]:
        """Exact lm loss per iteration (last rank)."""
        return [it.exact.get("lm loss") for it in self.iterations]

    @property
    def grad_norms(self) -> list[float | None]:
        """Exact grad norm per iteration (last rank)."""
        return [it.exact.get("grad norm") for it in self.iterations]


class MegatronLMError(RuntimeError):
    """A rank of a Megatron-LM run failed or the run timed out; the message holds the failing
    rank's last output lines (its traceback). ``logs``: every rank's output; ``returncodes``: every
    rank's exit status (``-9``: killed by the harness, e.g. still running ``grace`` seconds after
    another rank failed)."""

    def __init__(self, message: str, logs: Sequence[str], returncodes: Sequence[int | None] = ()) -> None:
        super().__init__(message)
        self.logs = list(logs)
        self.returncodes = list(returncodes)


def parse_iteration_lines(log: str) -> list[tuple[int, float | None, float | None, str]]:
    """``(iteration, lm loss, grad norm, line)`` for each `` iteration N/ M | ...`` line of ``log``."""
    rows = []
    for line in log.splitlines():
        m = _ITERATION_RE.search(line)
        if not m:
            continue
        fields = {}
        for part in m.group(3).split("|"):
            key, sep, value = part.partition(":")
            if sep:
                fields[key.strip()] = value.strip()
        loss, norm = fields.get("lm loss"), fields.get("grad norm")
        rows.append((int(m.group(1)), float(loss) if loss else None, float(norm) if norm else None, line.strip()))
    return rows


def bitwise_differences(run: MegatronLMRun, ref: MegatronLMRun) -> list[str]:
    """What differs between two runs, bit for bit: the iterations logged, each iteration's exact lm
    loss and grad norm (last rank) and printed line values, every rank's grad norms, and (when both
    have them) every rank's parameters (compared as raw bits: ``-0.0`` differs from ``0.0``).
    Empty when the runs are bitwise equal."""
    out: list[str] = []
    if [it.iteration for it in run.iterations] != [it.iteration for it in ref.iterations]:
        return [f"iterations {[it.iteration for it in run.iterations]} != {[it.iteration for it in ref.iterations]}"]
    for it, base in zip(run.iterations, ref.iterations):
        for key in sorted(set(it.exact) | set(base.exact)):
            a, b = it.exact.get(key), base.exact.get(key)
            if (a.hex() if a is not None else None) != (b.hex() if b is not None else None):
                out.append(f"iteration {it.iteration}: {key} {a!r} != {b!r}")
        if (it.lm_loss, it.grad_norm) != (base.lm_loss, base.grad_norm):
            printed, expected = (it.lm_loss, it.grad_norm), (base.lm_loss, base.grad_norm)
            out.append(f"iteration {it.iteration}: printed {printed} != {expected}")
    if [[_hex(x) for x in r] for r in run.grad_norms_by_rank] != [[_hex(x) for x in r] for r in ref.grad_norms_by_rank]:
        out.append(f"grad norms by rank {run.grad_norms_by_rank} != {ref.grad_norms_by_rank}")
    if run.params is not None and ref.params is not None:
        for rank, (mine, theirs) in enumerate(zip(run.params, ref.params)):
            if mine.keys() != theirs.keys():
                out.append(f"rank {rank}: parameter names {sorted(mine.keys() ^ theirs.keys())} differ")
            out += [f"rank {rank}: {name} differs" for name in sorted(mine.keys() & theirs.keys())
                    if not _same_bits(mine[name], theirs[name])]
    return out


def _hex(x: float | None) -> str | None:
    return None if x is None else float(x).hex()


def _same_bits(a: Any, b: Any) -> bool:
    """Same dtype, shape and bytes (tensors)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    kind = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(-1).view(kind), b.contiguous().view(-1).view(kind))


# ---------------------------------------------------------------------- launcher
def run_megatron_lm(
    argv: Sequence[str],
    *,
    world_size: int,
    env: dict[str, str] | None = None,
    timeout: float,
    plugin: str | Callable[[], Any] | None = None,
    params: bool = False,
    megatron_lm_dir: str | Path | None = None,
    threads: int = 1,
    grace: float = 3.0,
    script_edit: Sequence[tuple[str, str]] = (),
) -> MegatronLMRun:
    """Run Megatron-LM's ``pretrain_gpt.py`` with ``argv`` on ``world_size`` local processes (gloo).

    Args:
        argv: ``pretrain_gpt.py``'s arguments (e.g. ``[*CPU_FLAGS, *MOCK_DATA_FLAGS, *TINY_GPT_FLAGS,
            "--pipeline-model-parallel-size", "2", "--global-batch-size", "8", "--train-iters", "4"]``).
        world_size: number of processes (ranks).
        env: extra environment variables for every rank (the harness's own variables win).
        timeout: hard limit in seconds for the whole run; then every rank is killed.
        plugin: the plugin step run before ``pretrain_gpt.py`` in each rank: a code string, a
            ``"module:function"`` string, or a module-level function (called with no argument).
        params: also return every rank's parameters after training.
        megatron_lm_dir: Megatron-LM's folder (default :func:`find_megatron_lm`).
        threads: torch threads per rank (``OMP_NUM_THREADS``).
        grace: seconds the other ranks get to exit after one rank failed; then they are killed.
        script_edit: ``(old, new)`` text replacements applied, in order, to ``pretrain_gpt.py``'s text
            before it runs (what a user changes in their copy; the file itself is untouched); each
            ``old`` must occur exactly once.

    Raises:
        FileNotFoundError: no Megatron-LM folder (the message is :data:`SKIP_REASON`).
        MegatronLMError: a rank exited with a non-zero status, or the timeout passed.
    """
    folder = Path(megatron_lm_dir) if megatron_lm_dir is not None else find_megatron_lm()
    if folder is None or not (folder / "pretrain_gpt.py").is_file():
        raise FileNotFoundError(SKIP_REASON)
    with tempfile.TemporaryDirectory(prefix="megatron_zb-mlm-") as out:
        harness = {MEGATRON_LM_ENV: str(folder.resolve()), _OUT_ENV: out, _PLUGIN_ENV: plugin_spec(plugin),
                   _PARAMS_ENV: "1" if params else "0", _SCRIPT_EDIT_ENV: json.dumps([list(e) for e in script_edit])}
        logs, codes, wall_s, failure = _launch(list(argv), world_size, {**(env or {}), **harness}, out, timeout,
                                               threads, grace)
        if failure:
            raise MegatronLMError(failure, logs, codes)
        return _collect(Path(out), logs, world_size, params, wall_s)


def plugin_spec(plugin: str | Callable[[], Any] | None) -> str:
    """The plugin step as the string a rank reads (empty: none)."""
    if plugin is None:
        return ""
    if callable(plugin):
        spec = f"{plugin.__module__}:{plugin.__qualname__}"
        if not PLUGIN_CALLABLE.match(spec) or "<locals>" in spec:
            raise ValueError(f"plugin {plugin!r} is not an importable module-level function")
        return spec
    return plugin


def _rendezvous_store() -> Any:
    """The ranks' rendezvous store, hosted by this process on a port the OS picks, as torchrun's agent
    hosts it: with ``TORCHELASTIC_USE_AGENT_STORE=True`` every rank connects as a client. (A port found
    free and handed to rank 0 to bind later can be taken in between -- EADDRINUSE in CI, 2026-11-28.)"""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _launch(argv: list[str], world_size: int, env: dict[str, str], out: str, timeout: float, threads: int,
            grace: float) -> tuple[list[str], list[int | None], float, str]:
    """Start the ranks, wait for them; returns (per-rank output, per-rank exit status, wall seconds,
    failure message or "")."""
    store = _rendezvous_store()  # referenced until every rank has exited
    base = {**os.environ, **env, "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
            "OMP_NUM_THREADS": str(threads),
            "CUDA_DEVICE_MAX_CONNECTIONS": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(PROJECT_ROOT), str(TESTS_DIR),
                                                         os.environ.get("PYTHONPATH")) if p)}
    procs: list[Any] = []
    paths = [Path(out) / f"rank{r}.log" for r in range(world_size)]
    zygote = _zygote(env[MEGATRON_LM_ENV], base)
    start = time.monotonic()
    first_failed: int | None = None
    try:
        for rank, path in enumerate(paths):
            procs.append(zygote.spawn(argv=argv, env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}, cwd=out,
                                      log=str(path)))
        first_failed = _wait(procs, start + timeout, grace)
    finally:
        for p in procs:  # each rank leads its own session: kill whatever is left of it
            _kill_group(p)
        for p in procs:
            p.wait()
    wall_s = time.monotonic() - start
    logs = [path.read_text(errors="replace") for path in paths]
    codes = [p.returncode for p in procs]
    if first_failed is None and all(c == 0 for c in codes):
        return logs, codes, wall_s, ""
    if first_failed is None:
        failure = f"timeout: the run did not finish within {timeout:g} s; every rank was killed"
    else:
        failure = (f"rank {first_failed} exited with status {procs[first_failed].returncode}: "
                   f"{exception_line(logs[first_failed])}")
    failed = [first_failed] if first_failed is not None else []
    failed += [r for r, p in enumerate(procs) if p.returncode != 0 and r != first_failed]
    failure += "".join(f"\n--- rank {r} (last lines) ---\n{_tail(logs[r])}" for r in failed)
    return logs, codes, wall_s, failure


_ZYGOTES: dict[tuple[str, ...], Any] = {}


def _zygote(folder: str, env: dict[str, str]) -> Any:
    """The warm-start process for ``folder`` and this environment's interpreter settings
    (:mod:`harness.megatron_lm_zygote`), started on first use, ended at exit."""
    from harness.megatron_lm_zygote import Zygote

    key = (folder, *(env.get(k, "") for k in _ZYGOTE_ENV))
    zygote = _ZYGOTES.get(key)
    if zygote is None or not zygote.alive():
        zygote = _ZYGOTES[key] = Zygote(folder, {k: v for k, v in env.items() if k not in ("RANK", "LOCAL_RANK")})
        if len(_ZYGOTES) == 1:
            atexit.register(lambda: [z.close() for z in _ZYGOTES.values()])
    return zygote


_ZYGOTE_ENV = ("PYTHONPATH", "OMP_NUM_THREADS", "PYTHONHASHSEED", "TORCHDYNAMO_DISABLE")
"""Variables read when the interpreter or torch starts (``TORCHDYNAMO_DISABLE``: when ``torch._dynamo``'s
config is imported): a zygote serves only runs that agree on them."""


def _kill_group(p: Any) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _wait(procs: list[Any], deadline: float, grace: float) -> int | None:
    """Poll the ranks until all exited or ``deadline`` (monotonic seconds) passed; the first rank seen
    failing (the others then get ``grace`` seconds), or None."""
    first_failed: int | None = None
    while True:
        codes = [p.poll() for p in procs]
        if first_failed is None:
            first_failed = next((r for r, c in enumerate(codes) if c not in (0, None)), None)
            if first_failed is not None:
                deadline = min(deadline, time.monotonic() + grace)
        if all(c is not None for c in codes) or time.monotonic() > deadline:
            return first_failed
        time.sleep(0.05)


def exception_line(log: str) -> str:
    """The last ``SomeError: message`` line of a rank's output (torchrun-style ``[rankN]:`` prefix removed)."""
    for line in reversed(log.splitlines()):
        line = re.sub(r"^\[rank\d+\]:\s*", "", line).strip()
        if re.match(r"^[\w.]*(Error|Exception|Exit|Interrupt)\b.*", line):
            return line
    return "(no exception in its output)"


def _tail(log: str, lines: int = 30) -> str:
    return "\n".join(log.rstrip().splitlines()[-lines:])


def _collect(out: Path, logs: list[str], world_size: int, params: bool, wall_s: float) -> MegatronLMRun:
    """Assemble the result from the last rank's log lines and every rank's records."""
    records = [_read_records(out / f"record_rank{r}.jsonl") for r in range(world_size)]
    last = {rec["iteration"]: rec for rec in records[-1]}
    iterations = []
    for n, loss, norm, line in parse_iteration_lines(logs[-1]):
        rec = last.get(n, {})
        exact = {key: _unhex(value) for key, value in rec.get("losses", {}).items()}
        exact["grad norm"] = _unhex(rec.get("grad_norm"))
        iterations.append(IterationLog(n, loss, norm, line, exact, rec.get("forward_backward", "")))
    norms = [[_unhex(rec.get("grad_norm")) for rec in rank_records] for rank_records in records]
    tensors = None
    if params:
        import torch

        tensors = [torch.load(out / f"params_rank{r}.pt", weights_only=True) for r in range(world_size)]
    return MegatronLMRun(iterations, norms, tensors, logs, wall_s)


def _read_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _unhex(value: str | None) -> float | None:
    return None if value is None else float.fromhex(value)

"""Dead and frozen peers (issue 23): a collective the zero-bubble path adds ends the run with a
:class:`~megatron_zb.runtime.peer_wait.PipelineTimeoutError` naming the operation and the peer, within its
timeout, instead of waiting for the process group's own timeout (``--distributed-timeout-minutes``).

* End to end, gloo's policy: ``pretrain_gpt_zb.py``'s ``main`` at PP=2 x DP=2 (4 ranks of
  ``run_distributed``, the launcher here: what torchrun would start, without the process start-up;
  its grace after a failed rank is 2 s), ``--overlap-grad-reduce``, ``--pipeline-timeout-seconds 3``.
  The fault-injection hook (:func:`_freeze_hook`, installed with
  ``grad_sync.set_before_reduce_hook`` in each rank) freezes global rank 1 (``SIGSTOP``: every thread of the process, as a frozen node)
  just before it launches its first data-parallel reduce of iteration 2 (the first whose reduces are
  launched from W), so its data-parallel peer, rank 0, waits in stage 0's reduce.
* End to end, NCCL's policy run on gloo: the same freeze in the tiny GPT of the DP-overlap tests with
  ``wait_policy=STREAM``; rank 0 blocks in megatron-core's untimed wait and the watchdog ends it.
* The rule's host wait and post-validation's wait on a real gloo group with a late peer.
* The script's exit path: a late peer ends the process at once, with no process-group teardown.

NCCL itself is not verified here (CPU only): its wait semantics are taken from PyTorch's source.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from harness.pretrain_harness import SMALL, without  # the end-to-end harness's tiny model

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::DeprecationWarning")]

TIMEOUT_S = 3.0
ARGV = without(SMALL, "--pipeline-timeout-seconds") + [
    "--pipeline-model-parallel-size", "2", "--enable-zero-bubble", "--overlap-grad-reduce", "--train-iters", "3",
    "--pipeline-timeout-seconds", f"{TIMEOUT_S:g}"]
"""4 ranks: pipeline groups [0, 2] and [1, 3], data-parallel groups [0, 1] (stage 0) and [2, 3] (stage 1)."""


def _freeze_hook(hook: str) -> Callable[[int], None]:
    """The fault injection, for ``grad_sync.set_before_reduce_hook``: ``hook`` = ``RANK:ITERATION`` freezes
    global rank ``RANK`` (``SIGSTOP`` to itself: every thread, as a frozen node) just before it reports
    the first parameters of ``ITERATION`` ready (where its first data-parallel reduce launches), after
    saying so on stderr with the wall-clock time (``time.time()`` seconds)."""
    import torch.distributed as dist

    rank, at = (int(x) for x in hook.split(":"))

    def freeze(iteration: int) -> None:
        if dist.get_rank() != rank or iteration != at:
            return
        print(f"TEST HOOK before_reduce: rank {rank} freezes at {time.time():.3f} before its first data-parallel "
              f"reduce of iteration {iteration}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)

    return freeze


def _main_rank(argv: list[str], hook: str, stderr_dir: str) -> int:
    """One rank of ``pretrain_gpt_zb.py``'s ``main`` with the freeze hook installed; its stderr goes to a file."""
    import warnings

    import torch.distributed as dist

    from megatron_zb.runtime.grad_sync import set_before_reduce_hook
    from megatron_zb.training.pretrain import main

    warnings.simplefilter("ignore")
    rank = dist.get_rank()
    os.environ.update(WORLD_SIZE=str(dist.get_world_size()), RANK=str(rank), LOCAL_RANK=str(rank))
    set_before_reduce_hook(_freeze_hook(hook))
    err = open(Path(stderr_dir, f"rank{rank}.err"), "w")
    os.dup2(err.fileno(), 2)
    sys.stderr = err
    return main(argv)


def test_frozen_data_parallel_peer_ends_the_run_naming_the_reduce_and_the_peer(tmp_path):
    from megatron_zb.runtime.peer_wait import PipelineTimeoutError
    from megatron_zb.testing import run_distributed

    with pytest.raises(PipelineTimeoutError) as info:
        run_distributed(_main_rank, world_size=4, args=(ARGV, "1:2", str(tmp_path)), timeout=90, grace=2.0)
    ended = time.time()
    message = str(info.value)
    assert re.search(r"^rank 0: data-parallel all-reduce of stage 0, bucket \d+ \(iteration 2\) with peer rank 1 "
                     rf"did not complete within {TIMEOUT_S:g} s: a peer process died, is frozen", message), message
    assert "raised in rank 0" in "".join(info.value.__notes__)
    # the one line pretrain_gpt_zb.py prints last: whom to look at (torchrun's "root cause" is rank 0)
    assert re.search(r"^rank 0 waited for rank 1 \(frozen or slow\): data-parallel all-reduce of stage 0, bucket \d+ "
                     rf"\(iteration 2\) did not complete within {TIMEOUT_S:g} s; look at rank 1, not at the rank "
                     r"torchrun names as the root cause", info.value.blame), info.value.blame
    frozen = (tmp_path / "rank1.err").read_text()
    m = re.search(r"TEST HOOK \S+: rank 1 freezes at ([\d.]+) before its first data-parallel reduce of iteration 2",
                  frozen)
    assert m, frozen[-3000:]
    waited = ended - float(m.group(1))
    # rank 0 reaches its wait at most a few actions after rank 1 froze; then the timeout, then the grace
    assert TIMEOUT_S <= waited <= TIMEOUT_S + 2.0 + 8.0, waited


# ---------------------------------------------------------------------------- the rule on real gloo groups
LATE_S = 1.5  # the late rank joins this long after its peer started waiting (> the waits' 0.5 s timeout)


def _late_collectives() -> dict:
    """Rank 0 waits (host, 0.5 s) for an all-reduce rank 1 joins late; then rank 1 waits (post-validation's
    wait, 0.5 s) for one rank 0 joins late. Each late rank joins in the end, so the group stays usable."""
    import torch
    import torch.distributed as dist

    from megatron_zb.optimizer.grad_stats import wait_for
    from megatron_zb.runtime.peer_wait import Awaited, wait_host

    rank, out = dist.get_rank(), {}
    for waiter, name in ((0, "host"), (1, "post-validation")):
        t = torch.ones(1)
        if rank == waiter:
            work = dist.all_reduce(t, async_op=True)
            t0 = time.monotonic()
            try:
                if name == "host":
                    wait_host(work, Awaited(f"rank {rank}", "test all-reduce (iteration 7)", (1,)), 0.5)
                else:
                    wait_for(work, timeout=0.5, iteration=7, what="grad-norm all-reduce", group=None)
            except RuntimeError as e:
                out[name] = (type(e).__name__, [c.__name__ for c in type(e).__mro__], str(e), time.monotonic() - t0)
            work.wait()
            out[name + " value"] = t.item()
        else:
            time.sleep(LATE_S)
            dist.all_reduce(t)
    return out


def test_late_peer_in_a_host_wait_and_in_post_validation_is_named_within_the_timeout():
    from megatron_zb.testing import run_distributed

    r0, r1 = run_distributed(_late_collectives, world_size=2, timeout=60)
    kind, mro, message, seconds = r0["host"]
    assert kind == "PipelineTimeoutError" and 0.5 <= seconds < LATE_S, r0
    assert message.startswith("rank 0: test all-reduce (iteration 7) with peer rank 1 did not complete within 0.5 s: "
                              "a peer process died, is frozen or never reached this collective"), message
    kind, mro, message, seconds = r1["post-validation"]
    assert kind == "PostValidationTimeout" and "PipelineTimeoutError" in mro and 0.5 <= seconds < LATE_S, r1
    assert message.startswith("rank 1: post-validation's grad-norm all-reduce of iteration 7 with peer rank 0 did "
                              "not complete within 0.5 s"), message
    assert r0["host value"] == r1["post-validation value"] == 2.0  # the late collectives still completed


class _ClosedWork:
    """A test double of a gloo ``Work`` whose peer process was killed: gloo raises at once."""

    def wait(self, timeout=None):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:9654.\nmore")


def test_a_killed_peer_is_named_at_once_as_a_failure_not_a_timeout():
    from megatron_zb.runtime.peer_wait import Awaited, PipelineTimeoutError, wait_host

    awaited = Awaited("rank 2", "data-parallel reduce-scatter of stage 1, bucket 0 (iteration 5)", (0, 3))
    with pytest.raises(PipelineTimeoutError) as info:
        wait_host(_ClosedWork(), awaited, 300.0)
    assert str(info.value) == (
        "rank 2: data-parallel reduce-scatter of stage 1, bucket 0 (iteration 5) with peer ranks 0, 3 failed: a peer "
        "process died, is frozen or never reached this collective (RuntimeError: [gloo/transport/tcp/pair.cc:553] "
        "Connection closed by peer [127.0.0.1]:9654.)")
    assert info.value.blame.startswith(
        "rank 2 waited for rank 0 or rank 3 (dead or gone): data-parallel reduce-scatter of stage 1, bucket 0 "
        "(iteration 5) failed; look at rank 0 or rank 3"), info.value.blame


_SCRIPT_WITH_A_LATE_PEER = r"""
import runpy, sys, threading, types
from megatron_zb.runtime.peer_wait import Awaited

def main(argv):
    # what a gloo group with a pending collective does at teardown: wait for it (here: for ever)
    threading.Thread(target=threading.Event().wait).start()
    raise Awaited("rank 0", "data-parallel all-reduce of stage 0, bucket 0 (iteration 3)", (1,)).error(3.0)

for name in ("megatron_zb.training", "megatron_zb.training.pretrain"):  # a stand-in for the trainer
    sys.modules[name] = types.ModuleType(name)
sys.modules["megatron_zb.training.pretrain"].main = main
sys.argv = [sys.argv[1]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_pretrain_script_exits_at_once_on_a_late_peer_without_tearing_the_groups_down():
    """``pretrain_gpt_zb.py`` prints the named error and exits 1 at once, although something left at
    teardown would wait for ever (the trainer is a stand-in here: the real run is the first test)."""
    import subprocess
    import sys

    from harness.pretrain_harness import SCRIPT

    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _SCRIPT_WITH_A_LATE_PEER, str(SCRIPT)], capture_output=True,
                          text=True, timeout=20, env=dict(os.environ, RANK="1"))
    assert proc.returncode == 1, proc
    assert "PipelineTimeoutError: rank 0: data-parallel all-reduce of stage 0, bucket 0 (iteration 3) with peer " \
           "rank 1 did not complete within 3 s" in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        "pretrain_gpt_zb.py: error: rank 0 waited for rank 1 (frozen or slow): data-parallel all-reduce of stage 0, "
        "bucket 0 (iteration 3) did not complete within 3 s; look at rank 1, not at the rank torchrun names as the "
        "root cause (the one that waited)"), proc.stderr
    assert time.monotonic() - t0 < 30


def _stream_policy_rank(hook: str, stderr_dir: str) -> dict:
    """One rank of the tiny GPT at PP=2 x DP=2 with data-parallel overlap under NCCL's wait policy
    (run on gloo, where megatron-core's untimed ``wait()`` in ``finish_grad_sync`` blocks the host, as
    a host synchronisation behind a stuck NCCL reduce would)."""
    import torch.distributed as dist

    from harness.dp_overlap import DPCase, run_dp_iterations
    from megatron_zb.runtime.peer_wait import WaitPolicy
    from megatron_zb.runtime.grad_sync import set_before_reduce_hook
    from megatron_zb.testing.tiny_gpt import TinyGPT

    set_before_reduce_hook(_freeze_hook(hook))
    err = open(Path(stderr_dir, f"rank{dist.get_rank()}.err"), "w")
    os.dup2(err.fileno(), 2)
    cfg = TinyGPT(pp=2, dp=2, num_layers=4, hidden=32, seq=16, num_microbatches=4)
    return run_dp_iterations(cfg, DPCase(iterations=4), schedule="zb-h1", timeout=TIMEOUT_S,
                             wait_policy=WaitPolicy.STREAM)


def test_stream_policy_watchdog_names_the_late_reduce_and_ends_the_blocked_rank(tmp_path):
    """NCCL's policy end to end (on gloo): iteration 1 runs with no host wait of ours; in iteration 2
    (no trainer: the runtime names its count of training calls) rank 1 freezes before its first
    reduce, and rank 0, blocked in megatron-core's wait, is ended by the watchdog with the named message."""
    from megatron_zb.runtime.peer_wait import EXIT_GRACE_S
    from megatron_zb.testing import run_distributed
    from megatron_zb.testing.distributed import DistributedTimeout

    # which failure the launcher reports first is a race: rank 0's exit, or the error a peer of rank 0 gets
    # when its connections close (gloo: "Connection closed by peer")
    with pytest.raises(RuntimeError) as info:
        run_distributed(_stream_policy_rank, world_size=4, args=("1:2", str(tmp_path)), timeout=90, grace=2.0)
    ended = time.time()
    assert not isinstance(info.value, DistributedTimeout), info.value
    frozen = (tmp_path / "rank1.err").read_text()
    m = re.search(r"rank 1 freezes at ([\d.]+) before its first data-parallel reduce of iteration 2", frozen)
    assert m, frozen[-3000:]
    waited = ended - float(m.group(1))
    # the timeout, one watchdog period (timeout / 4), the watchdog's grace, the launcher's grace
    assert TIMEOUT_S <= waited <= TIMEOUT_S * 1.25 + EXIT_GRACE_S + 2.0 + 8.0, waited
    err = (tmp_path / "rank0.err").read_text()
    assert re.search(r"PipelineTimeoutError: rank 0: data-parallel all-reduce of stage 0, bucket \d+ \(training call 2\) "
                     rf"with peer rank 1 did not complete within {TIMEOUT_S:g} s", err), err[-3000:]
    assert "ending the process (exit status 1)" in err, err[-3000:]  # printed just before os._exit(1)
    assert re.search(r"\nerror: rank 0 waited for rank 1 \(frozen or slow\): data-parallel all-reduce of stage 0, "
                     r"bucket \d+ \(training call 2\) did not complete", err), err[-3000:]

"""The p2p layer's waits, send releases, memory accounting and hot path (issue 29).

Most tests drive :class:`~megatron_zb.runtime.p2p.PipeComm` with fake ``Work`` objects (test
doubles: a never-completing NCCL transfer cannot be produced on CPU) and record how each wait is
called; the hot-path test runs a real two-process gloo iteration.
"""

from __future__ import annotations

import datetime
import time
from functools import partial
from types import SimpleNamespace

import pytest
import torch

import megatron_zb  # noqa: F401  (CPU shim)
from megatron_zb.runtime.comm_program import Step
from megatron_zb.runtime.memory import ActivationMemoryTracker
from megatron_zb.runtime.channels import Channels
from megatron_zb.runtime.p2p import PipeComm, PipelineTimeoutError, WaitPolicy
from megatron_zb.runtime.rank_plan import plan_rank
from megatron_zb.schedules import Action, Op
from megatron_zb.schedules.registry import build_schedule
from megatron_zb.testing import run_distributed
from harness.hot_path import count_host_syncs


class FakeWork:
    """A test double of ``torch.distributed.Work``: completes when told to (``done``), records
    every ``wait`` call's arguments; an unfinished timed wait returns False as gloo's would fail."""

    def __init__(self, log: list, done: bool = False) -> None:
        self.log, self.done = log, done

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.log.append(("wait", timeout))
        return self.done or timeout is None

    def is_completed(self) -> bool:
        return self.done


@pytest.fixture
def fake_dist(monkeypatch):
    """Replace isend / irecv in the p2p module by fake works; returns (log, works in issue order)."""
    from megatron_zb.runtime import p2p

    log, works = [], []

    def issue(kind):
        def f(tensor, *args, **kwargs):
            works.append(FakeWork(log))
            log.append((kind, kwargs.get("group")))
            return works[-1]
        return f

    monkeypatch.setattr(p2p, "dist", SimpleNamespace(isend=issue("isend"), irecv=issue("irecv")))
    return log, works


def _comm(policy: WaitPolicy, *, timeout: float = 5.0, **kw) -> PipeComm:
    groups = {("p2p", a, b, slot): f"group({a}, {b}) slot {slot}" for a, b in ((0, 1), (1, 0)) for slot in (0, 1)}
    return PipeComm(channels=Channels([10, 11], [10, 11], "fake", timeout=timeout, groups=groups), rank=0,
                    timeout=timeout, policy=policy, **kw)


RECV_B = Action(Op.RECV_B, 0, 1, peer=1)
SEND_F = Action(Op.SEND_F, 0, 0, peer=1)


def test_wait_policy_follows_the_backend():
    assert WaitPolicy.for_backend("nccl") is WaitPolicy.STREAM
    assert WaitPolicy.for_backend("cpu:gloo,cuda:nccl") is WaitPolicy.STREAM
    assert WaitPolicy.for_backend("gloo") is WaitPolicy.HOST


def test_sends_and_receives_use_the_communicator_of_their_direction_and_slot(fake_dist):
    log, _ = fake_dist
    comm = _comm(WaitPolicy.HOST)
    comm.post_recv(RECV_B, (2, 3), torch.float32, torch.device("cpu"))
    comm.send(SEND_F, torch.zeros(2, 3))
    comm.send(Action(Op.SEND_F, 1, 0, peer=1), torch.zeros(2, 3), slot=1)
    assert log == [("irecv", "group(1, 0) slot 0"), ("isend", "group(0, 1) slot 0"), ("isend", "group(0, 1) slot 1")]


def test_host_policy_waits_with_the_timeout_and_names_a_late_transfer(fake_dist):
    log, works = fake_dist
    comm = _comm(WaitPolicy.HOST, timeout=7.0)
    comm.post_recv(RECV_B, (2,), torch.float32, torch.device("cpu"))
    with pytest.raises(PipelineTimeoutError, match=r"pipeline rank 0: receive for RECV_B\(mb=0, stage=1, peer=1\) "
                                                    r"with peer rank 1 did not complete within 7 s") as info:
        comm.wait_recv(RECV_B)
    assert ("wait", datetime.timedelta(seconds=7.0)) in log
    # whom to look at, in global ranks (the pipeline group's ranks are 10 and 11 here)
    blame = info.value.blame
    assert blame.startswith("rank 10 (pipeline rank 0) waited for rank 11 (pipeline rank 1) (frozen or slow): receive "
                            "for RECV_B(mb=0, stage=1, peer=1) did not complete within 7 s; look at rank 11 (pipeline "
                            "rank 1), not at the rank torchrun names"), blame


def test_stream_policy_never_waits_on_the_host(fake_dist):
    """NCCL: ``Work.wait()`` without a timeout (only the compute stream waits)."""
    log, works = fake_dist
    comm = _comm(WaitPolicy.STREAM)
    comm.post_recv(RECV_B, (2,), torch.float32, torch.device("cpu"))
    comm.send(SEND_F, torch.zeros(2))
    comm.wait_recv(RECV_B)
    comm.release(SEND_F)
    comm.finish()
    assert [e for e in log if e[0] == "wait"] == [("wait", None), ("wait", None)]


def test_stream_policy_watchdog_raises_the_named_error_at_the_next_p2p_call(fake_dist, capsys):
    _, works = fake_dist
    comm = _comm(WaitPolicy.STREAM, timeout=0.2)
    assert comm._watchdog.period == pytest.approx(0.05)   # min(5 s, timeout / 4)
    comm.post_recv(RECV_B, (2,), torch.float32, torch.device("cpu"))   # never completes
    deadline = time.monotonic() + 5
    while comm._watchdog.error is None and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(PipelineTimeoutError, match=r"receive for RECV_B\(mb=0, stage=1, peer=1\) with peer rank 1 "
                                                    r"did not complete within 0.2 s"):
        comm.send(SEND_F, torch.zeros(2))
    assert "PipelineTimeoutError" in capsys.readouterr().err   # printed at once, too
    comm.abort()


def test_stream_policy_watchdog_is_quiet_while_transfers_complete(fake_dist):
    _, works = fake_dist
    comm = _comm(WaitPolicy.STREAM, timeout=0.2)
    comm.post_recv(RECV_B, (2,), torch.float32, torch.device("cpu"))
    works[-1].done = True
    time.sleep(0.4)
    assert comm._watchdog.error is None
    comm.wait_recv(RECV_B)
    comm.finish()


def test_a_send_is_dropped_once_it_completes(fake_dist):
    _, works = fake_dist
    comm = _comm(WaitPolicy.HOST)
    comm.send(SEND_F, torch.zeros(2))
    assert comm.held_sends == 1
    works[-1].done = True
    comm.send(Action(Op.SEND_F, 1, 0, peer=1), torch.zeros(2))    # the next p2p call reaps it
    assert comm.held_sends == 1


@pytest.mark.parametrize("name,p", [("zb-h2", 4), ("zbv", 4), ("interleaved-zb", 4), ("1f1b", 2)])
def test_never_completing_sends_stay_within_the_plan_bound(fake_dist, name, p):
    """Walk each rank's program with transfers that never complete: the held sends never exceed the
    plan's bound, and the first release that cannot complete fails naming that send."""
    _, works = fake_dist
    sched = build_schedule(name, num_ranks=p, num_microbatches=2 * p)
    for rank in range(p):
        plan = plan_rank(sched, rank=rank)
        groups = {c: c for c, _ in plan.communicators}
        comm = PipeComm(channels=Channels(range(p), range(p), "fake", timeout=1.0, groups=groups), rank=rank,
                        timeout=1.0, policy=WaitPolicy.HOST, max_outstanding_sends=plan.program.max_outstanding_sends)
        most = 0
        for s in plan.program.issues:
            if s.step is Step.SEND:
                comm.send(s.action, torch.zeros(1), slot=s.slot)
                most = max(most, comm.held_sends)
            elif s.step is Step.RELEASE:
                with pytest.raises(PipelineTimeoutError, match=f"send for {s.action}".replace("(", r"\(").replace(")", r"\)")):
                    comm.release(s.action)
        assert most <= plan.program.max_outstanding_sends
        comm.abort()


def test_the_p2p_bound_is_enforced(fake_dist):
    comm = _comm(WaitPolicy.HOST, max_outstanding_sends=1)
    comm.send(SEND_F, torch.zeros(2))
    with pytest.raises(RuntimeError, match="2 sends held, above the plan's bound of 1"):
        comm.send(Action(Op.SEND_F, 1, 0, peer=1), torch.zeros(2))


def test_receive_buffers_take_the_device_they_are_given(fake_dist):
    comm = _comm(WaitPolicy.STREAM)
    comm.post_recv(RECV_B, (4, 2), torch.bfloat16, torch.device("meta"))
    buf = comm._recvs[(Op.RECV_B, 0, 1)].tensor
    assert buf.device.type == "meta" and buf.dtype == torch.bfloat16 and tuple(buf.shape) == (4, 2)
    comm.abort()


def test_p2p_buffers_are_counted_apart_and_become_activations_when_saved(fake_dist):
    """A receive buffer counts as p2p bytes until a forward saves it; a sent tensor until it is freed.
    Sizes worked by hand: 6 float32 = 24 bytes, 4 float32 = 16 bytes; ``buf * w`` saves ``buf`` only
    (the gradient of ``w``; ``buf`` needs none)."""
    tracker = ActivationMemoryTracker()
    comm = _comm(WaitPolicy.HOST, memory=tracker)
    comm.post_recv(RECV_B, (2, 3), torch.float32, torch.device("cpu"))
    assert (tracker.p2p_bytes, tracker.current_bytes) == (24, 0)
    _, works = fake_dist
    works[-1].done = True
    buf = comm.wait_recv(RECV_B)
    w = torch.ones(2, 3, requires_grad=True)
    with tracker.saving():
        y = (buf * w).sum()            # the buffer becomes an activation
    assert (tracker.p2p_bytes, tracker.current_bytes) == (0, 24)
    assert [n for _, n in tracker.events] == [24]   # logged once, when saved (not when posted)
    sent = torch.zeros(4)
    comm.send(SEND_F, sent)
    assert tracker.p2p_bytes == 16 and tracker.peak_total_bytes == 40
    works[-1].done = True
    comm.finish()
    del sent
    assert tracker.p2p_bytes == 0 and tracker.peak_bytes == 24
    del y


def _token_counter_device(device: str) -> str:
    """The executor's token counter is created on the runtime's device (megatron-core: on the GPU)."""
    from megatron.core.enums import ModelType

    from megatron_zb.runtime.executor import StageRuntime, IterationState
    from megatron_zb.runtime.wgrad_store import WeightGradStore

    chunk = torch.nn.Linear(1, 1)
    chunk.model_type = ModelType.encoder_or_decoder
    plan = plan_rank(build_schedule("1f1b", num_ranks=1, num_microbatches=1), rank=0)
    rt = StageRuntime(chunks={0: chunk}, data_iterators={0: None}, tensor_shape=(1,), dtype=torch.float32,
                      device=torch.device(device))
    it = IterationState(plan=plan, runtime=rt, store=WeightGradStore(), forward_step_func=None, config=None,
                    collect_non_loss_data=False, cp_group_size=1, first_val_step=None, memory=None)
    return it.total_tokens.device.type


def test_token_counter_follows_the_runtime_device():
    assert _token_counter_device("meta") == "meta"
    assert _token_counter_device("cpu") == "cpu"


@pytest.fixture(scope="module")
def megatron_core_syncs() -> list[dict]:
    """The same counts for megatron-core's own 1F1B (the baseline a GPU user runs today)."""
    return run_distributed(partial(count_host_syncs, None), world_size=2, timeout=120)


@pytest.mark.parametrize("schedule", ["zb", "zbv"])
def test_hot_path_has_no_host_sync_per_action(schedule, megatron_core_syncs):
    """One real iteration (PP=2, gloo) with NCCL's wait policy: megatron-zb's code calls no
    ``.item()`` / ``.cpu()`` / ``.tolist()`` / ``synchronize()`` and no timed wait; every p2p wait
    is a stream wait; megatron-core's own calls (its RNG tracker compares CPU generator states,
    which does not wait for a GPU) are no more than under its own 1F1B schedule."""
    ranks = run_distributed(partial(count_host_syncs, schedule), world_size=2, timeout=120)
    for r, got in enumerate(ranks):
        counts = got["counts"]
        assert got["compute_actions"] > 0
        for name in ("item", "cpu", "tolist", "synchronize"):
            assert counts.get(f"{name} in megatron_zb", 0) == 0, (r, name, counts)
        assert counts.get("timed wait", 0) == 0 and counts.get("stream wait", 0) > 0, (r, counts)
        others = {k: v for k, v in counts.items() if " in " in k and not k.endswith("megatron_zb")}
        base = megatron_core_syncs[r]["counts"]
        for k, v in others.items():
            assert v <= base.get(k, 0) * (2 if schedule == "zbv" else 1), (r, k, v, base)

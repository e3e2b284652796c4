"""The calls real runs make, recorded on gloo, replayed under the NCCL model (issue 39).

The certificate (``test_nccl_semantics.py``) covers the programs the runtime plans; these tests cover
what the runtime then does: every ``torch.distributed`` call of real training iterations on gloo
processes -- the warm-up, the p2p, the vocabulary collectives, megatron-core's own calls -- recorded by
:mod:`harness.nccl_record` with the communicators NCCL would use, and replayed under every
rule at once (lazy creation, one hardware queue, unbuffered sends; two host threads refused).

The control: megatron-core's own 1F1B and interleaved schedules (with and without
``overlap_p2p_comm``) replay clean -- were they not to, the model would be wrong, not megatron-core.
The negative control: the runtime made to skip its certificate (``validate=False``: one communicator
per direction) hangs where the plan-level model said it would.
"""

from __future__ import annotations

from functools import partial

import pytest

from megatron_zb.runtime.nccl_model import ALL_RULES, Kind, Rules, calls_of, replay
from megatron_zb.testing.distributed import run_distributed
from harness.nccl_record import record_calls, record_run
from megatron_zb.testing.tiny_gpt import TinyGPT


def _record(pp: int, **kwargs) -> dict[int, list]:
    cfg = TinyGPT(pp=pp, schedule_options=kwargs.pop("schedule_options", {}))
    calls = run_distributed(partial(record_run, cfg, **kwargs), world_size=pp, timeout=240)
    return dict(enumerate(calls))


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("interleaved,overlap", [(False, False), (True, False), (True, True)],
                         ids=["1f1b", "interleaved", "interleaved-overlap-p2p"])
def test_megatron_cores_own_schedules_replay_clean(pp, interleaved, overlap):
    calls = _record(pp, schedule=None, interleaved=interleaved, overlap_p2p_comm=overlap)
    p2p = sum(1 for cs in calls.values() for e in cs for c in calls_of(e) if c.kind in (Kind.SEND, Kind.RECV))
    assert p2p >= 2 * 4 * (pp - 1)   # two iterations of 4 microbatches: the run really talked
    res = replay(calls, ALL_RULES)
    assert res.completed and not res.mismatches, res.describe()


@pytest.mark.parametrize("schedule,pp,vocab", [("zb", 2, False), ("zbv", 2, False), ("interleaved-zb", 2, False),
                                               ("v-half", 2, False), ("zbv-vocab-1", 2, True),
                                               ("zb", 4, False), ("zbv", 4, False)])
def test_megatron_zbs_recorded_calls_replay_clean(schedule, pp, vocab):
    calls = _record(pp, schedule=schedule, vocab=vocab)
    res = replay(calls, ALL_RULES)
    assert res.completed and not res.mismatches, res.describe()
    creations = [c for cs in calls.values() for e in cs for c in calls_of(e) if c.kind is Kind.CREATE]
    assert creations  # new_group's rendezvous are in the record (the warm-up's groups among them)


@pytest.mark.parametrize("schedule", [None, "zb", "zbv"])
def test_tensor_and_data_parallel_collectives_replay_clean(schedule):
    """The collectives outside the programs: at TP=2 x PP=2 the tensor-parallel all-reduces inside F, B and
    W; at PP=2 x DP=2 with --overlap-grad-reduce and the distributed optimizer the bucket reduces launched
    from W (megatron-core's own 1F1B: from its hooks), the parameter all-gathers and the optimizer's
    reductions (grad norm, clipping) -- three iterations, recorded with the pipeline's calls."""
    from harness.dp_overlap import DPCase, run_dp_iterations
    from megatron_zb.testing.tiny_gpt import run_step

    tp = run_distributed(partial(record_calls, run_step, TinyGPT(pp=2, tp=2), schedule=schedule), world_size=4,
                         timeout=240)
    case = DPCase(overlap_grad_reduce=True, overlap_param_gather=True, use_distributed_optimizer=True)
    dp = run_distributed(partial(record_calls, run_dp_iterations, TinyGPT(pp=2, dp=2), case, schedule=schedule),
                         world_size=4, timeout=240)
    for what, calls in (("TP=2", tp), ("DP=2", dp)):
        colls = sum(1 for cs in calls for e in cs for c in calls_of(e) if c.kind is Kind.COLL)
        assert colls > 8, what
        res = replay(dict(enumerate(calls)), ALL_RULES)
        assert res.completed and not res.mismatches, f"{what}: {res.describe()}"


SHARDED_ARGV = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "2", "--lr", "2e-3",
                "--mock-data", "--num-workers", "0", "--log-interval", "1", "--eval-iters", "0",
                "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--tokenizer-type", "NullTokenizer",
                "--vocab-size", "127", "--distributed-backend", "gloo", "--pipeline-model-parallel-size", "2",
                "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                "--ddp-bucket-size", "4096", "--data-parallel-sharding-strategy", "optim_grads"]
"""tests/training/test_sharded_grads.py's GPT (4 layers, PP=2 x DP=2, 4 micro batches per data-parallel rank, dropout
on as users run it) with sharded gradients and the distributed optimizer's overlapped reduce and gather."""


@pytest.mark.parametrize("schedule,k", [("--enable-zero-bubble", 1), ("--zero-bubble-v-schedule", 2)],
                         ids=["zb-k1", "zbv-k2"])
def test_sharded_gradient_runs_replay_clean(schedule, k):
    """``pretrain_gpt_zb.py`` with sharded gradients (``optim_grads``) at PP=2 x DP=2, buckets of 4096 elements,
    two iterations: each bucket's asynchronous reduce-scatter on the data-parallel communicator launched from
    W between the pipeline's sends and receives, the waits for a work buffer, the distributed optimizer's
    parameter all-gathers -- replayed with lazy creation and one hardware queue, as NCCL would run them."""
    from harness.nccl_record import record_trainer

    argv = SHARDED_ARGV + [schedule, "--zero-bubble-wgrad-group", str(k)]
    calls = run_distributed(partial(record_trainer, argv), world_size=4, timeout=300)
    scatters = sum(1 for cs in calls for e in cs for c in calls_of(e) if c.kind is Kind.COLL
                   and "reduce_scatter" in str(c))
    assert scatters >= 2 * 4 // k  # m / k per bucket per iteration: the run really reduced from W
    res = replay(dict(enumerate(calls)), ALL_RULES)
    assert res.completed and not res.mismatches, res.describe()


def test_the_uncertified_runtime_hangs_where_the_model_said():
    """interleaved-zb at PP=2, m=4, default look-ahead, on one communicator per direction (the certificate
    skipped): the recorded calls complete with a stream per communicator and hang on one hardware queue --
    a second send of a direction queued before the receive the peer's first send needs."""
    calls = _record(2, schedule="interleaved-zb", schedule_options={"validate": False})
    assert replay(calls, Rules(lazy_init=True)).completed
    res = replay(calls, Rules(one_queue=True))
    assert not res.completed and "waits for its predecessor send" in res.describe()

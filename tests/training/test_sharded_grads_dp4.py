"""Sharded gradients at PP=2 x DP=4 (8 processes, one launch of 10 runs): the acceptance case issue 42 allows
outside CI, and every family with every group size of 1, m/2 and m.

Skipped unless ``MEGATRON_ZB_TEST_DP4=1`` (8 gloo processes beside CI's other suite on 2 cores take minutes; the
PP=2 x DP=2 cases of ``test_sharded_grads.py`` run in CI). Command (about 50 s on an idle 2-core machine)::

    MEGATRON_ZB_TEST_DP4=1 python -m pytest tests/training/test_sharded_grads_dp4.py

The GPT and flags are ``test_sharded_grads.py``'s (dropout off there for the same reason), with 32 samples per
iteration: 4 micro batches of 2 per data-parallel rank, as at DP=2. Every run against megatron-core's 1F1B
with the distributed optimizer under the same flags, every iteration's loss and grad norm: zb, ZB-V and
interleaved-zb each with K = 1, 2 and 4 (1, m/2, m), buckets of 4096 elements, within
``test_sharded_grads.RTOL`` (the shard sums the groups' reductions; megatron-core buckets only the first
stage); and the reduce-scatters per bucket per iteration, ``m / K``. (bf16 is tested at DP=2.)
"""

from __future__ import annotations

import os

import pytest
from test_sharded_grads import BASE, BUCKETS, M, RTOL, SHARDED, _group

from harness.trainer_run import in_process_many

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.skipif(os.environ.get("MEGATRON_ZB_TEST_DP4") != "1",
                                 reason="8 processes: run outside CI with MEGATRON_ZB_TEST_DP4=1")]

DP4 = [*BASE, "--global-batch-size", "32", "--distributed-timeout-minutes", "5", "--pipeline-timeout-seconds", "240"]
FAMILIES = {"zb": ["--enable-zero-bubble"], "zbv": ["--zero-bubble-v-schedule"],
            "interleaved-zb": ["--schedule", "interleaved-zb"]}
RUNS = {"megatron-core": ["--use-megatron-core-schedule", *BUCKETS],
        **{f"{name} x{k}": [*flags, *_group(k), *SHARDED, *BUCKETS] for name, flags in FAMILIES.items() for k in (1, 2, 4)}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("sharded_dp4")
    return in_process_many(tmp, {n: DP4 + f for n, f in RUNS.items()}, 8, timeout=1800)


@pytest.mark.parametrize("name", [n for n in RUNS if not n.startswith("megatron-core")])
def test_sharded_gradients_at_dp4_train_as_megatron_core(runs, name):
    got, ref = runs[name]["values"]["train"], runs["megatron-core"]["values"]["train"]
    assert [r["iteration"] for r in got] == [1, 2, 3] == [r["iteration"] for r in ref]
    for a, b in zip(got, ref):
        for key in ("lm loss", "grad norm"):
            assert a[key] == pytest.approx(b[key], rel=RTOL, abs=0), f"{name} iteration {a['iteration']} {key}"


@pytest.mark.parametrize("name,k", [(f"{name} x{k}", k) for name in FAMILIES for k in (1, 2, 4)])
def test_each_bucket_is_reduce_scattered_m_over_k_times_at_dp4(runs, name, k):
    """Rank 0's last iteration, per chunk: a bucket holding weights W adds into ``m / K`` times, each its whole
    (padded) size; a bucket without such weights once."""
    run = runs[name]
    for reduces, buckets, weights in zip(run["reduces"], run["buckets"], run["bucket_weights"]):
        counts = {i: sum(1 for b, _ in reduces if b == i) for i in range(len(buckets))}
        assert counts == {i: M // k if weights[i] else 1 for i in range(len(buckets))}, (name, reduces)
        assert all(n == buckets[b] for b, n in reduces)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_final_parameters_at_dp4_are_megatron_cores(runs, k):
    """zb (the plain placement: megatron-core's chunks): every rank's parameters after the run within ``RTOL`` of
    the largest magnitude of each parameter."""
    for rank, (got, ref) in enumerate(zip(runs[f"zb x{k}"]["final_params"], runs["megatron-core"]["final_params"])):
        assert got.keys() == ref.keys(), rank
        for key, p in got.items():
            q = ref[key].double()
            assert (p.double() - q).abs().max().item() <= RTOL * q.abs().max().item(), (k, rank, key)

"""The planner's prediction in ``python -m megatron_zb.bench zero2`` (megatron_zb/bench/zero2_predict.py), from a
written profile and given reduce-scatter times (the benchmark measures both; pure Python here)."""

from __future__ import annotations

import pytest

from megatron_zb.bench.zero2_predict import cpu_hardware, predict
from megatron_zb.planning.model import make_model, make_parallel
from megatron_zb.planning.profile import StageProfile, write_profile
from megatron_zb.planning.sharded import ring_reduce_scatter
from megatron_zb.schedules.registry import build_schedule

BUCKET = 4096


def test_the_measured_reduce_scatter_is_what_the_model_times():
    """1 element in 0.5 ms, a bucket of 4096 fp32 elements (16384 bytes) in 1.5 ms: the ring over 2 ranks then
    takes 0.5 ms + 16384 bytes / 16384 bytes per ms = 1.5 ms for a bucket."""
    hw = cpu_hardware(0.5, 1.5, 4.0 * BUCKET)
    model = make_model(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=1,
                       vocab_size=128)
    bandwidth, latency = ring_reduce_scatter(make_parallel(model, pp=2, dp=2, num_microbatches=4), hw)
    assert latency == pytest.approx(0.5) and latency + 4.0 * BUCKET / bandwidth == pytest.approx(1.5)


def _profile(path, step_ms: float):
    model = make_model(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, micro_batch_size=1,
                       vocab_size=128, precision="bf16", add_bias_linear=False,
                       untie_embeddings_and_output_weights=True, transformer_impl="local")
    par = make_parallel(model, pp=2, dp=2, num_microbatches=8, use_distributed_optimizer=True)
    write_profile(path, model=model, parallel=par, schedule="zb", placement="plain", stage_to_rank=[0, 1],
                  t_comm_ms=0.1, stages=[StageProfile(10.0, 10.0, 8.0, mem_b_bytes=1e6, mem_w_bytes=5e5)] * 2,
                  step_ms=step_ms)


@pytest.mark.parametrize("slow", [False, True])
def test_rows_per_group_and_a_slow_channel_slows_small_groups(tmp_path, slow):
    """Rows: the distributed optimizer, then each K. With reduce-scatters far longer than a bucket's W (slow),
    K = 1 waits for its work buffers in every group and is predicted several times slower than K = 8; with fast
    ones K = 1 is not slower (K = 8 moves every W to the stage's last, filling less of the bubble). The
    measured time outside the schedule (50 ms) is in every row but where the reduce already exposes more."""
    path = tmp_path / "p.json"
    _profile(path, step_ms=50.0)
    sched = build_schedule("zb", num_ranks=2, num_microbatches=8)
    reduce_ms = (0.01, 20.0) if slow else (0.001, 0.002)
    rows = predict(str(path), sched, bucket_elements=BUCKET, groups=(1, 8), reduce_ms=reduce_ms)
    assert [r.k for r in rows] == [None, 1, 8]
    k1, k8 = rows[1].iteration_time_ms, rows[2].iteration_time_ms
    if slow:
        assert k1 > 3 * k8
    else:
        assert all(r.iteration_time_ms == pytest.approx(r.result.makespan + 50.0, abs=0.1) for r in rows)
        assert k1 <= k8

"""Peak memory of an iteration, megatron-zb against megatron-core's own 1F1B (issue 22).

:class:`~harness.live_memory.LiveTensorBytes` counts every tensor an iteration creates
(activations, stage outputs, gradients, p2p buffers) on CPU, under megatron-core's schedule and
under megatron-zb's alike. Tiny GPT (hidden 64, seq 32, micro batch 2: one stage tensor is
32 * 2 * 64 * 4 = 16384 bytes), m = 2p, Megatron-LM's ``deallocate_pipeline_outputs``.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

import megatron_zb  # noqa: F401  (CPU shim)
from megatron_zb.testing import run_distributed
from harness.live_memory import LiveTensorBytes, peak_iteration_bytes
from megatron_zb.testing.tiny_gpt import TinyGPT

STAGE_TENSOR_BYTES = 32 * 2 * 64 * 4
"""One hidden-state tensor between stages of TinyGPT (seq x micro batch x hidden, fp32) [bytes]."""


def test_live_tensor_bytes_counts_storages_once_until_freed():
    with LiveTensorBytes() as live:
        a = torch.zeros(1000)            # 4000 bytes
        view = a[:10]                    # a view: same storage, nothing more
        b = torch.ones(500)              # 2000 bytes -> 6000 held
        del a, view
        c = torch.empty(250)             # 1000 bytes -> 3000 held
    assert (live.peak, live.current) == (6000, 3000)
    del b, c
    assert live.current == 0


@pytest.mark.parametrize("pp", [2, 4])
def test_peak_memory_against_megatron_core_1f1b(pp):
    """megatron-zb's 1F1B at the default receive look-ahead: within 1% of megatron-core 1F1B's peak
    on every rank (issue 22's acceptance; measured 1.000-1.005: one stage tensor more on some ranks,
    a receive posted one compute action ahead or a forward's output kept by its send until the
    send is released, where megatron-core's blocking send lets go at once). ZB-H1: its largest rank
    peak within 5% of megatron-core 1F1B's largest (the zero-bubble paper's claim for ZB-H1:
    1F1B's peak memory)."""
    cfg = TinyGPT(pp=pp, num_microbatches=2 * pp)
    runs = {s: run_distributed(partial(peak_iteration_bytes, cfg, s), world_size=pp, timeout=120)
            for s in (None, "1f1b", "zb-h1")}
    base = runs[None]
    print(f"PP={pp} peak bytes per rank:", runs)
    for rank, (ours, theirs) in enumerate(zip(runs["1f1b"], base)):
        assert ours <= 1.01 * theirs, (rank, ours, theirs)
        assert ours - theirs <= STAGE_TENSOR_BYTES, (rank, ours, theirs)  # at most one stage tensor more
        assert ours >= 0.99 * theirs, (rank, ours, theirs)  # the same work: not less either
    assert max(runs["zb-h1"]) <= 1.05 * max(base), (runs["zb-h1"], base)

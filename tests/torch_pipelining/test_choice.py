"""``auto``'s candidate families (megatron_zb/torch_pipelining/choice.py), read from the registry."""

from __future__ import annotations

from megatron_zb.schedules import Placement, Schedule
from megatron_zb.schedules.catalog import SCHEDULES, register
from megatron_zb.schedules.registry import get_spec
from megatron_zb.torch_pipelining.choice import candidates


def test_candidates_are_the_registered_families_fused_first():
    assert candidates(Placement.PLAIN) == ("1f1b", "zb-h1", "zb-1p")
    assert candidates(Placement.V) == ("1f1b-v", "zbv")   # registered after zbv, fused: first
    assert candidates(Placement.INTERLEAVED) == ("interleaved-1f1b", "interleaved-zb")


def test_a_family_registered_as_candidate_is_compared():
    def build(**kw: object) -> Schedule:
        return get_spec("zb-2p").build(**kw)

    register("test-auto", "zb-2p again", placement=Placement.PLAIN, split_backward=True, cost_aware=True,
             torch_auto_candidate=True)(build)
    try:
        assert candidates(Placement.PLAIN) == ("1f1b", "zb-h1", "zb-1p", "test-auto")
    finally:
        SCHEDULES.pop("test-auto")

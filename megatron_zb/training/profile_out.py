"""``--profile-out FILE``: the profiling window's measured costs as a planning profile
(:mod:`megatron_zb.planning.profile`, what ``megatron-zb plan --profile FILE`` reads), and the one
derivation of the planner's model and layout from a run's :class:`RunConfig`.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from megatron_zb.planning.profile import ActionTimes
from megatron_zb.schedules.ir import Placement
from megatron_zb.schedules.registry import get_spec
from megatron_zb.training.logging_utils import print_rank_0
from megatron_zb.training.profiling import AgreedProfile
from megatron_zb.training.run_config import RunConfig

__all__ = ["planning_model", "planning_parallel", "write_profile_out"]


def write_profile_out(config: RunConfig, agreed: AgreedProfile, times: ActionTimes, *, stage_to_rank: list[int],
                      device_type: str) -> None:
    """``--profile-out``: global rank 0 writes the measured costs as a planning profile, with
    ``times`` (every op's host and device time, the host-bound flags) as its ``action_times``."""
    if dist.get_rank() != 0:
        return
    from megatron_zb.planning.model import PlanError
    from megatron_zb.planning.profile import StageProfile, write_profile
    c, stages = config, config.schedule.num_pipeline_stages
    out = c.schedule.profile_out
    acts = agreed.activation_bytes(stages)
    if acts is None or not agreed.split_backward(stages):
        print_rank_0(f"WARNING: --profile-out {out} not written: T_B, T_W and the activation "
                     f"bytes were not measured for every stage")
        return
    medians = [agreed.per_stage(op, stages) for op in ("F", "B", "W")]  # the compute alone (the overhead: a key)
    rows = [StageProfile(t_f_ms=f, t_b_ms=b, t_w_ms=w, mem_b_bytes=mb, mem_w_bytes=mw)
            for f, b, w, mb, mw in zip(*medians, *acts)]
    try:
        write_profile(out, model=planning_model(c), parallel=planning_parallel(c),
                      schedule=c.schedule.name, placement=get_spec(c.schedule.name).placement,
                      stage_to_rank=stage_to_rank, t_comm_ms=agreed.t_comm, stages=rows,
                      device=device_type, step_ms=agreed.step_ms,
                      action_overhead_ms=agreed.action_overhead_ms, duration_spread=agreed.spread,
                      action_times=times)
    except (OSError, PlanError) as e:
        print_rank_0(f"WARNING: --profile-out {out} not written: {e}")
        return
    print_rank_0(f"    wrote the measured costs to {out} (--profile-out; "
                 f"read by: megatron-zb plan --profile {out})")


def planning_model(config: RunConfig) -> Any:
    """The planner's :class:`~megatron_zb.planning.model.PlanModel` of the run's model: the one
    derivation of the planner's model from a :class:`RunConfig` (``planning/`` imports no torch, so
    it cannot take the ``RunConfig`` itself; ``megatron-zb plan`` builds the same from its flags)."""
    from megatron_zb.planning.model import make_model
    m, p = config.model, config.precision
    return make_model(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        seq_length=m.seq_length, micro_batch_size=config.micro_batch_size, vocab_size=m.vocab_size,
        ffn_hidden_size=m.ffn_hidden_size, num_query_groups=m.num_query_groups,
        group_query_attention=m.num_query_groups is not None, kv_channels=m.kv_channels, swiglu=m.swiglu,
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
        position_embedding_type=m.position_embedding_type, max_position_embeddings=m.max_position_embeddings,
        normalization=m.normalization, add_bias_linear=m.add_bias_linear, hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout, transformer_impl=m.transformer_impl,
        precision="fp16" if p.fp16 else "bf16" if p.bf16 else "fp32")


def planning_parallel(config: RunConfig) -> Any:
    """The planner's :class:`~megatron_zb.planning.model.PlanLayout` of the run's layout (with
    :func:`planning_model`, the one derivation)."""
    from megatron_zb.planning.model import make_parallel
    par, sched = config.parallel, config.schedule
    return make_parallel(
        planning_model(config), pp=par.pipeline_model_parallel_size, tp=par.tensor_model_parallel_size,
        dp=par.data_parallel_size, num_microbatches=config.num_microbatches, sequence_parallel=par.sequence_parallel,
        use_distributed_optimizer=par.use_distributed_optimizer, allow_padding_num_layers=par.allow_padding_num_layers,
        num_virtual_stages=sched.num_model_chunks if get_spec(sched.name).placement == Placement.INTERLEAVED else None,
        decoder_first_pipeline_num_layers=par.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=par.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=par.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=par.account_for_loss_in_pipeline_split)

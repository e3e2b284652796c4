"""Model construction: megatron-core GPT chunks for any pipeline placement."""

from megatron_zb.model.gpt_chunks import (
    ChunkPlan,
    GPTChunk,
    SeededTransformerLayer,
    build_gpt_chunks,
    cpu_gpt_config,
    derive_seed,
    global_param_name,
    named_global_parameters,
    plan_chunks,
    split_layers,
)

__all__ = [
    "ChunkPlan",
    "GPTChunk",
    "SeededTransformerLayer",
    "build_gpt_chunks",
    "cpu_gpt_config",
    "derive_seed",
    "global_param_name",
    "named_global_parameters",
    "plan_chunks",
    "split_layers",
]

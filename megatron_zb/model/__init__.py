"""Model construction: megatron-core GPT chunks for any pipeline placement."""

from megatron_zb.model.gpt_chunks import (
    ChunkPlan,
    GPTChunk,
    SeededTransformerLayer,
    TiedHeadGPTModel,
    build_gpt_chunks,
    chunk_config,
    cpu_gpt_config,
    derive_seed,
    global_param_name,
    named_global_parameters,
    pipeline_split,
    plan_chunks,
    split_layers,
    tie_output_layer,
)

__all__ = [
    "ChunkPlan",
    "GPTChunk",
    "SeededTransformerLayer",
    "TiedHeadGPTModel",
    "build_gpt_chunks",
    "chunk_config",
    "cpu_gpt_config",
    "derive_seed",
    "global_param_name",
    "named_global_parameters",
    "pipeline_split",
    "plan_chunks",
    "split_layers",
    "tie_output_layer",
]

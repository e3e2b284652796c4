"""megatron-zb: zero-bubble pipeline parallelism for megatron-core."""

__version__ = "0.1.0"


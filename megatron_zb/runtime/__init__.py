"""The zero-bubble runtime: weight-gradient store, p2p, executor, drop-in forward_backward_func."""

from .forward_backward import ZeroBubbleForwardBackward, ZeroBubbleOptions, get_forward_backward_func
from .memory import ActivationMemoryTracker
from .p2p import PipelineTimeoutError
from .wgrad_store import WeightGradStore, WeightGradStoreError, get_weight_grad_store

__all__ = [
    "ActivationMemoryTracker", "PipelineTimeoutError", "WeightGradStore", "WeightGradStoreError",
    "ZeroBubbleForwardBackward", "ZeroBubbleOptions", "get_forward_backward_func", "get_weight_grad_store",
]

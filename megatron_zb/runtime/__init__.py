"""The zero-bubble runtime: weight-gradient store and layer routes, p2p, executor, drop-in forward_backward_func."""

from .forward_backward import ZeroBubbleForwardBackward, ZeroBubbleOptions, get_forward_backward_func
from .install import Installed, NotBuilt
from .measure import Measure, Measured
from .memory import ActivationMemoryTracker
from .p2p import PipelineTimeoutError
from .routes import ROUTES, LayerRoute, ModuleRoute, install_routes, uninstall_routes
from .wgrad_store import WeightGradStore, WeightGradStoreError, current_store

__all__ = [
    "ActivationMemoryTracker", "Installed", "LayerRoute", "Measure", "Measured", "ModuleRoute", "NotBuilt", "PipelineTimeoutError", "ROUTES", "WeightGradStore",
    "WeightGradStoreError", "ZeroBubbleForwardBackward", "ZeroBubbleOptions", "current_store",
    "get_forward_backward_func", "install_routes", "uninstall_routes",
]

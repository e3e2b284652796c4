"""Every private megatron-core API megatron-zb touches, in one place.

megatron-zb is a plugin: it imports megatron-core's public API freely, but some of what it needs
is private (underscore names, module internals, functions megatron-core does not export, objects it
patches). Each such use lives here, under the part of megatron-zb that needs it, so that one file
is reviewed at each megatron-core upgrade (pinned: megatron-core 0.16.1). Anything here may break
on upgrade; nothing outside this module reaches into megatron-core's private names.
"""

from __future__ import annotations

# ----------------------------------------------------------------------------------- runtime
# (the weight-gradient store's routes into megatron-core's layers, the executor's use of the
# schedules module's internals)


# ---------------------------------------------------------------------------- platform shim
# (what the CPU shim replaces inside megatron-core when CUDA is absent)


# --------------------------------------------------------------------------------- optimizer
# (what post-validation reads and calls inside megatron-core's optimizers)


# ---------------------------------------------------------------------------------- training
# (megatron-core internals the training loop, data and checkpointing code rely on)

"""Attribute names the model marks on its parameters and the runtime reads (no imports: both floors
import it, and ``import megatron_zb.runtime`` stays free of megatron-core)."""

__all__ = ["WGRAD_IN_B"]

WGRAD_IN_B = "zb_wgrad_in_b"
"""A weight with this attribute set has its weight gradient computed in B by megatron-core's own
linear backward (the runtime's linear route reads it): a weight a non-linear layer of the same chunk
also uses, whose gradients autograd must sum before DDP's hook adds them once
(:func:`megatron_zb.model.mtp.tie_mtp_stage`)."""

"""What the Transformer Engine route reads inside TE modules and megatron-core's TE config, per
release: a part of :mod:`megatron_zb.megatron_compat`.

See ``megatron_zb/runtime/te_route.py`` and docs/transformer_engine.md. TE's public API used
directly there: ``module.wgrad_store.delay_wgrad_compute()``, ``module.backward_dw()``,
``module.register_wgrad_accumulation_and_reduce_hooks(hook)`` (TE >= 2.7). The installed release
is asked of :func:`megatron_zb.megatron_compat.release` (the one place that asks it).
"""

from __future__ import annotations

import re
from typing import Any

from . import release


def te_queued_wgrad(module: Any) -> int:
    """Entries queued in a TE module's deferred weight-gradient FIFO.

    Private to TE: ``WeightGradStore.context`` is the ``queue.Queue`` that ``put`` fills and
    ``pop`` drains (``transformer_engine/pytorch/module/_common.py``, unchanged from TE 2.3 to
    2.18). One ``backward_dw()`` pops one entry (``LayerNormMLP``: two, fc2 then fc1);
    ``need_backward_dw()`` (TE >= 2.10) only says whether delaying is switched on.
    """
    context = module.wgrad_store.context
    return 0 if context is None else context.qsize()


def te_drop_queued_wgrad(module: Any) -> None:
    """Empty a TE module's deferred weight-gradient FIFO without running it (after a failed
    iteration; see :func:`te_queued_wgrad` for the private ``WeightGradStore.context``)."""
    context = module.wgrad_store.context
    while context is not None and not context.empty():
        context.get_nowait()


_TE_WEIGHT_NAME = re.compile(r"(fc[12]_)?weight\d*")


def te_delayed_weight_params(module: Any) -> tuple[Any, ...]:
    """The weights of a TE module whose gradients its ``backward_dw()`` computes: the module's
    ``weight_names`` (``Linear``, ``LayerNormLinear``), else its own parameters named ``weight``,
    ``weight<i>`` (``GroupedLinear``) or ``fc1_weight`` / ``fc2_weight`` (``LayerNormMLP``) --
    not a norm's ``layer_norm_weight``, whose gradient TE computes in the backward.

    With delaying on, the gradient TE's backward hands autograd for these is never the weight
    gradient: ``None``, a dummy with ``fuse_wgrad_accumulation`` under megatron-core DDP
    (``get_dummy_wgrad``), or -- ``GroupedLinear``, TE >= 2.8, without fusion -- the packed
    buffer the delayed GEMM will fill, uninitialised in B (``module/grouped_linear.py``).
    """
    names = getattr(module, "weight_names", None)
    if names is None:
        names = [n for n, _ in module.named_parameters(recurse=False) if _TE_WEIGHT_NAME.fullmatch(n)]
    return tuple(getattr(module, n) for n in names)


TE_WRAPPER_KEYWORDS: dict[str, tuple[str, ...]] = {
    "0.16": (),
    "0.19": ("name",),
}
"""Per release: the keyword arguments megatron-core's TE linear wrappers (``TEColumnParallelLinear``,
``TERowParallelLinear``, ``TELayerNormColumnParallelLinear`` in
``megatron/core/extensions/transformer_engine.py``) take beyond 0.16.1's. 0.19 adds ``name`` (the
layer's dotted name, e.g. ``"...self_attention.linear_proj"``, which attention and MLP pass and the
wrapper hands to TE's module). megatron-zb never builds these wrappers itself (megatron-core's
``get_gpt_layer_with_transformer_engine_spec`` does); the CPU test double of TE
(``tests/te_double.py``) accepts exactly these, and ``tests/runtime/test_te_contract.py`` compares them with
the installed megatron-core's source (the wrappers are stubs without TE)."""


def te_wrapper_keywords() -> tuple[str, ...]:
    """:data:`TE_WRAPPER_KEYWORDS` of the installed release."""
    return TE_WRAPPER_KEYWORDS[release()]


TE_OP_FUSER_CLASSES: tuple[str, ...] = ("TEFusedMLP",)
"""megatron-core's modules that run Transformer Engine's op fuser (``te.pytorch.ops``, whose
``BasicLinear`` has no delayed weight gradients): ``TEFusedMLP`` in
``megatron/core/extensions/transformer_engine.py``, chosen by
``get_gpt_layer_with_transformer_engine_spec(use_te_op_fuser=True)``. Matched by class name
(the class exists only where TE imports)."""


def set_delay_wgrad_compute(config: Any) -> None:
    """Set ``config.delay_wgrad_compute = True`` on an already validated ``TransformerConfig``.

    megatron-core 0.16.1 accepts ``delay_wgrad_compute`` only together with
    ``overlap_moe_expert_parallel_comm`` (an assertion in ``TransformerConfig.__post_init__``,
    ``megatron/core/transformer/transformer_config.py``); its TE wrappers
    (``megatron/core/extensions/transformer_engine.py``) read the field when they build a TE
    module (``delay_wgrad_compute=`` for TE >= 2.3) and in their ``backward_dw()``. Setting the
    field after validation -- before the model is built -- passes it to TE without the MoE-only
    check; no megatron-core file changes.
    """
    config.delay_wgrad_compute = True

"""The mixture-of-experts part of the model: ``TransformerConfig`` fields and the layer spec.

* the MoE fields of megatron-core's ``TransformerConfig`` come from
  :meth:`~megatron_zb.training.run_config.MoEConfig.transformer_config_kwargs`;
* :func:`moe_layer_spec` -- the transformer-layer spec of a MoE model (``None`` for a dense one):
  megatron-core's local spec with ``num_experts`` (SequentialMLP experts, built from
  ``ColumnParallelLinear``/``RowParallelLinear``, whose weight gradients the runtime's ``linear``
  route defers to W), built as :class:`MoETransformerLayer`.

:class:`MoETransformerLayer` does two things a per-layer spec list would otherwise do:

* ``--moe-layer-freq``: a layer whose entry in ``MoEConfig.moe_layer_pattern`` is 0 gets the dense MLP
  (megatron-core's ``get_gpt_decoder_block_spec`` picks per-layer specs the same way, by global
  layer number; one spec class is enough here because megatron-zb's chunks number layers
  globally);
* layout-independent expert weights: expert ``e`` (global index) of layer ``i`` is initialised
  from ``derive_seed(seed, "layer", i, "expert", e, "fc1" | "fc2")``, so the experts differ from
  one another and do not depend on the expert-parallel size (without this every expert-parallel
  rank would draw its local experts from the same per-layer stream, giving copies); the shared
  experts (``--moe-shared-expert-intermediate-size``) from ``derive_seed(seed, "layer", i,
  "shared_experts", "fc1" | "fc2" | "gate")`` (megatron-core builds them after the local experts, so
  their draws from the layer's stream would depend on the expert-parallel size).
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import get_pg_rank, get_pg_size

from megatron_zb.megatron_compat import initialize_affine_weight_cpu
from megatron_zb.model.gpt_chunks import ChunkPlan, SeededTransformerLayer, derive_seed

from megatron_zb.training.run_config import MoEConfig

__all__ = ["MTPInnerLayer", "MoETransformerLayer", "moe_layer_spec"]


def moe_layer_spec(moe: MoEConfig | None, *, local_spec_kwargs: Mapping[str, Any] | None = None
                   ) -> ModuleSpec | None:
    """The layer spec of a MoE model (``None`` for a dense model: the caller's default spec).

    ``local_spec_kwargs`` go to every ``get_gpt_layer_local_spec`` call (e.g. ``normalization``,
    ``qk_layernorm``), so the MoE and the dense layers share everything but the MLP.
    """
    if moe is None:
        return None
    kwargs = dict(local_spec_kwargs or {})
    spec = get_gpt_layer_local_spec(num_experts=moe.num_experts, moe_grouped_gemm=moe.moe_grouped_gemm, **kwargs)
    dense_mlp = get_gpt_layer_local_spec(**kwargs).submodules.mlp
    spec = copy.copy(spec)
    spec.module = MoETransformerLayer
    spec.params = {**spec.params, "moe_pattern": tuple(moe.moe_layer_pattern), "dense_mlp": dense_mlp}
    return spec


class MoETransformerLayer(SeededTransformerLayer):
    """A :class:`~megatron_zb.model.SeededTransformerLayer` with a MoE or dense MLP by layer pattern,
    and expert weights seeded per global expert (see the module docstring).

    Args (beyond ``TransformerLayer``'s): ``moe_pattern`` -- one 0/1 per global layer (1 = MoE);
    ``dense_mlp`` -- the MLP spec of a dense layer; ``init_seed`` -- as
    :class:`~megatron_zb.model.SeededTransformerLayer`.
    """

    def __init__(self, config: Any, submodules: Any, layer_number: int = 1, *args: Any, init_seed: int,
                 moe_pattern: tuple[int, ...], dense_mlp: ModuleSpec, **kwargs: Any) -> None:
        plan = config.pipeline_model_parallel_layout
        global_index = (plan.layer_offset if isinstance(plan, ChunkPlan) else 0) + layer_number - 1
        if not moe_pattern[global_index]:
            submodules = copy.copy(submodules)
            submodules.mlp = dense_mlp
        super().__init__(config, submodules, layer_number, *args, init_seed=init_seed, **kwargs)
        if moe_pattern[global_index] and config.perform_initialization:
            _seed_experts(self.mlp, config, init_seed, ("layer", global_index))

    @staticmethod
    def mtp_inner_spec(spec: ModuleSpec) -> ModuleSpec:
        """The transformer layer of a multi-token prediction layer (:func:`megatron_zb.model.mtp.mtp_block_spec`):
        the decoder's last layer's kind, as megatron-core's (``get_gpt_mtp_block_spec`` of the block spec's last
        layer): MoE or dense by the last entry of ``moe_pattern``; built as :class:`MTPInnerLayer`."""
        submodules = copy.copy(spec.submodules)
        if not spec.params["moe_pattern"][-1]:
            submodules.mlp = spec.params["dense_mlp"]
        return ModuleSpec(module=MTPInnerLayer, submodules=submodules)


class MTPInnerLayer(TransformerLayer):
    """The transformer layer of a MoE model's multi-token prediction layer: ``reseed`` re-draws its experts
    (if any) per global expert from ``derive_seed(seed, "mtp_layer", depth, "expert", e, ...)``, so that they
    differ from one another and do not depend on the expert-parallel size, as the decoder's."""

    def reseed(self, seed: int, *key: int | str) -> None:
        """Re-draw the experts and shared experts of this layer's MoE MLP (no-op for a dense MLP)."""
        if hasattr(self.mlp, "experts"):
            _seed_experts(self.mlp, self.config, seed, key)


@torch.no_grad()
def _seed_experts(moe: Any, config: Any, seed: int, layer: tuple[int | str, ...]) -> None:
    """Re-draw each local expert's fc1/fc2 weights from its global expert index (megatron's CPU init);
    ``layer``: the layer's seed key, ``("layer", i)`` or ``("mtp_layer", depth)``."""
    experts = getattr(moe, "experts", None)
    local = getattr(experts, "local_experts", None)
    if local is None:  # grouped-GEMM experts (GPU): one weight for all local experts, megatron's own init
        return
    first = moe.local_expert_indices[0]
    for i, expert in enumerate(local):
        _seed_mlp(expert, config, (*layer, "expert", first + i), seed)
    shared = getattr(moe, "shared_experts", None)
    if shared is not None:  # built after the local experts: its draws would depend on their number
        _seed_mlp(shared, config, (*layer, "shared_experts"), seed)
        if shared.gate_weight is not None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(derive_seed(seed, *layer, "shared_experts", "gate"))
                config.init_method(shared.gate_weight)


def _seed_mlp(mlp: Any, config: Any, key: tuple, seed: int) -> None:
    """Re-draw an MLP's fc1/fc2 weights from ``derive_seed(seed, *key, "fc1" | "fc2")`` (megatron's CPU init,
    split over the linear's tensor-parallel ranks)."""
    for name, linear, init, dim in (("fc1", mlp.linear_fc1, config.init_method, 0),
                                    ("fc2", mlp.linear_fc2, config.output_layer_init_method, 1)):
        weight = linear.weight
        per_partition = weight.shape[dim]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(seed, *key, name))
            initialize_affine_weight_cpu(
                weight, linear.output_size, linear.input_size, per_partition, dim, init,
                params_dtype=config.params_dtype, rank=get_pg_rank(linear.tp_group),
                world_size=get_pg_size(linear.tp_group))

"""Placement-independent initial weights for megatron-core models built by someone else's code (tests).

Megatron-LM draws each rank's weights from that rank's RNG stream in construction order, so the
same model placed differently (plain 1F1B vs the V: layer 3 built on rank 1 second, or on rank 0
after layer 0) starts from different weights. :func:`seed_layers_by_global_number` makes every
megatron-core ``TransformerLayer`` draw its parameters from a generator seeded by its *global*
layer number (``megatron_zb.model.derive_seed(seed, "layer", i)``, the rule of
:class:`~megatron_zb.model.SeededTransformerLayer`), leaving the process's RNG stream as it was.
It seeds torch's default CPU generator, which megatron-core's initialisation draws from with
``use_cpu_initialization`` (Megatron-LM's ``--use-cpu-initialization``); its GPU initialisation
draws from the model-parallel RNG tracker instead, which this does not touch.

With untied embeddings (``--untie-embeddings-and-output-weights``) the output layer has a weight of
its own, which megatron-core draws from the building rank's stream after whatever that rank drew
before (1F1B: the last rank, first; the V: rank 0, after the word embedding): it is drawn again from
``derive_seed(seed, "output_layer")`` (``config.init_method``, as megatron-core initialises it). The word
embedding needs nothing: both placements draw it first on rank 0. A tied output layer is the
embedding's weight (1F1B: a copy megatron-core syncs from it) and is left alone.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["seed_layers_by_global_number"]


def seed_layers_by_global_number(seed: int = 1234) -> None:
    """Wrap ``TransformerLayer.__init__`` (process-wide, idempotent): construct each layer under
    ``torch.manual_seed(derive_seed(seed, "layer", i))`` with ``i`` its global 0-based number
    (megatron-core's ``get_transformer_layer_offset`` + the block's local number), RNG restored after."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset
    from megatron.core.utils import get_pg_rank

    from megatron_zb.model import derive_seed

    if getattr(TransformerLayer.__init__, "_megatron_zb_seeded", False):
        return
    _seed_untied_output_layer(seed)
    original = TransformerLayer.__init__
    signature = inspect.signature(original)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        pg = bound.arguments.get("pg_collection")
        pp_rank = (get_pg_rank(pg.pp) if pg is not None and getattr(pg, "pp", None) is not None
                   else parallel_state.get_pipeline_model_parallel_rank())
        index = get_transformer_layer_offset(bound.arguments["config"], bound.arguments.get("vp_stage"), pp_rank)
        index += bound.arguments["layer_number"] - 1
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(seed, "layer", index))
            original(self, *args, **kwargs)
        if self.layer_number != index + 1:
            raise RuntimeError(f"layer seeded as global layer {index} was numbered {self.layer_number - 1}")

    __init__._megatron_zb_seeded = True  # type: ignore[attr-defined]
    TransformerLayer.__init__ = __init__


def _seed_untied_output_layer(seed: int) -> None:
    """Wrap ``GPTModel.__init__``: an untied output layer's weight drawn again from
    ``derive_seed(seed, "output_layer")`` (module docstring), RNG restored after."""
    import torch
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_zb.model import derive_seed

    original = GPTModel.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        weight = getattr(getattr(self, "output_layer", None), "weight", None)
        if self.post_process and not self.share_embeddings_and_output_weights and weight is not None:
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(derive_seed(seed, "output_layer"))
                self.config.init_method(weight)

    GPTModel.__init__ = __init__

"""What megatron-core's multi-latent attention needs to build on the local layer spec, per release: a part
of :mod:`megatron_zb.megatron_compat` (:mod:`megatron_zb.model.mla` calls it).

The installed release is asked of :func:`megatron_zb.megatron_compat.release` (the one place that asks
it); re-read these names at each megatron-core upgrade, with the table of that module.
"""

from __future__ import annotations

import importlib

from . import release

__all__ = ["MLA_TE_FLAG", "fix_mla_without_te"]

MLA_TE_FLAG: dict[str, str | None] = {"0.16": "megatron.core.transformer.multi_latent_attention:HAVE_TE", "0.19": None}
"""Per release: the module global of megatron-core's multi-latent attention that says Transformer Engine is
there. 0.16.1 sets it when ``megatron.core.extensions.transformer_engine`` imports -- which it does without
TE too, with a ``MagicMock`` for ``te``, so ``TELinear`` is a mock and ``MLASelfAttention.__init__``'s
``isinstance(self.linear_proj, TELinear)`` raises ``TypeError``; 0.19 imports that module's real ``HAVE_TE``
(``None``: nothing to fix)."""


def fix_mla_without_te() -> None:
    """Without Transformer Engine, make megatron-core's multi-latent attention know it (:data:`MLA_TE_FLAG`:
    0.16.1 only), so that ``MLASelfAttention`` builds on the local spec. Idempotent; nothing with TE."""
    where = MLA_TE_FLAG[release()]
    if where is None:
        return
    from megatron.core.extensions import transformer_engine

    if not transformer_engine.HAVE_TE:
        module, _, name = where.partition(":")
        setattr(importlib.import_module(module), name, False)

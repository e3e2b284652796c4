"""megatron_compat's table of private megatron-core names, checked against the installed release.

Runs on whichever supported megatron-core is installed (0.16.1 on Python 3.11; 0.19.x on Python
3.12: scripts/test_py312.sh). A megatron-core upgrade that moves or re-signs a private name fails
here, naming the row.
"""

from __future__ import annotations

import inspect

import pytest

from megatron_zb import megatron_compat as mc


def test_installed_release_is_supported():
    assert mc.release() in mc.RELEASES
    assert mc.megatron_core_version().startswith(mc.release() + ".")


@pytest.mark.parametrize("name", sorted(mc.PRIVATE_API))
def test_private_name_resolves_with_recorded_signature(name):
    rows = mc.PRIVATE_API[name]
    assert set(rows) == set(mc.RELEASES), f"{name}: one entry per supported release"
    entry = rows[mc.release()]
    if entry is None:
        with pytest.raises(mc.UnsupportedMegatronCore, match=mc.megatron_core_version()):
            mc.private(name)
        return
    obj = mc.private(name)
    assert obj is not None
    if entry.signature is not None:
        assert str(inspect.signature(obj)) == entry.signature, f"{name} ({entry.where}) was re-signed"


def test_absent_name_is_refused_naming_the_release(monkeypatch):
    """A row with no entry for the installed release is refused with the version and the
    releases that have it (the row is a test double: no real row is absent from both)."""
    other = next(r for r in mc.RELEASES if r != mc.release())
    monkeypatch.setitem(mc.PRIVATE_API, "example", {mc.release(): None,
                                                    other: mc.Private("megatron.core:package_info")})
    with pytest.raises(mc.UnsupportedMegatronCore) as err:
        mc.private("example", feature="--example-flag")
    msg = str(err.value)
    assert "--example-flag" in msg and mc.megatron_core_version() in msg and mc.RELEASES[other] in msg


def test_unsupported_version_is_refused(monkeypatch):
    """A megatron-core outside the supported lines is refused by version (the version string is
    a test double: only supported releases are installed here)."""
    monkeypatch.setattr(mc, "megatron_core_version", lambda: "0.17.1")
    mc.release.cache_clear()
    try:
        with pytest.raises(mc.UnsupportedMegatronCore, match=r"megatron-core 0\.17\.1 is not supported"):
            mc.release()
    finally:
        monkeypatch.undo()
        mc.release.cache_clear()
    assert mc.release() in mc.RELEASES


def test_pipeline_backward_step_called_uniformly():
    """The executor's backward_step takes (input, output, output_grad, config) on every release
    and returns megatron-core's input gradient."""
    import torch
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1)
    x = torch.randn(3, requires_grad=True)
    y = (x * x).sum()
    grad = mc.pipeline_step_functions().backward_step([x], [y], None, config)
    assert torch.equal(grad[0], 2 * x.detach())


# Spot checks read by hand in Megatron-LM's megatron/training/arguments.py at each tag (grep add_argument):
# --legacy-tokenizer exists at core_v0.16.1 (line 2408) and not at core_v0.19.0;
# --dataloader-inter-document-masking exists at core_v0.19.0 (line 3159) and not at core_v0.16.1.
_FLAG_SPOT_CHECKS = {"core_v0.16.1": ("--legacy-tokenizer", "--dataloader-inter-document-masking"),
                     "core_v0.19.0": ("--dataloader-inter-document-masking", "--legacy-tokenizer")}


def test_megatron_lm_flag_list_follows_the_installed_release():
    """The unknown-flag messages' list is the Megatron-LM release's that goes with the installed
    megatron-core: its version string names that tag, and a flag only that release has is in it,
    one only the other release has is not."""
    from megatron_zb.training.arguments.megatron_flags import megatron_lm_flags

    version, flags = megatron_lm_flags()
    tag = mc.megatron_lm_tag()
    assert version.split()[0] == tag == mc.MEGATRON_LM_TAGS[mc.release()]
    present, absent = _FLAG_SPOT_CHECKS[tag]
    assert present in flags and absent not in flags and len(flags) > 600


def test_schedule_selection_refuses_only_a_multi_module_collection():
    """megatron-core 0.19's get_forward_backward_func(schedule_pg_collection=...): Megatron-LM's
    ordinary ProcessGroupCollection (and None) pass, a MultiModuleProcessGroupCollection is refused
    naming the version (an instance made without __init__: no process groups exist here)."""
    mc.check_schedule_selection({})
    mc.check_schedule_selection({"schedule_pg_collection": None})
    config = pytest.importorskip("megatron.core.process_groups_config")
    if not hasattr(config, "MultiModuleProcessGroupCollection"):
        pytest.skip(f"megatron-core {mc.megatron_core_version()} has no MultiModuleProcessGroupCollection")
    mc.check_schedule_selection({"schedule_pg_collection": object.__new__(config.ProcessGroupCollection)})
    with pytest.raises(mc.UnsupportedMegatronCore, match=r"multi-module pipeline .* megatron-zb's schedules"):
        mc.check_schedule_selection(
            {"schedule_pg_collection": object.__new__(config.MultiModuleProcessGroupCollection)})


def test_mla_te_flag_is_where_the_release_keeps_it():
    """megatron_compat.mla's per-release flag (0.16.1's ``multi_latent_attention.HAVE_TE``) exists where the
    table says, and after the fix it agrees with megatron-core's own Transformer Engine check."""
    from megatron.core.extensions import transformer_engine

    from megatron_zb.megatron_compat.mla import MLA_TE_FLAG, fix_mla_without_te

    assert set(MLA_TE_FLAG) == set(mc.RELEASES)
    where = MLA_TE_FLAG[mc.release()]
    if where is None:
        return
    assert isinstance(mc.resolve(where), bool)
    fix_mla_without_te()
    assert mc.resolve(where) == transformer_engine.HAVE_TE

"""Test-only harnesses: imported by tests/ only, never by the installed package (``megatron_zb``).

Importable as ``harness`` because ``tests/`` is on ``sys.path`` (``pytest.ini``'s ``pythonpath``); a
subprocess that imports one of these modules gets ``tests/`` on its ``PYTHONPATH`` from whoever starts
it (:mod:`harness.megatron_lm`, :mod:`harness.megatron_lm_tokenizers`). What users and the GPU self-test
run stays in :mod:`megatron_zb.testing` (docs/architecture.md).
"""

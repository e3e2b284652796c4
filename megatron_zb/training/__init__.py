"""Building blocks of ``pretrain_gpt_zb.py`` that do not need the pipeline runtime.

* :mod:`megatron_zb.training.arguments` -- Megatron-compatible command line (``build_parser``,
  ``parse_args``) and ``validate_args``, which checks every flag combination *before* any process
  group starts and resolves the schedule name and derived sizes.
* :mod:`megatron_zb.training.logging_utils` -- Megatron's per-iteration log line (format and
  parse), rank-aware printing, the one-time schedule report, an optional TensorBoard writer.
* :mod:`megatron_zb.training.data` -- tokenizers (byte-level, local HuggingFace, null) and the
  train/valid/test datasets and micro-batch iterators built with megatron-core.

Nothing is imported here, so ``import megatron_zb.training`` stays cheap; import the submodules.
"""

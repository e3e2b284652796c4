"""``pretrain_gpt_zb.py``: Megatron-LM's GPT pretraining on megatron-core with zero-bubble schedules.

Command line (no process group needed):

* :mod:`.arguments` -- Megatron-compatible flags, one module per flag group, and
  ``validate_args_and_schedule`` (checks every flag combination before any process group
  starts; returns the args with derived values and the unit-cost schedule);
* :mod:`.pretrain` -- ``main``: parse, validate (exit 2 with one line on a bad flag), run the Trainer.

The run (:class:`.trainer.Trainer` coordinates the parts; each module does one job):

* :mod:`.distributed` -- process groups, ranks, device, Megatron's seeds;
* :mod:`.model_setup` -- this rank's GPT chunks for the schedule's placement, wrapped (``ModelBundle``);
* :mod:`.optimizer_setup` -- megatron-core optimizer, post-validation, LR scheduler (``OptimizerBundle``);
* :mod:`.replanning` -- the ``forward_backward_func`` and its schedule: rank 0's, profiled, re-planned;
* :mod:`.profiling` -- measuring T_F/T_B/T_W/T_comm and the cost model built from them;
* :mod:`.data` -- megatron-core datasets, micro-batch iterators; :mod:`.tokenizers` -- the tokenizers
  (their flags: :mod:`.tokenizer_flags`);
* :mod:`.data_setup` -- the run's train/valid/test iterators, one per model chunk (``DataBundle``);
* :mod:`.gpt_step` -- GPT's ``forward_step`` / ``loss_func`` (as Megatron-LM's ``pretrain_gpt.py``);
* :mod:`.state` -- ``TrainState``: iteration, consumed samples, profiled costs;
* :mod:`.checkpointing` -- ``dist_checkpointing`` save/load of model, optimizer, scheduler, RNG, ``TrainState``;
* :mod:`.training_log` -- log intervals, Megatron's lines, TensorBoard, ``--loss-log-json``;
* :mod:`.evaluation` -- forward-only evaluation;
* :mod:`.logging_utils` -- the iteration line's format and parser, rank-aware printing, the schedule report.

Nothing is imported here, so ``import megatron_zb.training`` stays cheap; import the submodules.
"""

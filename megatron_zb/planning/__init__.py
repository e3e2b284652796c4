"""``megatron-zb plan``: predict every schedule family's iteration time and memory before launch.

Modules (one job each):

* :mod:`.hardware` -- the GPU table and the :class:`~.hardware.Hardware` description;
* :mod:`.model` -- the model and parallel layout (Megatron's flags), checked up front;
* :mod:`.layout` -- which layers each pipeline stage holds, for every placement;
* :mod:`.model_flops` -- the model FLOPs (Megatron-LM's formula, once: ``--log-throughput`` and ``plan``);
* :mod:`.flops` -- FLOPs and HBM bytes of every kernel, hence ``T_F``, ``T_B``, ``T_W``, ``T_comm``;
* :mod:`.memory` -- activation memory ``M_B``/``M_W`` and parameter + optimizer memory;
* :mod:`.profile` -- the measured-cost file ``pretrain_gpt_zb.py --profile-out`` writes;
* :mod:`.planner` -- builds and simulates every schedule family, picks the recommendation;
* :mod:`.report` -- the printed table and the ``--json`` document;
* :mod:`.command` -- the ``plan`` subcommand's flags;
* :mod:`.validation` -- the comparison with the zero-bubble paper printed in docs/planning.md.

Kept light: importing this package does not import the schedule generators or matplotlib.
"""

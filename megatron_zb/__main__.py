"""``python -m megatron_zb``: the ``megatron-zb`` command line."""

from .cli import main

raise SystemExit(main())

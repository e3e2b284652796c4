"""Schedule generators. Importing this package registers every built-in schedule.

Each module registers its schedules with :func:`~megatron_zb.schedules.catalog.register` when it
is imported; the imports below fix the order ``megatron-zb list`` shows. A new generator is a new
module here plus one line below (see docs/schedules.md, "Adding a generator").

==================  =====================================================================
module              schedules
==================  =====================================================================
``baselines``       ``1f1b``, ``interleaved-1f1b``
``handcrafted``     ``zb-h1``, ``zb-h2``
``greedy``          ``zb``, ``zb-1p``, ``zb-2p`` (greedy list scheduler, plain placement)
``vshape``          ``zbv``, ``v-half``, ``v-min``, ``1f1b-v`` (with ``list_scheduler`` and ``search``)
``interleaved_zb``  ``interleaved-zb``
``exact``           ``zb-optimal``, ``zbv-optimal`` (CP-SAT; OR-Tools imported on use)
``vocab``           ``1f1b-vocab-1``, ``1f1b-vocab-2``, ``zb-h1-vocab-1``, ``zb-h1-vocab-2``
``vocab_v``         ``zbv-vocab-1``, ``zbv-vocab-2`` (the V placement, hand-made order)
``vocab_interl..``  ``interleaved-1f1b-vocab-1/2``, ``interleaved-zb-vocab-1/2`` (``vocab_interleaved``)
``vocab_family``    ``zb-vocab-*``, ``zb-1p-vocab-*``, ``zb-2p-vocab-*``, ``v-half-vocab-*``, ``v-min-vocab-*``
==================  =====================================================================
"""

# One import per line, in this order: it is the registration order (keep it when sorting imports).
from . import baselines  # noqa: F401, I001
from . import handcrafted  # noqa: F401
from . import greedy  # noqa: F401
from . import vshape  # noqa: F401
from . import interleaved_zb  # noqa: F401
from . import exact  # noqa: F401
from . import vocab  # noqa: F401
from . import vocab_v  # noqa: F401
from . import vocab_interleaved  # noqa: F401
from . import vocab_family  # noqa: F401

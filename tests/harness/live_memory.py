"""Peak bytes of every tensor an iteration creates, for any schedule (CPU tests and benchmarks).

The activation tracker (:class:`~megatron_zb.runtime.memory.ActivationMemoryTracker`) sees what
autograd saves inside megatron-zb's executor; it cannot see megatron-core's own schedules, nor stage
outputs, gradients or p2p buffers. A GPU reads ``torch.cuda.max_memory_allocated``; a CPU has no
allocator statistics. :class:`LiveTensorBytes` is a ``TorchDispatchMode`` that counts the storage of
every tensor an operator returns -- forward, backward (the autograd engine runs on the calling
thread on CPU and keeps the mode), p2p receive buffers, gradients -- from its creation until the
storage is freed, and keeps the high-water mark. Under the same mode megatron-core's 1F1B and
megatron-zb's schedules are measured alike: what is compared is memory the iteration allocates
(parameters and what existed before are not counted). Storages are counted once (views share
them); ``out=`` writes into existing tensors add nothing.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorBytes(TorchDispatchMode):
    """Inside ``with LiveTensorBytes() as live:``, ``live.peak`` is the most bytes held at once by
    tensors created in the block [bytes]; ``live.current`` what is held now."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._count(t)
        return out

    def _count(self, t: torch.Tensor) -> None:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self._seen:
            return
        n = storage.nbytes()
        self._seen.add(ptr)
        self.current += n
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, ptr, n)

    def _free(self, ptr: int, n: int) -> None:
        self._seen.discard(ptr)
        self.current -= n


def peak_iteration_bytes(cfg: Any, schedule: str | None, **options: Any) -> int:
    """In one rank: the peak of :class:`LiveTensorBytes` over the second of two iterations of the
    tiny GPT ``cfg`` (:class:`~megatron_zb.testing.tiny_gpt.TinyGPT`), with megatron-zb's
    ``schedule`` or, for ``None``, megatron-core's own schedule [bytes]."""
    from megatron.core.pipeline_parallel import get_forward_backward_func as megatron_func

    from megatron_zb.runtime import get_forward_backward_func
    from megatron_zb.testing.tiny_gpt import build, forward_backward

    _, modules = build(cfg, schedule)
    fb = megatron_func() if schedule is None else get_forward_backward_func(schedule, **{**cfg.schedule_options, **options})
    forward_backward(fb, modules, cfg.microbatches(), seq=cfg.seq, micro_batch=cfg.micro_batch)
    for m in modules:
        m.zero_grad(set_to_none=False)
    with LiveTensorBytes() as live:
        forward_backward(fb, modules, cfg.microbatches(), seq=cfg.seq, micro_batch=cfg.micro_batch)
    return live.peak

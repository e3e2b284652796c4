"""The GPU table and the hardware description the cost estimates use.

Published vendor figures (datasheets), dense 16-bit tensor-core peaks (no sparsity):

=========  ==========  ===========  ===========  ============  ========================
``--gpu``  TFLOP/s     memory       HBM GB/s     TP link GB/s  P2P Gbit/s (NIC per GPU)
=========  ==========  ===========  ===========  ============  ========================
A100       312         80 GiB       2039         300           200 (DGX A100, HDR IB)
H100       989         80 GiB       3350         450           400 (DGX H100, NDR IB)
H200       989         141 GiB      4800         450           400 (DGX H200, NDR IB)
MI300X     1307        192 GiB      5300         448           400 (400G NIC per GPU)
=========  ==========  ===========  ===========  ============  ========================

A100 and H100 are the SXM 80 GB parts. HBM is built from binary-sized stacks, so the published
"80 GB" is 80 GiB (H200 enables 141 of its 144 GiB; MI300X has 8 x 24 GiB). The TP link column
is a GPU's aggregate NVLink / Infinity Fabric bandwidth per direction inside a node (half the
published bidirectional figure: 600, 900, 900, 896 GB/s; tensor-parallel collectives stay in a
node). The P2P column is the network bandwidth of one GPU in the
vendor's reference 8-GPU server: pipeline stages usually span nodes, so the default assumes the
stage-to-stage link is the NIC (within a node it is faster: pass ``--p2p-gbps``).

Two efficiencies turn peaks into time (:class:`Hardware`): ``mfu``, the fraction of the peak
FLOP/s that large matrix multiplications reach, and ``hbm_efficiency``, the fraction of the HBM
bandwidth that memory-bound kernels (norms, softmax, dropout, activation functions) reach. Their
defaults (0.8 and 0.6) were fitted to the zero-bubble paper's profiled A100 costs of its 1.5B
model only (docs/planning.md: ``T_W`` is pure matrix multiplication and gives ``mfu``; ``T_F``
then gives ``hbm_efficiency``); its 6.2B costs check them out of sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

DEFAULT_MFU = 0.8
DEFAULT_HBM_EFFICIENCY = 0.6
DEFAULT_P2P_LATENCY_MS = 0.02  # one NCCL send/recv of a small message across nodes, order of 10-20 us


@dataclass(frozen=True)
class Hardware:
    """One GPU and its links, as the cost model sees it.

    Attributes:
        name: table name, or ``"custom"``.
        peak_tflops: dense 16-bit tensor-core peak, TFLOP/s (1e12 FLOP/s).
        memory_gib: device memory, GiB (2**30 bytes).
        hbm_gbs: device memory bandwidth, GB/s (1e9 bytes/s).
        tp_gbs: a GPU's aggregate link bandwidth per direction inside a node, GB/s (tensor-parallel
            collectives).
        p2p_gbps: bandwidth of a stage-to-stage transfer, Gbit/s (1e9 bits/s).
        p2p_latency_ms: fixed cost of one stage-to-stage transfer, ms.
        dp_gbps: bandwidth of a GPU's data-parallel collectives (gradient reduce-scatter / all-reduce),
            Gbit/s; ``None``: ``p2p_gbps`` (data-parallel groups usually span nodes, like the stages). Each of
            the ``d - 1`` steps of a ring collective also waits ``p2p_latency_ms``.
        host_collectives: the data-parallel collectives run on the cores the compute uses, so they do not
            overlap it (gloo on a CPU; the benchmarks' CPU model). ``False`` for every GPU.
        mfu: fraction of ``peak_tflops`` large matrix multiplications reach (0 < mfu <= 1).
        hbm_efficiency: fraction of ``hbm_gbs`` memory-bound kernels reach (0 < x <= 1).
    """

    name: str
    peak_tflops: float
    memory_gib: float
    hbm_gbs: float
    tp_gbs: float
    p2p_gbps: float
    p2p_latency_ms: float = DEFAULT_P2P_LATENCY_MS
    mfu: float = DEFAULT_MFU
    hbm_efficiency: float = DEFAULT_HBM_EFFICIENCY
    dp_gbps: float | None = None
    host_collectives: bool = False

    @property
    def flops_per_ms(self) -> float:
        """Sustained matrix-multiplication FLOPs per millisecond."""
        return self.peak_tflops * 1e9 * self.mfu

    @property
    def hbm_bytes_per_ms(self) -> float:
        """Sustained bytes per millisecond of memory-bound kernels."""
        return self.hbm_gbs * 1e6 * self.hbm_efficiency

    @property
    def p2p_bytes_per_ms(self) -> float:
        return self.p2p_gbps * 1e6 / 8

    @property
    def tp_bytes_per_ms(self) -> float:
        return self.tp_gbs * 1e6

    @property
    def dp_bytes_per_ms(self) -> float:
        """Bytes per millisecond one GPU sends in a data-parallel collective (``dp_gbps``, else ``p2p_gbps``)."""
        return (self.p2p_gbps if self.dp_gbps is None else self.dp_gbps) * 1e6 / 8


GPUS: dict[str, Hardware] = {
    "A100": Hardware("A100", peak_tflops=312.0, memory_gib=80.0, hbm_gbs=2039.0, tp_gbs=300.0, p2p_gbps=200.0),
    "H100": Hardware("H100", peak_tflops=989.0, memory_gib=80.0, hbm_gbs=3350.0, tp_gbs=450.0, p2p_gbps=400.0),
    "H200": Hardware("H200", peak_tflops=989.0, memory_gib=141.0, hbm_gbs=4800.0, tp_gbs=450.0, p2p_gbps=400.0),
    "MI300X": Hardware("MI300X", peak_tflops=1307.0, memory_gib=192.0, hbm_gbs=5300.0, tp_gbs=448.0,
                       p2p_gbps=400.0),
}


class HardwareError(ValueError):
    """A hardware flag is missing or invalid; ``flag`` names it."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag


def gpu_names() -> list[str]:
    return list(GPUS)


def resolve_hardware(*, gpu: str | None = None, tflops: float | None = None, memory_gib: float | None = None,
                     hbm_gbs: float | None = None, tp_gbs: float | None = None, p2p_gbps: float | None = None,
                     p2p_latency_ms: float | None = None, mfu: float | None = None,
                     hbm_efficiency: float | None = None, dp_gbps: float | None = None) -> Hardware:
    """The table entry ``gpu`` with any given value overriding it, or a custom GPU.

    Without ``gpu`` the peak, memory and HBM bandwidth must all be given; the links then default
    to the A100 row's (the most conservative of the table).

    Raises:
        HardwareError: unknown ``gpu``, a missing value for a custom GPU, or a value out of range.
    """
    if gpu is not None:
        key = {k.lower(): k for k in GPUS}.get(gpu.lower())
        if key is None:
            raise HardwareError("--gpu", f"unknown GPU {gpu!r}; choose one of {', '.join(GPUS)} or give "
                                         f"--gpu-tflops, --gpu-memory-gib and --gpu-hbm-gbs")
        base = GPUS[key]
    else:
        for flag, value in (("--gpu-tflops", tflops), ("--gpu-memory-gib", memory_gib), ("--gpu-hbm-gbs", hbm_gbs)):
            if value is None:
                raise HardwareError(flag, f"required without --gpu (known GPUs: {', '.join(GPUS)})")
        a100 = GPUS["A100"]
        base = Hardware("custom", peak_tflops=tflops, memory_gib=memory_gib, hbm_gbs=hbm_gbs,  # type: ignore[arg-type]
                        tp_gbs=a100.tp_gbs, p2p_gbps=a100.p2p_gbps)
    given = {"peak_tflops": tflops, "memory_gib": memory_gib, "hbm_gbs": hbm_gbs, "tp_gbs": tp_gbs,
             "p2p_gbps": p2p_gbps, "p2p_latency_ms": p2p_latency_ms, "mfu": mfu, "hbm_efficiency": hbm_efficiency,
             "dp_gbps": dp_gbps}
    hw = replace(base, **{k: v for k, v in given.items() if v is not None})
    _check(hw)
    return hw


_FLAGS = {"peak_tflops": "--gpu-tflops", "memory_gib": "--gpu-memory-gib", "hbm_gbs": "--gpu-hbm-gbs",
          "tp_gbs": "--tp-gbs", "p2p_gbps": "--p2p-gbps", "p2p_latency_ms": "--p2p-latency-ms", "mfu": "--mfu",
          "hbm_efficiency": "--hbm-efficiency", "dp_gbps": "--dp-gbps"}


def _check(hw: Hardware) -> None:
    for field, flag in _FLAGS.items():
        value = getattr(hw, field)
        if value is None and field == "dp_gbps":
            continue
        if not math.isfinite(value):
            raise HardwareError(flag, f"must be a finite number, got {value!r}")
        if field == "p2p_latency_ms":
            if not value >= 0:
                raise HardwareError(flag, f"must be >= 0, got {value:g}")
        elif not value > 0:
            raise HardwareError(flag, f"must be > 0, got {value:g}")
    for field in ("mfu", "hbm_efficiency"):
        if getattr(hw, field) > 1:
            raise HardwareError(_FLAGS[field], f"is a fraction of the peak, at most 1; got {getattr(hw, field):g}")

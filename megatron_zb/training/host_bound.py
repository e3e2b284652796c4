"""Host time, device time and the host-bound diagnosis of every profiled compute op.

The profiling window keeps each compute action on two clocks (:mod:`megatron_zb.training.profiling`):
the host's (``perf_counter`` from the action's start to the return of its code) and the device's
(CUDA events before and after it; on CPU the host's own, host = device). On CUDA the pair also
gives, per action, an upper bound ``U`` on the time the device waited for the host inside the
action (:func:`megatron_zb.runtime.action_timing.device_waits`: the device can wait for the host only
until the host has launched the action's last kernel, ``U = min(D, max(0, t1 - d0))``; no lower
bound above 0 follows from two events).

**Host-bound.** An op on a stage is *host-bound* when the median over its profiled actions of ``U``
[ms] exceeds :data:`HOST_BOUND_FRACTION` (one half) of its median device time ``D`` [ms]. Then in a
typical action the device finished less than ``D / 2`` after the host finished the action's code:
more than half of the device's interval was spent while the host was still launching (or
synchronising) -- the device interval measures the host, and a re-plan from it plans the host's
launch time, not the device's compute. One half because ``U`` is only an upper bound: a device that
is busy most of the action and merely trails the host by a little also has ``U`` close to ``D``, so
the flag says "the host sets this action's device time", and the report prints the bound as "up
to". On CPU (clock ``"host"``) the device is the host: no wait can be observed, ``waited_ms`` is
``None`` and nothing is flagged; the report line says so.

**Likely causes** are what the run can see in its own configuration (:func:`likely_causes`), one
clause each: data loading in the main thread (``--num-workers 0``, F of the stages that read data:
the first and the last), the attention mask in the data loader (megatron-core's
``create_attention_mask_in_dataloader``; off with ``--no-create-attention-mask-in-dataloader``),
megatron-core's level-2 timers (``--timing-log-level 2``: ``torch.cuda.synchronize`` at every
``forward-compute`` / ``backward-compute`` start and stop, i.e. in every F, B and BW), and the local
layers' unfused kernels (``--transformer-impl local``: more, smaller kernels, each launched from
Python). Verified with a mocked CUDA clock on CPU only, never on a GPU.
"""

from __future__ import annotations

from megatron_zb.planning.profile import ActionTimes, OpTime
from megatron_zb.training.profiling import AgreedProfile
from megatron_zb.training.run_config import RunConfig

__all__ = ["HOST_BOUND_FRACTION", "action_times", "action_times_lines", "likely_causes"]

HOST_BOUND_FRACTION = 0.5
"""An op is host-bound when its median wait bound exceeds this fraction of its median device time."""

OPS: tuple[str, ...] = ("F", "B", "W", "BW", "IF", "S", "T", "IB")
"""The compute ops in the order the report and the profile list them."""

_LAYER_OPS = ("F", "B", "W", "BW")  # the transformer layers' ops (not the vocabulary passes')


def action_times(agreed: AgreedProfile, config: RunConfig) -> ActionTimes:
    """Every profiled op and stage of ``agreed``: median host and device time (ms), the median wait
    bound (ms; ``None`` on CPU), the host-bound flag and, for a host-bound op, its likely causes."""
    rows = []
    for op in OPS:
        for stage in sorted(s for o, s in agreed.host_ms if o == op):
            device, waited = agreed.costs_ms[(op, stage)], agreed.waited_ms.get((op, stage))
            bound = waited is not None and device > 0 and waited > HOST_BOUND_FRACTION * device
            rows.append(OpTime(op=op, stage=stage, host_ms=agreed.host_ms[(op, stage)], device_ms=device,
                               waited_ms=waited, host_bound=bound,
                               causes=likely_causes(op, stage, config) if bound else ()))
    return ActionTimes(clock=agreed.clock, host_bound_fraction=HOST_BOUND_FRACTION, ops=tuple(rows))


def likely_causes(op: str, stage: int, config: RunConfig) -> tuple[str, ...]:
    """The causes of a host-bound ``op`` on ``stage`` that ``config`` shows, one clause each (never
    empty: without one, the clause says that none is visible). F reads micro batches on the first and
    the last stage (the chunks that :attr:`~megatron_zb.training.model_setup.ModelBundle.reads_data`
    gives an iterator)."""
    data, b, s = config.data, config.micro_batch_size, config.model.seq_length
    reads_data = op == "F" and stage in (0, config.schedule.num_pipeline_stages - 1)
    causes = []
    if reads_data and data.num_workers == 0:
        causes.append("data loading in the main thread (--num-workers 0)")
    if reads_data and data.create_attention_mask_in_dataloader:
        causes.append(f"the attention mask in the data loader (megatron-core's create_attention_mask_in_dataloader: "
                      f"a [{b}, 1, {s}, {s}] bool tensor, {b * s * s / 2 ** 20:.1f} MiB per micro batch to "
                      f"collate and copy to the GPU; --no-create-attention-mask-in-dataloader leaves it to "
                      f"megatron-core's attention)")
    if op in ("F", "B", "BW") and config.logging.timing_log_level >= 2:
        causes.append("megatron-core's level-2 timers, which synchronise the device at every forward-compute / "
                      "backward-compute start and stop (--timing-log-level 2)")
    if op in _LAYER_OPS and config.model.transformer_impl == "local":
        causes.append("the local layers' unfused kernels, each launched from Python (--transformer-impl local; "
                      "Transformer Engine fuses them)")
    return tuple(causes) or ("none visible in this run's configuration (the host's own launch time, or a "
                             "synchronisation inside the action)",)


def action_times_lines(times: ActionTimes) -> str:
    """The schedule report's lines: host / device time per op and stage (on CUDA also the wait bound),
    then one line per host-bound op and stage with its likely causes (none when nothing is host-bound)."""
    cpu = times.clock == "host"
    head = ("    measured host / device time per action (ms, median per stage; host = device on CPU, where no "
            "wait for the host can be observed): " if cpu else
            "    measured host / device time per action / the device's wait for the host in it, at most (ms, "
            "median per stage; device: CUDA events): ")
    per_op = []
    for op in OPS:
        rows = [o for o in times.ops if o.op == op]
        if rows:
            per_op.append(f"{op}=[" + ", ".join(
                f"{o.host_ms:.3f}/{o.device_ms:.3f}" + ("" if o.waited_ms is None else f"/{o.waited_ms:.3f}")
                for o in rows) + "]")
    lines = [head + "; ".join(per_op)]
    for o in times.ops:
        if o.host_bound:
            lines.append(f"    {o.op} is host-bound on stage {o.stage}: the GPU waited up to {o.waited_ms:.1f} "
                         f"of its {o.device_ms:.1f} ms for the host")
            lines.append("      likely causes: " + "; ".join(o.causes))
    return "\n".join(lines)

"""The printed plan and its ``--json`` document.

JSON (``plan --json FILE``)::

    {
      "schedules": [                      # every family that was simulated, registry order
        {"name": "zb-2p", "iteration_time_ms": 1652.3, "bubble_rate": 0.0029,
         "peak_memory_gib": 57.5, "fits": true,
         "throughput_samples_per_gpu_s": 14.6, "model_tflops_per_gpu": ..., "makespan_ms": ...,
         "optimizer_ms": ...,
         "dp_sync_ms": ..., "peak_activation_gib": ..., "param_optimizer_gib": ...,
         "peak_memory_per_rank_gib": [...], "peak_activation_per_rank_gib": [...],
         "param_optimizer_per_rank_gib": [...],   # per pipeline rank, rank order
         "chunks": 1, "memory_limit_n": null, "cost_source": "estimate", "step_source": "estimate",
         "duration_spread_ms": null,       # > 0: a profile's measured duration spread (planner doc)
         "vocab_base": null,               # --enable-vocab-parallel: "zb-h1" for "zb-h1-vocab-1"
         "wgrad_group": null,              # optim_grads: the W group size k the row is for
         "wgrad_groups": null}, ...],      # optim_grads: [{"k": null (the distributed optimizer) or k,
                                           #   "reduces_per_bucket", "iteration_time_ms", "exposed_reduce_ms",
                                           #   "activation_gib", "model_state_gib" (per rank), "peak_gib",
                                           #   "fits"}, ...]
      "recommended": "zb-2p",             # fastest that fits, or null
      "not_planned": [{"name": "zb-optimal", "status": "skipped", "reason": "..."}, ...],
      "t_comm_ms": 1.15,
      "action_overhead_ms": 0.0,          # added to every compute action (a profile's measured value)
      "stages": [{"stage": 0, "rank": 0, "layers": 2, "embedding": true, "loss": false,
                  "t_f_ms": ..., "t_b_ms": ..., "t_w_ms": ..., "mem_b_gib": ..., "mem_w_gib": ...}, ...],
      "inputs": {"model": {...}, "parallel": {...}, "hardware": {...}, "memory_fraction": 0.9,
                 "profile": null}
    }

Names are the registry's (``megatron-zb list``); times in ms, memory in GiB (2**30 bytes),
throughput in samples per second per GPU; ``model_tflops_per_gpu`` is what ``--log-throughput``
would print at the predicted iteration time (Megatron-LM's model FLOPs, :mod:`.model_flops`).
``stages`` is the plain placement (one stage per rank).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from .memory import GIB
from .planner import SPREAD_DRAWS, FamilyResult, Plan
from .sharded import GroupRow

_KEYS = ("iteration_time_ms", "bubble_rate", "peak_memory_gib", "fits")
_MORE = ("makespan_ms", "optimizer_ms", "dp_sync_ms", "peak_activation_gib", "param_optimizer_gib",
         "peak_memory_per_rank_gib", "peak_activation_per_rank_gib", "param_optimizer_per_rank_gib", "chunks",
         "memory_limit_n", "cost_source", "step_source", "duration_spread_ms", "model_tflops_per_gpu",
         "vocab_base", "wgrad_group")


def to_json(plan: Plan) -> dict[str, Any]:
    """The ``--json`` document (see the module doc)."""
    sched = []
    for f in plan.families:
        if f.status != "ok":
            continue
        row: dict[str, Any] = {"name": f.name, **{k: getattr(f, k) for k in _KEYS},
                               "throughput_samples_per_gpu_s": f.throughput}
        row.update({k: getattr(f, k) for k in _MORE})
        row["wgrad_groups"] = None if f.wgrad_groups is None else [_group_json(g) for g in f.wgrad_groups]
        sched.append(row)
    st = plan.stages
    stages = [{"stage": sh.stage, "rank": sh.rank, "layers": sh.num_layers, "embedding": sh.embedding,
               "loss": sh.loss, "t_f_ms": st.t_f[i], "t_b_ms": st.t_b[i], "t_w_ms": st.t_w[i],
               "mem_b_gib": st.mem_b[i] / GIB, "mem_w_gib": st.mem_w[i] / GIB} for i, sh in enumerate(st.shapes)]
    return {
        "schedules": sched,
        "recommended": plan.recommended,
        "not_planned": [{"name": f.name, "status": f.status, "reason": f.reason}
                        for f in plan.families if f.status != "ok"],
        "t_comm_ms": plan.t_comm_ms,
        "action_overhead_ms": plan.action_overhead_ms,
        "stages": stages,
        "inputs": {"model": plan.model.to_flags(), "parallel": plan.parallel.to_flags(),
                   "hardware": asdict(plan.hardware), "memory_fraction": plan.memory_fraction,
                   "profile": None if plan.profile is None else plan.profile.to_dict()},
    }


def _group_json(g: GroupRow) -> dict[str, Any]:
    return {"k": g.k, "reduces_per_bucket": g.reduces_per_bucket, "iteration_time_ms": g.iteration_time_ms,
            "exposed_reduce_ms": g.exposed_reduce_ms, "activation_gib": [b / GIB for b in g.activation_bytes],
            "model_state_gib": [b / GIB for b in g.model_state_bytes], "peak_gib": g.peak_bytes / GIB,
            "fits": g.fits}


def group_lines(plan: Plan) -> list[str]:
    """With sharded gradients: the recommended family's table of W group sizes beside the distributed optimizer."""
    fam = next((f for f in plan.families if f.name == plan.recommended), None)
    if fam is None or fam.wgrad_groups is None:
        return []
    base = fam.wgrad_groups[0]
    lines = [f"sharded gradients (optim_grads), {fam.name}: W groups of k microbatches, each bucket "
             f"reduce-scattered m/k times per iteration",
             f"  {'k':<24}{'RS/bucket':>10}{'iter ms':>11}{'vs dist-opt':>12}{'exposed ms':>11}{'act GiB':>9}"
             f"{'state GiB':>10}{'peak GiB':>9} fits"]
    for g in fam.wgrad_groups:
        label = ("distributed optimizer" if g.k is None else
                 f"k={g.k}" + (" (recommended)" if g.k == fam.wgrad_group and plan.parallel.wgrad_group is None else ""))
        lines.append(f"  {label:<24}{g.reduces_per_bucket:>10}{g.iteration_time_ms:>11.1f}"
                     f"{g.iteration_time_ms / base.iteration_time_ms:>11.3f}x{g.exposed_reduce_ms:>11.2f}"
                     f"{max(g.activation_bytes) / GIB:>9.2f}{max(g.model_state_bytes) / GIB:>10.2f}"
                     f"{g.peak_bytes / GIB:>9.2f}  {'yes' if g.fits else 'NO'}")
    lines.append("  (state = parameters, gradients (sharded: shard, two work buffers, residual), optimizer state; "
                 "act and state are the largest rank's)")
    return lines


def _header(plan: Plan) -> list[str]:
    m, p, hw = plan.model, plan.parallel, plan.hardware
    attn = "flash" if m.use_flash_attn else "unfused"
    gqa = f", {m.num_query_groups} query groups" if m.num_query_groups != m.num_attention_heads else ""
    return [
        f"model: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads{gqa}, "
        f"ffn {m.ffn_hidden_size}{' (SwiGLU)' if m.swiglu else ''}, seq {m.seq_length}, micro batch "
        f"{m.micro_batch_size}, vocab {m.padded_vocab_size(p.tp)} (padded), {attn} attention, {m.precision}",
        f"layout: PP {p.pp} x TP {p.tp}{' (sequence parallel)' if p.sequence_parallel else ''} x DP {p.dp}, "
        f"{p.num_microbatches} microbatches per iteration"
        f"{', distributed optimizer' if p.use_distributed_optimizer else ''}"
        f"{', sharded gradients (optim_grads)' if p.data_parallel_sharding_strategy == 'optim_grads' else ''}",
        f"GPU {hw.name}: {hw.peak_tflops:g} TFLOP/s x mfu {hw.mfu:g}, HBM {hw.hbm_gbs:g} GB/s x {hw.hbm_efficiency:g}, "
        f"{hw.memory_gib:g} GiB (plans use {plan.memory_fraction:.0%}), TP link {hw.tp_gbs:g} GB/s, "
        f"P2P {hw.p2p_gbps:g} Gbit/s + {hw.p2p_latency_ms:g} ms",
    ]


def _stage_lines(plan: Plan) -> list[str]:
    """The plain placement's costs, consecutive identical stages merged."""
    st = plan.stages
    lines = [f"stage costs per microbatch ({st.source}; plain placement, one stage per rank); "
             f"T_comm {plan.t_comm_ms:.3f} ms",
             f"  {'stages':<8}{'layers':<12}{'T_F ms':>9}{'T_B ms':>9}{'T_W ms':>9}{'M_B GiB':>9}{'M_W GiB':>9}"]
    rows: list[tuple[int, int, tuple]] = []
    for i, sh in enumerate(st.shapes):
        what = f"{sh.num_layers}{' + embedding' if sh.embedding else ''}{' + loss' if sh.loss else ''}"
        vals = (what, st.t_f[i], st.t_b[i], st.t_w[i], st.mem_b[i] / GIB, st.mem_w[i] / GIB)
        if rows and rows[-1][2] == vals:
            rows[-1] = (rows[-1][0], i, vals)
        else:
            rows.append((i, i, vals))
    for a, b, (what, tf, tb, tw, mb, mw) in rows:
        span = str(a) if a == b else f"{a}-{b}"
        lines.append(f"  {span:<8}{what:<12}{tf:>9.2f}{tb:>9.2f}{tw:>9.2f}{mb:>9.2f}{mw:>9.2f}")
    return lines


def _label(f: FamilyResult) -> str:
    return f.name + (f" (N={f.memory_limit_n})" if f.memory_limit_n is not None else "")


def _family_line(f: FamilyResult, width: int) -> str:
    return (f"  {_label(f):<{width}}{f.chunks:>7}{f.iteration_time_ms:>11.1f}{f.throughput:>10.3f}{f.bubble_rate:>8.3f}"
            f"{f.peak_activation_gib:>8.1f}{f.param_optimizer_gib:>8.1f}{f.peak_memory_gib:>8.1f}"
            f"  {'yes' if f.fits else 'NO'}")


def _iteration_terms(plan: Plan) -> str:
    """What ``iter ms`` adds up, with the sources of the measured terms."""
    sim = "simulated makespan"
    if plan.action_overhead_ms:
        sim += f" (actions + {plan.action_overhead_ms:.3f} ms measured runtime overhead each)"
    if any(f.duration_spread_ms is not None for f in plan.families if f.status == "ok"):
        sim += (" with every action's duration drawn from the profile's measured spread (median of "
                f"{SPREAD_DRAWS} draws)")
    measured = any(f.step_source == "profile" for f in plan.families if f.status == "ok")
    if plan.parallel.data_parallel_sharding_strategy == "optim_grads":
        sim += (" with each W group's bucket reduce-scatters on the DP channel" + (
            " + measured time outside the schedule (profile step_ms)" if measured else
            " + the residual gradients' reduce-scatter + optimizer step (estimates)"))
        return sim
    return sim + (" + measured time outside the schedule (profile step_ms: optimizer, reduces, logging)"
                  if measured else " + optimizer step + DP gradient all-reduce (estimates)")


def render(plan: Plan) -> str:
    """The text ``plan`` prints."""
    lines = _header(plan) + [""] + _stage_lines(plan) + [""]
    ok = [f for f in plan.families if f.status == "ok"]
    width = max([len(_label(f)) for f in ok] + [8]) + 2
    lines.append(f"  {'schedule':<{width}}{'chunks':>7}{'iter ms':>11}{'smp/s/GPU':>10}{'bubble':>8}"
                 f"{'act GiB':>8}{'p+o GiB':>8}{'peak GiB':>9} fits")
    lines += [_family_line(f, width) for f in ok]
    lines.append("  (iter = " + _iteration_terms(plan) + "; act = peak activations, "
                 "p+o = parameters and optimizer state, of the rank with the most)")
    rest = [f for f in plan.families if f.status != "ok"]
    if rest:
        lines.append("not planned:")
        lines += [f"  {f.name}: {f.status}: {f.reason}" for f in rest]
    lines += vocab_lines(plan)
    lines += group_lines(plan)
    lines.append("")
    lines.append(recommendation(plan))
    return "\n".join(lines)


def vocab_lines(plan: Plan) -> list[str]:
    """With ``--enable-vocab-parallel``: each vocabulary-parallel family beside its base family --
    throughput ratio, the largest rank's peak memory, parameters + optimizer state max/min over ranks."""
    if not plan.vocab_parallel:
        return []
    fams = {f.name: f for f in plan.families if f.status == "ok"}
    pairs = [(f, fams[f.vocab_base]) for f in fams.values() if f.vocab_base in fams]
    if not pairs:
        return ["vocabulary parallelism: no vocabulary-parallel family was planned beside its base family"]
    width = max(len(f.name) for f, _ in pairs) + 2
    lines = ["vocabulary parallelism (each beside its family without it):",
             f"  {'schedule':<{width}}{'base':<10}{'speed-up':>9}{'peak GiB':>18}{'p+o max/min':>18}"]
    for f, b in pairs:
        def spread(x: FamilyResult) -> str:
            po = x.param_optimizer_per_rank_gib or [0.0]
            return f"{max(po) / min(po):.2f}" if min(po) > 0 else "inf"
        lines.append(f"  {f.name:<{width}}{b.name:<10}{f.throughput / b.throughput:>8.3f}x"
                     f"{b.peak_memory_gib:>8.2f} -> {f.peak_memory_gib:<6.2f}{spread(b):>9} -> {spread(f):<6}")
    return lines


def recommendation(plan: Plan) -> str:
    """One line: the recommended family and how it compares with 1F1B, or why there is none."""
    if plan.recommended is None:
        return (f"recommended: none -- no planned schedule fits in {plan.memory_fraction:.0%} of "
                f"{plan.hardware.memory_gib:g} GiB; use more pipeline or tensor parallelism, a smaller micro "
                f"batch, or the distributed optimizer")
    fams = {f.name: f for f in plan.families if f.status == "ok"}
    best = fams[plan.recommended]
    line = f"recommended: {best.name}"
    if best.memory_limit_n is not None:
        line += f" with --zero-bubble-max-pending-backward {best.memory_limit_n}"
    if best.wgrad_group is not None:
        line += f"{' and' if best.memory_limit_n is not None else ' with'} --zero-bubble-wgrad-group {best.wgrad_group}"
    line += f" ({best.throughput:.3f} samples/s per GPU, peak {best.peak_memory_gib:.1f} GiB"
    base = fams.get("1f1b")
    if base is not None and best.name != "1f1b":
        line += f"; {best.throughput / base.throughput:.3f}x 1f1b's throughput"
    return line + ")"

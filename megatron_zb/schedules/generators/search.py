"""Knob search for the list scheduler: coordinate descent over :class:`~.list_scheduler.Knobs`.

:func:`search` tunes the knobs of :func:`~.list_scheduler.list_schedule` per problem, every
candidate scored by its simulated ``(makespan, peak memory, total time)``. :func:`knob_space` says
which values each knob takes; :func:`proxy_costs` gives simplified cost models to build extra
candidate orders with (on long pipelines the scheduler's reaction to small communication delays
can drift into an irregular steady state, while an order built without them stays regular and is
better under the real costs too).

Units: times in the unit of the costs; memory limits in the unit of ``costs.mem_b``.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence

from ..costs import StageCosts
from ..ir import Action
from ..limits import count_that_fit
from ..timing import decode
from .common import first_b_caps
from .list_scheduler import Knobs, _asap_codes, _schedule_codes

__all__ = ["knob_space", "proxy_costs", "search"]


def proxy_costs(sc: StageCosts) -> list[tuple[str, StageCosts]]:
    """Simplified cost models to build extra candidate orders with: no ``T_comm``; equal times."""
    out = []
    if sc.t_comm > 0:
        out.append(("T_comm = 0", replace(sc, t_comm=0.0)))
    n = len(sc.t_f)
    if len(set(sc.t_f) | set(sc.t_b) | set(sc.t_w)) > 1:
        out.append(("unit times", replace(sc, t_f=(1.0,) * n, t_b=(1.0,) * n, t_w=(1.0,) * n, t_comm=0.0, t_bw=None)))
    return out


def _first_turn_caps(s2r: Sequence[int], sc: StageCosts, m: int, extra: float) -> tuple[int, ...]:
    """Per rank: forwards of its first chunk that fit before microbatch 0 reaches its last chunk."""
    n = len(s2r)
    p = max(s2r) + 1
    caps = []
    for r in range(p):
        ls = [s for s in range(n) if s2r[s] == r]
        s0, s1 = ls[0], ls[-1]
        t = 0.0
        for s in range(s0 + 1, s1):
            t += sc.t_f[s]
        t += sc.t_comm * sum(1 for s in range(s0, s1) if s2r[s] != s2r[s + 1])
        caps.append(max(1, min(m, int(math.floor(t / sc.t_f[s0] + extra + 1e-9)) + 1)))
    return tuple(caps)


def knob_space(s2r: Sequence[int], sc: StageCosts, m: int, limit: float | None) -> dict[str, list]:
    """The values :func:`search` tries for each knob (see :class:`Knobs`)."""
    p = max(s2r) + 1
    n = len(s2r)
    period = max(sum(sc.t_f[s] + sc.t_b[s] + sc.t_w[s] for s in range(n) if s2r[s] == r) for r in range(p))
    full = max(sum(sc.mem_b[s] for s in range(n) if s2r[s] == r) for r in range(p))
    caps: list = [None]
    if limit is not None and math.isfinite(limit) and full > 0:
        k = count_that_fit(limit, full)
        caps += [(c,) * p for c in (k - 1, k, k + 1) if 1 <= c < m]
    caps.append(first_b_caps(s2r, sc, m, rounding="floor+1"))
    return {
        "open_caps": [_first_turn_caps(s2r, sc, m, 0.0), _first_turn_caps(s2r, sc, m, 0.5), None],
        "caps": caps,
        "pace": [None] + [(period * f, k) for f in (1.0, 1.05) for k in (1, 2, 4)],
        "b_pick": ["late", "early", "old"],
        "f_pick": ["late", "old"],
        "f_first": [False, True],
        "w_gap": [1.0, 0.5, 0.0],
        "eager_w": [None, 0],
    }


def _knob_name(cfg: dict) -> str:
    parts = []
    for k, v in cfg.items():
        if isinstance(v, tuple) and v and isinstance(v[0], int):
            v = "(" + ",".join(map(str, v[:4])) + (",..)" if len(v) > 4 else ")")
        elif isinstance(v, tuple):
            v = f"({v[0]:.4g},{v[1]})"
        parts.append(f"{k}={v}")
    return " ".join(parts)


def search(s2r: Sequence[int], m: int, sc: StageCosts, limit: float | None, *,
           seeds: Sequence[dict] | None = None, space: dict[str, list] | None = None,
           max_sweeps: int = 2) -> tuple[list[list[Action]], tuple[float, float, float], str] | None:
    """Coordinate descent over the knobs of :func:`~.list_scheduler.list_schedule`; keeps the best score.

    Starts from each seed configuration, then sweeps the knobs one at a time (every value of one
    knob with the others fixed at the best so far) until a sweep brings nothing or ``max_sweeps``
    sweeps are done. The score is ``(makespan, peak memory, total time)``, lower is better.
    Returns ``(per-rank orders, score, description)`` or ``None`` if every configuration got stuck.
    """
    space = space if space is not None else knob_space(s2r, sc, m, limit)
    base = {k: v[0] for k, v in space.items()}
    if seeds is None:
        seeds = [{}, {"pace": space["pace"][1] if len(space["pace"]) > 1 else None, "b_pick": "early"},
                 {"open_caps": None, "b_pick": "early", "f_first": True}]
    cache: dict[tuple, tuple | None] = {}

    def evaluate(cfg: dict) -> tuple | None:
        key = tuple(cfg[k] for k in space)
        if key not in cache:
            out = _schedule_codes(s2r, m, sc, limit, Knobs(name=_knob_name(cfg), **cfg))
            if out is not None and cfg.get("pace") is not None:
                # pacing idles on purpose, which an order cannot express: score what the simulator
                # makes of the order (every action as soon as possible)
                out = (out[0],) + _asap_codes(s2r, m, sc, out[0])
            cache[key] = None if out is None else (
                (round(out[1], 9), round(out[2], 9), round(out[3], 9)), out[0])
        return cache[key]

    best: tuple | None = None
    for seed in seeds:
        cfg = dict(base, **{k: v for k, v in seed.items() if k in space})
        got = evaluate(cfg)
        if got is not None and (best is None or got[0] < best[0]):
            best = (got[0], got[1], cfg)
    if best is None:
        for k, vals in space.items():          # seeds stuck: try each single change from the base
            for v in vals:
                cfg = dict(base, **{k: v})
                got = evaluate(cfg)
                if got is not None and (best is None or got[0] < best[0]):
                    best = (got[0], got[1], cfg)
        if best is None:
            return None
    for _ in range(max_sweeps):
        improved = False
        for k, vals in space.items():
            for v in vals:
                if v == best[2][k]:
                    continue
                cfg = dict(best[2], **{k: v})
                got = evaluate(cfg)
                if got is not None and got[0] < best[0]:
                    best, improved = (got[0], got[1], cfg), True
        if not improved:
            break
    return [[decode(c) for c in row] for row in best[1]], best[0], _knob_name(best[2])

"""Hash every generator's schedules on a fixed grid, to prove a refactor leaves them unchanged.

    python scripts/schedule_hashes.py dump OUT.json [--quick]
    python scripts/schedule_hashes.py compare BEFORE.json AFTER.json
    python scripts/schedule_hashes.py recheck BEFORE.json AFTER.json   # recompute the differing entries

Each entry is ``name|p|m|costs|limit`` -> sha256 of the schedule's JSON (placement and per-rank
orders; ``meta`` is left out) or ``error: <type>: <message>``. The grid: every registered name at
p 1-8, m 1-16 (a sample), several cost models and memory limits (None, the cost model's own, and
multiples of each placement's minimum, at the minimum included); the greedy up to p=32, m=256 and
the V family up to p=16, m=48 (samples); ``zb-optimal``/``zbv-optimal`` only at p<=2, m<=3, where
CP-SAT proves the optimum (their makespan is compared, not the order: CP-SAT with two workers may
return any optimal order).
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import time

from megatron_zb.schedules import CostModel
from megatron_zb.schedules.costs import DPReduceModel
from megatron_zb.schedules.registry import SCHEDULES, build_schedule


VARIANTS: dict[str, str] = {}
"""The winning variant of each entry (``meta["variant"]``), written beside the hashes."""


def _costs(kind: str, n: int) -> CostModel:
    """The cost model ``kind`` for ``n`` stages."""
    if kind == "unit":
        return CostModel()
    if kind == "paper":
        return CostModel(t_f=1.0, t_b=1.1, t_w=0.9, t_comm=0.05, mem_b=1.0, mem_w=0.4)
    if kind == "uneven":
        return CostModel(t_f=[1.0 + 0.1 * (s % 3) for s in range(n)], t_b=[1.2 + 0.05 * (s % 2) for s in range(n)],
                         t_w=[0.7 + 0.1 * (s % 4) for s in range(n)], t_comm=0.1,
                         mem_b=[1.0 + (0.5 if s == n - 1 else 0.0) + 0.25 * (s % 2) for s in range(n)],
                         mem_w=[0.3 + 0.1 * (s % 3) for s in range(n)])
    if kind == "heavyw":
        return CostModel(t_f=1.0, t_b=1.0, t_w=2.0, t_comm=0.3, mem_b=2.0, mem_w=2.0)
    if kind == "own-limit":   # the cost model carries the limit (1.5 x the plain minimum)
        return CostModel(t_f=1.0, t_b=1.3, t_w=0.6, mem_b=1.0, mem_w=0.5, memory_limit=None)
    if kind == "dp":
        return CostModel(t_f=1.0, t_b=1.0, t_w=1.0, t_comm=0.1,
                         dp_reduce=DPReduceModel(stage_bytes=[4.0 + s for s in range(n)], bucket_bytes=2.0,
                                                 bandwidth=2.0))
    if kind == "zero-mem":
        return CostModel(mem_b=0.0)
    raise ValueError(kind)


COSTS = ("unit", "paper", "uneven", "heavyw", "own-limit", "dp", "zero-mem")


def _stages(name: str, p: int, chunks: int = 2) -> int:
    return SCHEDULES[name].chunks_per_rank(chunks) * p


def _minimum(name: str, p: int, c: CostModel) -> float:
    """One microbatch's activations on the fullest rank (every placement's minimum)."""
    n = _stages(name, p)
    sc = c.resolve(n)
    spec = SCHEDULES[name]
    from megatron_zb.schedules.ir import Placement, interleaved_placement, plain_placement, v_placement
    s2r = {Placement.PLAIN: plain_placement(p), Placement.V: v_placement(p),
           Placement.INTERLEAVED: interleaved_placement(p, 2)}[spec.placement]
    return max(sum(sc.mem_b[s] for s in range(n) if s2r[s] == r) for r in range(p))


def _limits(name: str, p: int, c: CostModel) -> list[tuple[str, float | None]]:
    if not SCHEDULES[name].cost_aware:
        return [("none", None)]
    low = _minimum(name, p, c)
    out: list[tuple[str, float | None]] = [("none", None)]
    if low > 0:
        out += [("min", low), ("1.5min", 1.5 * low), ("p/2min", max(1, p / 2) * low), ("p-min", p * low)]
        out += [("below", low * (1 - 1e-6))]
    return out


def _entry(name: str, p: int, m: int, ckind: str, lkind: str, limit: float | None) -> str:
    c = _costs(ckind, _stages(name, p))
    if ckind == "own-limit":
        c = c.with_limit(1.5 * _minimum(name, p, c))
    try:
        if name.endswith("-optimal"):
            s = build_schedule(name, num_ranks=p, num_microbatches=m, costs=c, memory_limit=limit)
            return (f"optimal={s.meta['optimal']} makespan={round(s.meta['makespan'], 9)} "
                    f"limit={s.meta['memory_limit']}")
        s = build_schedule(name, num_ranks=p, num_microbatches=m, costs=c, memory_limit=limit)
    except Exception as e:  # noqa: BLE001 - the error itself is what is recorded
        return f"error: {type(e).__name__}: {e}"
    VARIANTS[f"{name}|{p}|{m}|{ckind}|{lkind}"] = str(s.meta.get("variant"))
    return hashlib.sha256(s.to_json().encode()).hexdigest()[:16] + f" limit={s.meta.get('memory_limit')}"


def grid(quick: bool) -> list[tuple[str, int, int, str]]:
    """``(name, p, m, costs)`` cases: ``--quick`` crosses 8 sampled ``(p, m)`` with every cost model;
    the full grid samples 24 other ``(p, m, costs)`` per name and adds the large cases."""
    rng = random.Random(28)
    cases = []
    small = [(p, m) for p in range(1, 9) for m in range(1, 17)]
    for name in SCHEDULES:
        if name.endswith("-optimal"):
            if quick:
                cases += [(name, p, m, ck) for p, m in ((1, 1), (1, 2), (2, 1), (2, 2), (2, 3))
                          for ck in ("unit", "paper", "own-limit")]
            continue
        costs = COSTS if SCHEDULES[name].cost_aware else ("unit",)
        pm = rng.sample(small, 8)
        if quick:
            cases += [(name, p, m, ck) for p, m in pm for ck in costs]
        else:
            rng2 = random.Random(name)
            cases += [(name, p, m, rng2.choice(costs)) for p, m in rng2.sample(small, 24)]
    if quick:
        cases += [(name, p, m, ck) for p, m in ((16, 64), (24, 96)) for name in ("zb", "zb-2p")
                  for ck in ("paper", "uneven")]
        return cases + [(name, 9, 20, ck) for name in ("zbv", "v-half", "v-min") for ck in ("paper", "uneven")]
    for p, m in ((16, 64), (24, 96), (32, 128), (32, 256), (12, 200)):
        for name in ("zb", "zb-2p"):
            cases.append((name, p, m, "paper" if m != 200 else "uneven"))
    for p, m, name in ((9, 20, "zbv"), (12, 24, "v-min"), (12, 48, "zbv"), (16, 32, "v-half"), (16, 48, "zbv")):
        cases.append((name, p, m, "paper"))
    return cases


def dump(path: str, quick: bool) -> None:
    out: dict[str, str] = {}
    t0 = time.time()
    for name, p, m, ck in grid(quick):
        c = _costs(ck, _stages(name, p))
        big = p * m > 200
        for lk, lim in _limits(name, p, c):
            if big and lk not in ("none", "p/2min"):
                continue
            out[f"{name}|{p}|{m}|{ck}|{lk}"] = _entry(name, p, m, ck, lk, lim)
    json.dump(out, open(path, "w"), indent=0, sort_keys=True)
    json.dump(VARIANTS, open(path + ".variants", "w"), indent=0, sort_keys=True)
    print(f"{len(out)} entries in {time.time() - t0:.0f} s -> {path}")


def compare(a: str, b: str) -> int:
    x, y = json.load(open(a)), json.load(open(b))
    diff = [k for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)]
    for k in diff:
        print(f"{k}\n  before: {x.get(k)}\n  after:  {y.get(k)}")
    print(f"{len(x)} before, {len(y)} after, {len(diff)} differ")
    return 1 if diff else 0


def recheck(before: str, after: str) -> int:
    """Recompute, with the code as it is now, only the entries where ``after`` differs from ``before``."""
    x, y = json.load(open(before)), json.load(open(after))
    now = dict(y)
    for k in sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k)):
        name, p, m, ck, lk = k.split("|")
        c = _costs(ck, _stages(name, int(p)))
        limit = dict(_limits(name, int(p), c))[lk]
        now[k] = _entry(name, int(p), int(m), ck, lk, limit)
    json.dump(now, open(after + ".rechecked", "w"), indent=0, sort_keys=True)
    return compare(before, after + ".rechecked")


if __name__ == "__main__":
    if sys.argv[1] == "dump":
        dump(sys.argv[2], "--quick" in sys.argv)
    elif sys.argv[1] == "recheck":
        sys.exit(recheck(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(compare(sys.argv[2], sys.argv[3]))

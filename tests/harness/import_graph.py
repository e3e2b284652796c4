"""A cycle in a module import graph (the layout tests of ``megatron_zb.schedules`` and of the whole package)."""

from __future__ import annotations

__all__ = ["find_cycle"]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (module -> the modules it imports), as ``[a, b, ..., a]``, or ``None``;
    depth-first in sorted order, so the same graph always gives the same cycle."""
    state: dict[str, int] = {}          # 1: on the current path, 2: done
    path: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        path.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                return path[path.index(v):] + [v]
            if v not in state and (found := visit(v)):
                return found
        path.pop()
        state[u] = 2
        return None

    for u in sorted(graph):
        if u not in state and (found := visit(u)):
            return found
    return None

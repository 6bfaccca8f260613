"""Static sparse trees for Medusa, built from MEASURED per-head rank accuracies (not hand-copied presets).

A node is a path (r_1, ..., r_d): the r_j-th ranked token of head j-1. With acc[j][r] = P(the target's greedy
token equals head j's rank-r token), treating heads as independent (Medusa sec. 2.1.2), the probability that the
node is accepted is prod_j acc[j][r_j], and E[tau] = 1 + sum over nodes of that probability (bonus included).
Greedily adding the most probable frontier node maximises E[tau] for a node budget, since a child is never more
probable than its parent (so the chosen set is always a tree).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def medusa_tree(
    acc: Sequence[Sequence[float]], total_tokens: int, max_depth: int | None = None
) -> list[tuple[int, ...]]:
    """Choose `total_tokens` paths maximising expected accepted length. acc [heads][ranks] -> paths sorted so
    parents precede children (by depth, then probability)."""
    depth_cap = min(len(acc), max_depth or len(acc))
    chosen: list[tuple[float, tuple[int, ...]]] = []
    heap: list[tuple[float, tuple[int, ...]]] = [
        (-acc[0][r], (r,)) for r in range(len(acc[0])) if acc[0][r] > 0
    ]
    heapq.heapify(heap)
    while heap and len(chosen) < total_tokens:
        neg, path = heapq.heappop(heap)
        chosen.append((-neg, path))
        d = len(path)
        if d < depth_cap:
            for r in range(len(acc[d])):
                if acc[d][r] > 0:
                    heapq.heappush(heap, (neg * acc[d][r], (*path, r)))
        # the next sibling rank is already in the heap (all ranks of a level are pushed together)
    chosen.sort(key=lambda x: (len(x[1]), -x[0], x[1]))
    return [p for _, p in chosen]


def tree_parents(paths: Sequence[tuple[int, ...]]) -> list[int]:
    """Parent index of each path (-1 for depth 1); paths must list parents first."""
    where = {p: i for i, p in enumerate(paths)}
    parents = []
    for i, p in enumerate(paths):
        parent = where.get(p[:-1], -1) if len(p) > 1 else -1
        if len(p) > 1 and (parent < 0 or parent >= i):
            raise ValueError(f"tree path {p} has no earlier parent")
        parents.append(parent)
    return parents


def chain_tree(depth: int) -> list[tuple[int, ...]]:
    """The top-1 chain of `depth` nodes (what vLLM's Medusa proposes)."""
    return [(0,) * d for d in range(1, depth + 1)]

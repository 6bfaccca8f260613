"""The EAGLE-2 dynamic draft tree (Li et al. 2024, sec. 4), for any drafter that can score a batch of frontier
nodes in one step: depth 1 = the top_k tokens after the root; each further depth expands the top_k candidates
of the previous depth (by cumulative draft log-prob) in ONE batched step; at the end the `total` best candidates
of all depths form the tree. Tokens are chosen deterministically (top-k), so each node is a point mass and
verification stays exact under sampling too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Expand = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor | None], torch.Tensor]


def dynamic_tree(
    root_logp: torch.Tensor, expand: Expand, *, top_k: int, depth: int, total: int, drafted: int = 0
) -> tuple[torch.Tensor, list[int]]:
    """Grow the tree; return (tokens [N] in the drafter's token space, parent index per node, -1 = root).

    root_logp [V]: the drafter's log-probs after the root. expand(tokens [F], attend [F, m0 + F] bool, depth d,
    parent_rows [F] | None) -> log-probs [F, V]: one draft step over the F frontier nodes at depth d+1, where
    attend[i] marks which drafted rows node i sees (the m0 rows drafted before this step, then the F new ones:
    its ancestors and itself) and parent_rows[i] is its parent's row in the previous `expand` call's output
    (None when the parents are the root). `drafted`: rows the drafter had already drafted before depth 1 (all of
    them visible to every node, e.g. the root itself)."""
    dev = root_logp.device
    top = root_logp.topk(top_k)
    toks_l, score_l = [top.indices], [top.values]
    parent_l = [torch.full((top_k,), -1, device=dev, dtype=torch.long)]
    frontier = torch.arange(top_k, device=dev)  # candidate ids of the nodes expanded next
    parent_rows = parent_local = None  # the parents' rows among all drafted rows / in the last step's output
    anc = torch.ones(drafted, drafted, dtype=torch.bool, device=dev)  # ancestor-or-self among drafted rows
    eye = torch.eye(top_k, dtype=torch.bool, device=dev)
    n_cand = top_k
    for d in range(1, depth):
        m0, f = anc.shape[0], frontier.shape[0]
        inherited = anc[parent_rows] if parent_rows is not None else anc.new_ones(f, m0)
        attend = torch.cat([inherited, eye[:f, :f]], 1)  # [F, m0 + F]
        child = expand(torch.cat(toks_l)[frontier], attend, d, parent_local).topk(top_k, dim=-1)  # [F, top_k]
        anc = torch.cat([torch.cat([anc, anc.new_zeros(m0, f)], 1), attend], 0)
        score = (torch.cat(score_l)[frontier][:, None] + child.values).flatten()  # cumulative log-prob
        toks_l.append(child.indices.flatten())
        score_l.append(score)
        parent_l.append(frontier[:, None].expand(-1, top_k).flatten())
        best = score.topk(min(top_k, score.numel())).indices  # the next depth expands the top_k of these
        frontier = n_cand + best
        parent_local = best // top_k
        parent_rows = m0 + parent_local
        n_cand += score.numel()
    all_tok, all_score, all_parent = torch.cat(toks_l), torch.cat(score_l), torch.cat(parent_l)
    # rerank every candidate by cumulative log-prob; the depth penalty breaks ties (log-prob 0.0) in favour of
    # parents, so a child never outranks its parent and the chosen set is closed under ancestors
    depth_of = torch.cat([torch.full((t.numel(),), float(i), device=dev) for i, t in enumerate(toks_l)])
    keep = (all_score - 1e-4 * depth_of).topk(min(total, n_cand)).indices.sort().values
    where = {c: i for i, c in enumerate(keep.tolist())}
    return all_tok[keep], [where[p] if p >= 0 else -1 for p in all_parent[keep].tolist()]

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
) -> tuple[torch.Tensor, list]:
    """Grow the tree; return (tokens [N] in the drafter's token space, parent index per node, -1 = root).

    root_logp [V]: the drafter's log-probs after the root. expand(tokens [F], attend [F, m0 + F] bool, depth d,
    parent_rows [F] | None) -> log-probs [F, V]: one draft step over the F frontier nodes at depth d+1, where
    attend[i] marks which drafted rows node i sees (the m0 rows drafted before this step, then the F new ones:
    its ancestors and itself) and parent_rows[i] is its parent's row in the previous `expand` call's output
    (None when the parents are the root). `drafted`: rows the drafter had already drafted before depth 1 (all of
    them visible to every node, e.g. the root itself).

    A batch: root_logp [B, V] grows one tree per row, every row's frontier in the same `expand` call, which then
    takes and returns a leading batch dimension (tokens [B, F], attend [B, F, m0 + F], parent_rows [B, F], log-probs
    [B, F, V]); -> (tokens [B, N], one parents list per row). Every row keeps the same number of nodes."""
    if root_logp.dim() == 2:
        return _dynamic_tree(root_logp, expand, top_k, depth, total, drafted)

    def one_row(tok, attend, d, parent_rows):
        return expand(tok[0], attend[0], d, None if parent_rows is None else parent_rows[0])[None]

    tokens, parents = _dynamic_tree(root_logp[None], one_row, top_k, depth, total, drafted)
    return tokens[0], parents[0]


def _dynamic_tree(root_logp, expand, top_k: int, depth: int, total: int, drafted: int):
    """dynamic_tree over a batch [B, V] (every tensor with a leading row dimension)."""
    dev, B = root_logp.device, root_logp.shape[0]
    top = root_logp.topk(top_k, -1)
    toks_l, score_l = [top.indices], [top.values]  # per depth: [B, candidates]
    parent_l = [torch.full((B, top_k), -1, device=dev, dtype=torch.long)]
    frontier = torch.arange(top_k, device=dev).expand(B, top_k)  # candidate ids of the nodes expanded next
    parent_rows = parent_local = None  # the parents' rows among all drafted rows / in the last step's output
    anc = torch.ones(B, drafted, drafted, dtype=torch.bool, device=dev)  # ancestor-or-self among drafted rows
    eye = torch.eye(top_k, dtype=torch.bool, device=dev)
    n_cand = top_k
    for d in range(1, depth):
        m0, f = anc.shape[1], frontier.shape[1]
        if parent_rows is None:
            inherited = anc.new_ones(B, f, m0)
        else:
            inherited = anc.gather(1, parent_rows[:, :, None].expand(-1, -1, m0))
        attend = torch.cat([inherited, eye[:f, :f].expand(B, f, f)], 2)  # [B, F, m0 + F]
        child = expand(torch.cat(toks_l, 1).gather(1, frontier), attend, d, parent_local).topk(top_k, dim=-1)
        anc = torch.cat([torch.cat([anc, anc.new_zeros(B, m0, f)], 2), attend], 1)
        # cumulative log-prob of every child: [B, F * top_k]
        score = (torch.cat(score_l, 1).gather(1, frontier)[:, :, None] + child.values).flatten(1)
        toks_l.append(child.indices.flatten(1))
        score_l.append(score)
        parent_l.append(frontier[:, :, None].expand(-1, -1, top_k).flatten(1))
        best = score.topk(min(top_k, score.shape[1]), -1).indices  # the next depth expands the top_k of these
        frontier = n_cand + best
        parent_local = best // top_k
        parent_rows = m0 + parent_local
        n_cand += score.shape[1]
    all_tok, all_score, all_parent = torch.cat(toks_l, 1), torch.cat(score_l, 1), torch.cat(parent_l, 1)
    # rerank every candidate by cumulative log-prob; the depth penalty breaks ties (log-prob 0.0) in favour of
    # parents, so a child never outranks its parent and the chosen set is closed under ancestors
    depth_of = torch.cat([torch.full((t.shape[1],), float(i), device=dev) for i, t in enumerate(toks_l)])
    keep = (all_score - 1e-4 * depth_of).topk(min(total, n_cand), -1).indices.sort(-1).values  # [B, N]
    parents = []
    for row, par in zip(keep.tolist(), all_parent.gather(1, keep).tolist()):
        where = {c: i for i, c in enumerate(row)}
        parents.append([where[p] if p >= 0 else -1 for p in par])
    return all_tok.gather(1, keep), parents

"""decode/trees.dynamic_tree with a hand-made drafter (no model): the EAGLE-2 selection rule."""

import itertools
import math

import torch

from draftsmith.decode.trees import dynamic_tree


def _logp(weights):
    return torch.log(torch.tensor(weights, dtype=torch.float32))


def test_dynamic_tree_keeps_the_most_probable_paths_closed_under_ancestors():
    # vocabulary of 3; every node's children have probabilities depending on the node's own token only
    child = {0: [0.7, 0.2, 0.1], 1: [0.5, 0.4, 0.1], 2: [0.9, 0.05, 0.05]}
    calls = []

    def expand(tok, attend, d, parent_local):
        calls.append((d, tok.tolist(), attend.clone(), parent_local))
        return torch.stack([_logp(child[int(t)]) for t in tok])

    root = _logp([0.6, 0.3, 0.1])
    toks, parents = dynamic_tree(root, expand, top_k=2, depth=3, total=5)
    # brute force: path probabilities of every path the expansion could reach
    paths = {}
    for i, p in enumerate(parents):
        path, j = [], i
        while j >= 0:
            path.append(int(toks[j]))
            j = parents[j]
        paths[i] = tuple(reversed(path))
        assert p < i  # parents precede children
    prob = {
        i: math.prod([[0.6, 0.3, 0.1][path[0]]] + [child[a][b] for a, b in itertools.pairwise(path)])
        for i, path in paths.items()
    }
    assert len(toks) == 5
    # by hand: depth 1 keeps 0 (.6), 1 (.3); depth 2 expands (0,0) .42 and (1,0) .15 (not (0,1) .12); the best
    # 5 of all candidates: .6, .42, .3, .294 (0,0,0), .15
    assert set(paths.values()) == {(0,), (1,), (0, 0), (0, 0, 0), (1, 0)}
    assert sorted(prob.values(), reverse=True) == sorted([0.6, 0.42, 0.3, 0.294, 0.15], reverse=True)
    # depth 2 expands the top_k=2 root children in one step; they see only themselves (no drafted rows before)
    d, tok, attend, parent_local = calls[0]
    assert (
        d == 1
        and tok == [0, 1]
        and parent_local is None
        and attend.tolist() == [[True, False], [False, True]]
    )
    # depth 3 expands (0,0) and (1,0): their parents are rows 0 and 1 of the previous step's output
    d, tok, attend, parent_local = calls[1]
    assert d == 2 and tok == [0, 0] and parent_local.tolist() == [0, 1]
    assert attend.shape == (2, 4) and attend[:, 2:].equal(torch.eye(2, dtype=torch.bool))


def test_dynamic_tree_rows_drafted_before_are_visible_to_every_node():
    def expand(tok, attend, d, parent_local):
        assert attend[:, 0].all()  # the root row, drafted before depth 1
        return torch.stack([_logp([0.5, 0.5]) for _ in tok])

    toks, parents = dynamic_tree(_logp([0.9, 0.1]), expand, top_k=1, depth=4, total=4, drafted=1)
    assert toks.tolist() == [0, 0, 0, 0] and parents == [-1, 0, 1, 2]  # top_k=1: a chain

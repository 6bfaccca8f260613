"""Batched speculative decoding on tiny random models: prompts of different lengths, ragged acceptance, per-row
rollback, rows that stop at different steps and leave the batch."""

import pytest
import torch

from draftsmith.decode.decoder import SpeculativeDecoder
from draftsmith.decode.proposer import Proposal
from draftsmith.decode.proposers import DraftModelProposer, NGramProposer
from draftsmith.decode.ragged import RaggedCache
from draftsmith.decode.verify import verify_rows
from draftsmith.errors import DraftsmithError
from draftsmith.sampling import SamplingParams
from draftsmith.testing import tree_around

NEW = 24


def _prompts(n_rows: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 13, 8][:n_rows]
    rows = [torch.randint(3, 380, (n,), generator=g) for n in lengths]
    rows[0] = torch.cat([rows[0], rows[0][:3], rows[0]])  # repeats: the n-gram lookup finds matches
    return rows


class BatchTreeOracle:
    """A tree drafter for tests, per row: the true continuation among random distractor siblings at each depth
    (sometimes missing), so rows accept different, non-contiguous paths. `truth[b]` is row b's continuation."""

    name = "tree-oracle"
    hidden_state_layers = ()

    def __init__(self, truth: list[list[int]], seed: int = 0):
        self.truth, self.g = truth, torch.Generator().manual_seed(seed)

    def begin(self, tokens, hidden, pad=None):
        assert tokens.shape[0] == len(self.truth)
        self.rows = list(range(len(self.truth)))
        self.done = [1] * len(self.truth)  # tokens generated per row

    def retain(self, rows):
        self.rows = [self.rows[r] for r in rows]
        self.done = [self.done[r] for r in rows]

    def _row(self, truth: list[int], done: int, k: int) -> Proposal:
        toks, parents = tree_around(lambda d: truth[done + d] if done + d < len(truth) else 3, k, self.g)
        return Proposal(torch.tensor([toks]), parents)

    def propose(self, k, params, generator):
        return Proposal.stack([self._row(self.truth[r], n, k) for r, n in zip(self.rows, self.done)])

    def advance(self, accepted_nodes, new_tokens, hidden):
        self.done = [n + len(a) + 1 for n, a in zip(self.done, accepted_nodes)]


@pytest.fixture(scope="module")
def batch1(tiny_target):
    """Plain greedy batch-1 decoding of the prompts (no EOS): the reference every row must reproduce."""
    dec = SpeculativeDecoder(tiny_target, eos_ids=set())
    return [dec.generate(p[None], None, max_new_tokens=NEW).tokens for p in _prompts(3)]


def _drafters(tiny_target, tiny_draft, batch1, rows):
    """One of each decode/ drafter kind (and a tree), some accepting much, some little, differently per row."""
    vocab = torch.unique(torch.tensor(sorted({t for r in batch1 for t in r})[::2] + [5]))  # half the answers
    return {
        "draft": DraftModelProposer(tiny_draft, 384),
        "draft-reduced-self": DraftModelProposer(tiny_target, 384, vocab),  # ragged acceptance
        "draft-stop": DraftModelProposer(tiny_target, 384, vocab, stop_below=0.3),  # rows stop drafting apart
        "ngram": NGramProposer(3, 1),
        "tree": BatchTreeOracle(batch1[:rows], seed=rows),
    }


@pytest.mark.parametrize("rows", [2, 3])
def test_greedy_rows_equal_batch1_and_plain_batched(tiny_target, tiny_draft, batch1, rows):
    """Every row equals its batch-1 decoding and plain batched decoding, for every drafter kind of decode/, with
    the same acceptance per step as at batch 1 (rows are independent); rows stop at different steps (an early
    EOS in one row, the length limit in the others)."""
    prompts = _prompts(rows)
    eos = batch1[1][6]  # row 1 stops at its first eos, early; the others at the length limit (or their eos)
    dec = SpeculativeDecoder(tiny_target, eos_ids={eos})
    alone = [dec.generate(p[None], None, max_new_tokens=NEW) for p in prompts]
    ref = [r.tokens for r in alone]
    assert len(ref[1]) < NEW and any(len(r) == NEW for r in ref)
    plain = dec.generate_batch(prompts, None, k=4, max_new_tokens=NEW)
    assert [r.tokens for r in plain.rows] == ref
    for name, prop in _drafters(tiny_target, tiny_draft, batch1, rows).items():
        out = dec.generate_batch(prompts, prop, k=4, max_new_tokens=NEW)
        assert [r.tokens for r in out.rows] == ref, name
        assert [r.stop_reason for r in out.rows] == [a.stop_reason for a in alone], name
        if name != "tree":  # a row decoded alone accepts exactly what it accepts in the batch
            spec_alone = [dec.generate(p[None], prop, k=4, max_new_tokens=NEW) for p in prompts]
            assert [r.accepted for r in out.rows] == [a.accepted for a in spec_alone], name
        if name == "draft-reduced-self":
            assert len({tuple(r.accepted[:4]) for r in out.rows}) > 1  # rows accept differently


def test_stop_strings_end_rows_apart(tiny_target, tiny_tokenizer, batch1):
    prompts = _prompts(3)
    stop = tiny_tokenizer.decode(batch1[2][5:7])
    dec = SpeculativeDecoder(tiny_target, tiny_tokenizer, eos_ids=set(), stop_strings=[stop])
    ref = [dec.generate(p[None], None, max_new_tokens=NEW) for p in prompts]
    assert ref[2].stop_reason == "stop_string"
    out = dec.generate_batch(prompts, BatchTreeOracle(batch1, seed=5), k=3, max_new_tokens=NEW)
    assert [r.tokens for r in out.rows] == [r.tokens for r in ref]
    assert [r.stop_reason for r in out.rows] == [r.stop_reason for r in ref]


def test_a_row_that_stops_costs_no_further_target_rows(tiny_target, tiny_draft, batch1):
    """Count the rows every target forward receives: after its EOS a row is out of the batch."""
    prompts = _prompts(3)
    eos = batch1[1][2]
    dec = SpeculativeDecoder(tiny_target, eos_ids={eos})
    seen = []
    hook = tiny_target.get_decoder().register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append((args[0] if args else kwargs["input_ids"]).shape[0]),
        with_kwargs=True,
    )
    try:
        out = dec.generate_batch(prompts, DraftModelProposer(tiny_draft, 384), k=2, max_new_tokens=NEW)
    finally:
        hook.remove()
    assert out.rows[1].stop_reason == "eos" and len(out.rows[1].tokens) <= 3
    steps = [1 + len(r.accepted) for r in out.rows]  # forwards each row took part in, prefill included
    assert seen == out.forward_rows and sum(seen) == sum(steps) == sum(r.target_forwards for r in out.rows)
    assert seen[0] == 3 and max(seen[steps[1] :]) == 2  # row 1 left after its last step


def test_ragged_rollback_equals_recompute(tiny_target):
    """After rows keep different block columns (a chain prefix, a tree path, nothing), each row's next logits equal
    a fresh forward over that row's tokens alone: left padding, per-row lengths, gather and crop are exact."""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 380, (n,), generator=g) for n in (4, 9, 6)]
    T = 9
    ids = torch.stack([torch.cat([torch.zeros(T - len(p), dtype=torch.long), p]) for p in prompts])
    rc = RaggedCache(DynamicCache(config=tiny_target.config), [T - len(p) for p in prompts])
    block = torch.randint(3, 380, (3, 4), generator=g)
    parents = [[-1, 0, 1], [-1, -1, 1], [-1, 0, 0]]  # row 0 a chain, rows 1 and 2 trees
    kept = [[0, 1, 2], [0, 2, 3], [0]]
    with torch.inference_mode():
        tiny_target(ids, cache=rc.cache, **rc.prefill_inputs(T, torch.float32, "cpu"))
        rc.prefilled(T)
        from draftsmith.decode.ragged import block_visibility

        vis = block_visibility(parents, 4, "cpu")
        depths = torch.tensor([[0, 1, 2, 3], [0, 1, 1, 2], [0, 1, 2, 2]])
        tiny_target(block, cache=rc.cache, **rc.block_inputs(4, torch.float32, "cpu", vis, depths))
        rc.commit(kept, 4)
        assert rc.lengths == [12, 12, 10] and rc.cols == 12
        nxt = torch.randint(3, 380, (3, 1), generator=g)
        got = tiny_target(nxt, cache=rc.cache, **rc.block_inputs(1, torch.float32, "cpu")).logits[:, -1]
        for b, p in enumerate(prompts):
            seq = torch.cat([p, block[b, kept[b]], nxt[b]])[None]
            assert torch.allclose(got[b], tiny_target(seq).logits[0, -1], atol=1e-4), b
        rc.commit([[0]] * 3, 1)
        rc.retain([0, 2])  # row 1 leaves; padding neither remaining row needs is dropped
        assert rc.pads == [2, 0] and rc.lengths == [10, 8] and rc.cache.layers[0].keys.shape[:3:2] == (2, 10)
        last = torch.randint(3, 380, (2, 1), generator=g)
        got = tiny_target(last, cache=rc.cache, **rc.block_inputs(1, torch.float32, "cpu")).logits[:, -1]
        for row, b in enumerate([0, 2]):
            seq = torch.cat([prompts[b], block[b, kept[b]], nxt[b], last[row]])[None]
            assert torch.allclose(got[row], tiny_target(seq).logits[0, -1], atol=1e-4), b


def test_proposal_rows_and_verify_rows():
    a = Proposal(torch.tensor([[7, 8]]), [-1, 0])
    b = Proposal(torch.tensor([[4, 5, 6]]), [-1, -1, 0])
    s = Proposal.stack([a, b, Proposal.empty(1, "cpu")])
    assert s.tokens.tolist() == [[7, 8, 0], [4, 5, 6], [0, 0, 0]] and s.sizes == [2, 3, 0]
    assert s.row_parents(1) == [-1, -1, 0] and not s.is_chain and s.row(0).tokens.tolist() == [[7, 8]]
    chain = Proposal.chain(torch.tensor([[1, 2, 3], [4, 5, 6]]), sizes=[3, 1])
    logits = torch.full((2, 4, 10), -5.0)
    for b, best in enumerate([[1, 2, 9, 9], [4, 5, 6, 7]]):  # row 0 accepts 2, row 1 only 1 of its 1
        logits[b, torch.arange(4), best] = 5.0
    paths, nxt = verify_rows(logits, chain, SamplingParams())
    assert paths == [[0, 1], [0]] and nxt.tolist() == [9, 5]


def test_batch_refusals(tiny_target, tiny_draft):
    dec = SpeculativeDecoder(tiny_target, eos_ids=set())

    class OnTargetCache:  # drafts on the target's cache (attach) but keeps no per-row state (no retain)
        name, hidden_state_layers = "one-row", ()

        def attach(self, decoder, ragged):
            pass

    with pytest.raises(DraftsmithError, match="cannot decode a batch"):
        dec.generate_batch(_prompts(2), OnTargetCache(), max_new_tokens=4)
    with pytest.raises(DraftsmithError, match="one prompt at a time"):
        SpeculativeDecoder(tiny_target, eos_ids=set(), static_cache=True).generate_batch(_prompts(2), None)
    with pytest.raises(DraftsmithError, match="generate_batch"):
        dec.generate(torch.ones(2, 4, dtype=torch.long))


def test_sampling_batch_runs_seeded(tiny_target, tiny_draft):
    dec = SpeculativeDecoder(tiny_target, eos_ids=set())
    params = SamplingParams(temperature=0.8, top_p=0.9)
    a = dec.generate_batch(
        _prompts(3), DraftModelProposer(tiny_draft, 384), k=3, params=params, max_new_tokens=9
    )
    b = dec.generate_batch(
        _prompts(3), DraftModelProposer(tiny_draft, 384), k=3, params=params, max_new_tokens=9
    )
    assert [r.tokens for r in a.rows] == [r.tokens for r in b.rows] and all(
        len(r.tokens) == 9 for r in a.rows
    )


def test_batched_dynamic_tree_equals_one_tree_per_row():
    """decode.trees.dynamic_tree over a batch grows each row's tree exactly as alone (a hand-made drafter whose
    next log-probs depend on the token, the depth and the number of visible rows)."""
    from draftsmith.decode.trees import dynamic_tree

    g = torch.Generator().manual_seed(0)
    table = torch.randn(12, 12, generator=g)

    def logp(tok, attend, d):
        return torch.log_softmax(table[tok] + 0.1 * d + 0.01 * attend.sum(-1, keepdim=True), -1)

    roots = torch.log_softmax(torch.randn(3, 12, generator=g), -1)
    batched = dynamic_tree(roots, lambda t, a, d, p: logp(t, a, d), top_k=3, depth=4, total=9, drafted=1)
    for b in range(3):
        alone = dynamic_tree(roots[b], lambda t, a, d, p: logp(t, a, d), top_k=3, depth=4, total=9, drafted=1)
        assert batched[0][b].tolist() == alone[0].tolist() and batched[1][b] == alone[1]
    assert len({tuple(p) for p in batched[1]}) > 1  # the rows' trees differ

"""The decoding loop on tiny random models: losslessness, cache rollback, tree attention, hidden-state hooks."""

import pytest
import torch
from transformers import DynamicCache

from draftsmith.decode.cache import compact_cache, crop_to
from draftsmith.decode.decoder import SpeculativeDecoder
from draftsmith.decode.proposer import Proposal, node_depths, tree_attention_mask
from draftsmith.decode.proposers import DraftModelProposer, NGramProposer
from draftsmith.errors import DraftsmithError
from draftsmith.sampling import SamplingParams
from draftsmith.testing import ARCHS, aten_calls, sampled_joint_tvd, tiny_model, tree_around

PROMPT = torch.tensor([[1, 40, 50, 60, 70, 80, 40, 50, 60, 90, 40, 50]])
NEW = 40


@pytest.fixture(scope="module")
def reference(tiny_target):
    """Plain greedy continuation from HF generate (no EOS stop, so the full length is compared)."""
    out = tiny_target.generate(PROMPT, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=2)
    return out[0, PROMPT.shape[1] :].tolist()


class TreeOracle:
    """A tree drafter for tests: at each depth puts the true continuation among random distractor siblings
    (sometimes omitting it), so accepted paths are non-contiguous and the KV cache must be compacted.
    Records the hidden rows it receives to check the hidden-state hook."""

    name = "tree-oracle"

    def __init__(self, truth, layers=(), seed=0):
        self.truth, self.hidden_state_layers = truth, tuple(layers)
        self.g = torch.Generator().manual_seed(seed)

    def begin(self, tokens, hidden):
        self.pos = tokens.shape[1]  # committed length
        self.prompt_len = tokens.shape[1] - 1
        self.rows = [hidden] if hidden is not None else []

    def propose(self, k, params, generator):
        done = self.pos - self.prompt_len  # tokens generated so far
        toks, parents = tree_around(
            lambda d: self.truth[done + d] if done + d < len(self.truth) else 3, k, self.g
        )
        return Proposal(torch.tensor([toks]), parents)

    def advance(self, accepted_nodes, new_tokens, hidden):
        self.pos += new_tokens.shape[1]
        if hidden is not None:
            self.rows.append(hidden)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_lossless_every_proposer(tiny_target, tiny_draft, reference, k):
    dec = SpeculativeDecoder(tiny_target, eos_ids=set())
    plain = dec.generate(PROMPT, None, k=k, max_new_tokens=NEW)
    assert plain.tokens == reference and plain.target_forwards == NEW
    proposers = [DraftModelProposer(tiny_draft, 384), NGramProposer(), TreeOracle(reference, seed=k)]
    for prop in proposers:
        res = dec.generate(PROMPT, prop, k=k, max_new_tokens=NEW)
        assert res.tokens == reference, prop.name
        assert res.target_forwards == 1 + len(res.accepted)
    # a confidence-stopped draft proposes fewer tokens on some steps (none on others) and stays lossless
    stopped = dec.generate(
        PROMPT, DraftModelProposer(tiny_draft, 384, stop_below=0.05), k=k, max_new_tokens=NEW
    )
    assert stopped.tokens == reference
    assert min(stopped.proposed) < k or k == 1 and min(stopped.proposed) == 0
    # the target as its own draft accepts everything: tau = k + 1 (bonus included)
    self_draft = dec.generate(PROMPT, DraftModelProposer(tiny_target, 384), k=k, max_new_tokens=NEW)
    assert self_draft.tokens == reference and all(
        a == min(k, p) for a, p in zip(self_draft.accepted, self_draft.proposed)
    )


def test_reduced_vocab_draft_is_lossless_and_stays_in_vocab(tiny_target, reference):
    vocab_ids = torch.tensor(sorted(set(reference)) + [5, 7])
    vocab_ids = torch.unique(vocab_ids)
    prop = DraftModelProposer(tiny_target, 384, vocab_ids)
    dec = SpeculativeDecoder(tiny_target, eos_ids=set())
    res = dec.generate(PROMPT, prop, k=3, max_new_tokens=NEW)
    assert res.tokens == reference
    assert res.tau > 2.0  # the target restricted to a vocabulary holding its own outputs still agrees
    prop.begin(PROMPT, None)
    out = prop.propose(4, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    assert set(out.tokens[0].tolist()) <= set(vocab_ids.tolist())
    q = out.draft_probs[0]
    assert q.shape == (4, 384) and torch.allclose(q.sum(-1), torch.ones(4))
    outside = torch.ones(384, dtype=torch.bool)
    outside[vocab_ids] = False
    assert q[:, outside].abs().sum() == 0


def test_eos_and_stop_strings(tiny_target, tiny_draft, reference, tiny_tokenizer):
    eos = reference[7]
    dec = SpeculativeDecoder(tiny_target, eos_ids={eos})
    first = reference.index(eos)
    for prop in (None, DraftModelProposer(tiny_draft, 384), TreeOracle(reference)):
        res = dec.generate(PROMPT, prop, k=4, max_new_tokens=NEW)
        assert res.tokens == reference[: first + 1] and res.stop_reason == "eos"
    stop = tiny_tokenizer.decode(reference[10:12])
    dec = SpeculativeDecoder(tiny_target, tiny_tokenizer, eos_ids=set(), stop_strings=[stop])
    res = dec.generate(PROMPT, TreeOracle(reference), k=4, max_new_tokens=NEW)
    assert res.stop_reason == "stop_string" and stop in tiny_tokenizer.decode(res.tokens)
    assert stop not in tiny_tokenizer.decode(res.tokens[:-1])


def test_context_limit_and_k_errors(tiny_target):
    dec = SpeculativeDecoder(tiny_target, eos_ids=set())
    with pytest.raises(DraftsmithError, match="context"):
        dec.generate(torch.ones(1, 500, dtype=torch.long), None, k=4, max_new_tokens=10)
    with pytest.raises(DraftsmithError, match="k must be"):
        dec.generate(PROMPT, None, k=0)


def test_cache_rollback_equals_recompute(tiny_target):
    """crop (chain) and gather+crop (tree path) give the same next-step logits as a fresh forward."""
    torch.manual_seed(0)
    seq = torch.randint(3, 380, (1, 20))
    with torch.inference_mode():
        cache = DynamicCache(config=tiny_target.config)
        tiny_target(seq[:, :12], cache=cache)
        tiny_target(seq[:, 12:17], cache=cache)  # a verify block of 5, keep 2 of it
        crop_to(cache, 14)
        got = tiny_target(seq[:, 17:18], cache=cache).logits[0, -1]
        ref = tiny_target(torch.cat([seq[:, :14], seq[:, 17:18]], 1)).logits[0, -1]
        assert torch.allclose(got, ref, atol=1e-5)

        # tree block [root, n0, n1, n2, n3] with parents [-1, -1, 1, 1]: keep path n1 -> n3
        parents = [-1, -1, 1, 1]
        cache = DynamicCache(config=tiny_target.config)
        tiny_target(seq[:, :12], cache=cache)
        block = seq[:, 12:17]
        pos = (12 + torch.tensor([0, *node_depths(parents)]))[None]
        mask = tree_attention_mask(parents, 12, torch.float32, "cpu")
        tiny_target(block, cache=cache, position_ids=pos, attention_mask=mask)
        compact_cache(cache, 13, torch.tensor([1, 3]))
        assert cache.get_seq_length() == 15
        nxt = seq[:, 19:20]
        got = tiny_target(nxt, cache=cache).logits[0, -1]
        path_seq = torch.cat([seq[:, :13], block[:, [2, 4]], nxt], 1)
        ref = tiny_target(path_seq).logits[0, -1]
        assert torch.allclose(got, ref, atol=1e-5)


def test_tree_mask_logits_equal_per_path_recompute(tiny_target):
    torch.manual_seed(1)
    prefix = torch.randint(3, 380, (1, 9))
    parents = [-1, -1, 0, 0, 1, 3, 3]
    nodes = torch.randint(3, 380, (1, len(parents)))
    root = torch.tensor([[17]])
    with torch.inference_mode():
        cache = DynamicCache(config=tiny_target.config)
        tiny_target(prefix, cache=cache)
        pos = (9 + torch.tensor([0, *node_depths(parents)]))[None]
        mask = tree_attention_mask(parents, 9, torch.float32, "cpu")
        tree_logits = tiny_target(
            torch.cat([root, nodes], 1), cache=cache, position_ids=pos, attention_mask=mask
        ).logits
        for i in range(len(parents)):
            path, j = [], i
            while j >= 0:
                path.append(j)
                j = parents[j]
            seq = torch.cat([prefix, root, nodes[:, path[::-1]]], 1)
            ref = tiny_target(seq).logits[0, -1]
            assert torch.allclose(tree_logits[0, 1 + i], ref, atol=1e-5), i
        assert torch.allclose(
            tree_logits[0, 0], tiny_target(torch.cat([prefix, root], 1)).logits[0, -1], atol=1e-5
        )


def test_hidden_state_rows_match_full_forward(tiny_target, reference):
    """A proposer asking for hidden states gets, for each committed token, the state that predicted it."""
    layers = (0, 1, 2)  # 2-layer model: 0 = embeddings, 1 = entering layer 1, 2 = final (normed) state
    prop = TreeOracle(reference, layers=layers, seed=3)
    res = SpeculativeDecoder(tiny_target, eos_ids=set()).generate(PROMPT, prop, k=4, max_new_tokens=NEW)
    assert res.tokens == reference and max(res.accepted) >= 2
    got = [torch.cat([r[li] for r in prop.rows], 1) for li in range(len(layers))]  # [1, n, H] per layer
    n = got[0].shape[1]
    full = torch.cat([PROMPT, torch.tensor([res.tokens])], 1)
    with torch.inference_mode():
        hs = tiny_target(full, output_hidden_states=True).hidden_states
    for li, layer in enumerate(layers):
        assert torch.allclose(got[li], hs[layer][:, :n], atol=1e-4), layer


def test_sampling_runs_and_respects_budget(tiny_target, tiny_draft):
    dec = SpeculativeDecoder(tiny_target, eos_ids=set())
    params = SamplingParams(temperature=0.8, top_p=0.9)
    a = dec.generate(
        PROMPT, DraftModelProposer(tiny_draft, 384), k=3, params=params, max_new_tokens=17, seed=5
    )
    b = dec.generate(
        PROMPT, DraftModelProposer(tiny_draft, 384), k=3, params=params, max_new_tokens=17, seed=5
    )
    assert len(a.tokens) == 17 and a.tokens == b.tokens  # seeded: reproducible
    c = dec.generate(
        PROMPT, TreeOracle(list(range(5, 60)), seed=1), k=3, params=params, max_new_tokens=17, seed=5
    )
    assert len(c.tokens) == 17


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_sampled_decoding_matches_target_distribution(arch):
    """End to end at temperature 1 on a 4-token vocabulary: the joint law of tokens 1-3 (drafted by a
    disagreeing draft, k=2) equals the target's exact joint law, on both tiny architectures, alone and in a batch
    of two."""
    target = tiny_model(arch, 0, vocab_size=4)
    draft = tiny_model(arch, 3, vocab_size=4, num_hidden_layers=1)
    dec = SpeculativeDecoder(target, eos_ids=set())
    tvd = sampled_joint_tvd(dec, DraftModelProposer(draft, 4), torch.tensor([[1, 3, 0, 2]]), n=3000)
    assert tvd < 0.06, tvd
    # batch 2: the row beside a longer prompt (left padding, its own acceptance and rollback) keeps the law
    other = (torch.tensor([[2, 0, 1, 3, 3, 1, 0]]),)
    tvd = sampled_joint_tvd(dec, DraftModelProposer(draft, 4), torch.tensor([[1, 3, 0, 2]]), batch_with=other)
    assert tvd < 0.06, ("B=2", tvd)


def test_static_cache_path_is_lossless(tiny_target, tiny_draft, reference):
    """The --compile path's StaticCache (without torch.compile here): rollback by moving its length."""
    dec = SpeculativeDecoder(tiny_target, eos_ids=set(), static_cache=True)
    assert dec.generate(PROMPT, None, max_new_tokens=NEW).tokens == reference
    for prop in (DraftModelProposer(tiny_draft, 384), TreeOracle(reference, seed=7)):
        assert dec.generate(PROMPT, prop, k=4, max_new_tokens=NEW).tokens == reference, prop.name


def test_ngram_lookup_picks_most_recent_longest_match():
    prop = NGramProposer(max_n=3, min_n=1)
    #                    0  1  2  3  4  5  6  7  8  9 10 11
    prop.begin(torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 4, 3, 6, 7]]), None)
    # last 3 tokens [3, 6, 7] never occurred; last 2 [6, 7] occurred at 1 and 6 -> most recent (6) -> propose 4, 3, 6
    assert prop.propose(3).tokens.tolist() == [[4, 3, 6]]
    assert prop.propose(10).tokens.tolist() == [[4, 3, 6, 7]]  # clipped at the end of the context
    prop.advance([[]], torch.tensor([[42]]), None)
    assert prop.propose(3).num_nodes == 0  # 42 never seen: empty proposal (a plain step)
    # one accepted node plus the bonus token: both are committed
    prop.advance([[0]], torch.tensor([[9, 5]]), None)
    assert prop.propose(2).tokens.tolist() == [[6, 7]]  # [9, 5] matched at 4..5


def test_no_head_product_runs_as_a_batched_gemm(tiny_target):
    """Feeding several tokens (a batch's prompts; two tokens after a full accept) must apply the lm_head to [B, H]
    rows, not to a strided [B, 1, H] slice: torch runs that as aten.bmm against the expanded head, which a CPU copies
    whole per call (0.45 s for a 0.5B draft's 150k-row head in bf16). The target drafting for itself accepts
    every token, so the draft feeds two tokens at each step."""
    vocab = tiny_target.config.vocab_size
    dec = SpeculativeDecoder(tiny_target, None)
    prompts = [PROMPT[0], PROMPT[0, :7], PROMPT[0, 2:]]
    calls = aten_calls(
        lambda: dec.generate_batch(prompts, DraftModelProposer(tiny_target, vocab), k=3, max_new_tokens=12)
    )
    products = {"linear", "matmul", "mm", "addmm", "bmm"}
    heads = [c for c in calls if c[1] and c[1][-1] == vocab and c[0].split(".")[1] in products]
    # a 2-D product takes strided rows as they are; a strided 3-D input is what cannot fold
    assert heads and not [c for c in heads if (c[2] and len(c[1]) >= 3) or "bmm" in c[0]], heads

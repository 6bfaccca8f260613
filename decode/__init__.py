"""The speculative decoder: proposers, verification, tree attention, KV-cache rollback, metrics, `draftsmith eval`.

    from draftsmith.decode import SpeculativeDecoder, DraftModelProposer, NGramProposer, evaluate
    dec = SpeculativeDecoder(target, tokenizer)
    res = dec.generate(prompt_ids, DraftModelProposer(draft, target.config.vocab_size), k=4)   # res.tokens, res.tau
    evaluate("smollm2-135m", "ngram:", "builtin:dev-eval", limit=10, out_dir="runs/eval")

New drafters implement `Proposer` (decode/proposer.py) and register a builder in `DRAFTERS` (decode/drafters.py).
"""

from .decoder import GenerationResult, SpeculativeDecoder
from .drafters import DRAFTERS, DrafterContext, build_proposer
from .proposer import Proposal, Proposer, node_depths, tree_attention_mask
from .proposers import DraftModelProposer, NGramProposer
from .verify import verify, verify_greedy, verify_sampling


def evaluate(*args, **kwargs):
    """See draftsmith.decode.evaluate.evaluate (imported lazily: it pulls in prompts/matplotlib)."""
    from .evaluate import evaluate as _evaluate

    return _evaluate(*args, **kwargs)


__all__ = [
    "DRAFTERS",
    "DraftModelProposer",
    "DrafterContext",
    "GenerationResult",
    "NGramProposer",
    "Proposal",
    "Proposer",
    "SpeculativeDecoder",
    "build_proposer",
    "evaluate",
    "node_depths",
    "tree_attention_mask",
    "verify",
    "verify_greedy",
    "verify_sampling",
]

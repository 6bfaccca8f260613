"""The speculative decoder: proposers, verification, tree attention, KV-cache rollback, metrics, `draftsmith eval`.

    from draftsmith.decode import SpeculativeDecoder, DraftModelProposer, NGramProposer
    dec = SpeculativeDecoder(target, tokenizer)
    res = dec.generate(prompt_ids, DraftModelProposer(draft, target.config.vocab_size), k=4)   # res.tokens, res.tau

New drafters implement `Proposer` (decode/proposer.py) and a builder `build_x(path, options, ctx: DrafterContext)`,
named by their kind's record (draftsmith.kinds; the tables: draftsmith.heads.kinds, draftsmith.app.drafters).
`draftsmith eval` is draftsmith.app.evaluate.evaluate.
"""

from .decoder import GenerationResult, SpeculativeDecoder
from .drafters import DrafterContext
from .proposer import Proposal, Proposer, node_depths, tree_attention_mask
from .proposers import DraftModelProposer, NGramProposer
from .verify import verify, verify_greedy, verify_sampling

__all__ = [
    "DraftModelProposer",
    "DrafterContext",
    "GenerationResult",
    "NGramProposer",
    "Proposal",
    "Proposer",
    "SpeculativeDecoder",
    "node_depths",
    "tree_attention_mask",
    "verify",
    "verify_greedy",
    "verify_sampling",
]

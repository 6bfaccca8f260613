"""Self-speculation: the target drafts with its own layers on its own KV cache. The drafting machinery (drafting:
layer runner, proposer, reuse of the shared layers' work in the verify), trained early exit (earlyexit: adapter,
loss), the drafter folders and their builders (folders), the measured layer-skip search behind `draftsmith
layerskip` (search) and the kind records (kind)."""

"""Lossless in llama.cpp, told apart from the engine's own numerics (`draftsmith bench engine`'s check).

llama-server verifies a draft of n tokens as one batch of the target, [last token, d1 .. dn], keeps the rows of the
accepted drafts in its KV cache and drops the others (tools/server/server-context.cpp: common_sampler_sample_and_
accept_n, then seq_rm), while plain decoding runs every token as a batch of one. On a CPU the two shapes take
different kernels (ggml's repacked Q4_K: rows in groups of four through a gemm, the rest and single tokens through a
gemv; flash attention tiles 64 query rows or more), so greedy decoding with a drafter can part from plain greedy
decoding where the two paths round a near-tie differently, with nothing lost. A drafter path that loses something
(a wrong token accepted, a rejected draft left in the cache) parts the same way, so at the first position where the
speculative tokens leave the plain ones, the shared prefix is scored twice on a plain server (no drafter):

- **one-token path**: the prompt decoded plainly again up to that position (its tokens must come back), its
  log-probs there: the plain run's own numbers;
- **the verify's path**: the speculative run replayed with its own batch shapes. A speculative server logging at
  debug level (`-lv 5`) decodes the prompt again (its tokens must come back), and its log gives every target batch
  of that request (position, rows, rows kept). The plain server, through its prompt cache, evaluates the prompt as
  one prefill, then each batch before the parted one with its kept rows and, in place of the rejected drafts,
  filler tokens (causal attention: a later row cannot change a kept one; a filler unlike the next true token ends
  the cache's common prefix there), then the rows of the parted batch's size that end at the parted position, as
  one batch (only the last row's log-probs come back). Every request's evaluated row count is checked
  (timings.prompt_n).

The divergence is the engine's numerics only when the plain token is the one-token path's argmax and the
speculative token the verify path's argmax, with both tokens among the top TOP log-probs of both paths; anything
else fails, and so does a replay that cannot be exact (its last batch reaching into the prompt, or holding rows that
the speculative run computed in batches of another size), a schedule that does not add up, or a run whose tokens
do not come back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from draftsmith import llamacpp
from draftsmith.errors import DraftsmithError
from draftsmith.serving import ServerClient

TOP = 10  # log-probs asked for at the parted position
ENGINE_NUMERICS = "engine numerics"
DIFFERS = "differs"


@dataclass(frozen=True)
class Step:
    """One target batch of a speculative request, as llama-server logged it."""

    pos: int
    """Position of its first row (the last committed token)."""
    rows: int
    """1 + the drafted tokens (1: a plain step)."""
    kept: int | None
    """Rows left in the KV cache: 1 + the accepted drafts (None: the request ended in this step)."""


_TASK = re.compile(r"task (\d+) \| processing task")
_STEP = re.compile(
    r"task (?P<task>\d+) \| (?:generate_draft: id=\d+, #tokens=\d+, #draft=(?P<draft>\d+), pos_next=(?P<pos>\d+)"
    r"|accepted (?P<acc>\d+)/\d+ draft tokens, new n_tokens = \d+"
    r"|slot decode token, id=\d+, n_ctx = \d+, n_tokens = (?P<one>\d+))"
)


def verify_schedule(log: str) -> list[Step]:
    """The target batches of the last request in a speculative llama-server's debug log, in order."""
    tasks = _TASK.findall(log)
    if not tasks:
        return []
    task = tasks[-1]
    steps: list[dict] = []
    for m in _STEP.finditer(log):
        if m["task"] != task:
            continue
        if m["draft"] is not None:
            steps.append({"pos": int(m["pos"]), "rows": int(m["draft"]) + 1, "kept": None})
        elif m["acc"] is not None:
            if steps and steps[-1]["kept"] is None:
                steps[-1]["kept"] = int(m["acc"]) + 1
        else:
            steps.append({"pos": int(m["one"]), "rows": 1, "kept": 1})
    return [Step(**s) for s in steps]


def schedule_problem(steps: list[Step], n_prompt: int, n_tokens: int) -> str | None:
    """Why a schedule does not describe a request of `n_tokens` new tokens after `n_prompt` (None: it does)."""
    if not steps:
        return "the speculative server logged no target batch"
    if steps[0].pos != n_prompt:
        return f"the first batch starts at position {steps[0].pos}, not after the {n_prompt}-token prompt"
    for a, b in zip(steps, steps[1:]):
        if a.kept is None or b.pos != a.pos + a.kept:
            return f"the batch at position {a.pos} keeps {a.kept} rows but the next starts at {b.pos}"
    if steps[-1].pos - n_prompt >= n_tokens:
        return "the batches run past the request's tokens"
    return None


def _filler(ids: list[int], avoid: int | None) -> int:
    """A token unlike `avoid` (the next true token), so the prompt cache's common prefix ends before it."""
    return next(t for t in ids[:2] + [0, 1] if t != avoid)


class PlainScorer:
    """Log-probs of the target at a position, through the one-token path or a replay of a verify schedule, on a
    plain llama-server (no drafter) through its prompt cache. Each score is the raw log-probs of the last row of one
    request whose evaluated rows are counted; the request is made to sample a plain ASCII token (a logit bias, which
    the raw log-probs do not see): llama-server withholds the log-probs of a token that ends inside a UTF-8
    character."""

    def __init__(self, url: str):
        self.url = url
        pieces = ServerClient(url).request(
            "/tokenize", {"content": " a", "add_special": False, "with_pieces": True}
        )
        ascii_ids = [int(t["id"]) for t in pieces.get("tokens") or [] if isinstance(t.get("piece"), str)]
        if not ascii_ids:
            raise DraftsmithError(
                f"llama-server {url} tokenizes ' a' to no text token; cannot score positions"
            )
        self.forced = ascii_ids[-1]

    def _eval(self, ids: list[int], n_predict: int, cache: bool, rows: int) -> dict:
        r = llamacpp.complete_ids(self.url, ids, n_predict, extra={"cache_prompt": cache})
        self._rows(r, rows)
        return r

    def _score(self, ids: list[int], rows: int) -> dict[int, float]:
        """Top log-probs of the raw logits of the last row of `ids`, the cache holding all but `rows` of them."""
        extra = {"cache_prompt": True, "n_probs": TOP, "logit_bias": [[self.forced, 1000.0]]}
        r = llamacpp.complete_ids(self.url, ids, 1, extra=extra)
        self._rows(r, rows)
        probs = r.get("completion_probabilities") or [{}]
        return {int(e["id"]): float(e["logprob"]) for e in probs[0].get("top_logprobs") or []}

    @staticmethod
    def _rows(r: dict, rows: int) -> None:
        got = int((r.get("timings") or {}).get("prompt_n", -1))
        if got != rows:
            raise _ReplayError(f"the plain server evaluated {got} rows where the replay needs {rows}")

    def one_token(self, ids: list[int], plain: list[int], at: int) -> dict[int, float]:
        """Plain decoding of `at` tokens again (they must come back), then the row of token at - 1 alone: the
        plain run's own computation of the log-probs of token `at`."""
        r = self._eval(ids, at, cache=False, rows=len(ids))
        if list(r.get("tokens") or []) != plain[:at]:
            raise _ReplayError("plain decoding did not give its tokens back")
        return self._score(ids + plain[:at], rows=1)

    def verify_path(self, ids: list[int], spec: list[int], at: int, steps: list[Step]) -> tuple[dict, dict]:
        """Log-probs at `at` with the speculative run's batch shapes, and how the replay's last batch was made."""
        n = len(ids)
        row = at - 1  # the row whose logits give token `at`: input spec[at - 1]
        final = next((s for s in steps if s.pos - n <= row < s.pos - n + s.rows), None)
        if final is None:
            raise _ReplayError(f"no logged batch holds position {n + row}")
        self._eval(ids, 1, cache=False, rows=n)  # the prompt as one prefill, as the speculative run's
        for s in steps:
            if s is final:
                break
            first = s.pos - n
            keep = spec[first : first + s.kept]
            filler = [_filler(ids, spec[first + s.kept])] * (s.rows - s.kept)
            self._eval(ids + spec[:first] + keep + filler, 1, cache=True, rows=s.rows)
        start = row - final.rows + 1  # the last batch: final.rows rows ending at `row`
        window = {"rows": final.rows, "first": start, "offset_in_step": row - (final.pos - n)}
        inexact = None
        if start < 0:
            inexact = "the replayed batch reaches into the prompt"
        else:
            for s in steps[: steps.index(final)]:  # earlier batches whose kept rows the last batch recomputes
                if s.pos - n + s.kept > start and s.rows != final.rows:
                    inexact = f"the replayed batch holds rows of a {s.rows}-row batch"
        window["inexact"] = inexact
        head = ids + spec[:start] if start >= 0 else ids[:start]
        self._eval(head + [_filler(ids, (ids + spec)[n + start])], 1, cache=True, rows=1)
        return self._score(ids + spec[:at], rows=final.rows), window


class _ReplayError(Exception):
    pass


def verdict(plain_token: int, spec_token: int, one: dict[int, float], verify: dict[int, float]) -> dict:
    """Engine numerics only when the plain token leads the one-token path and the speculative token the verify
    path, both tokens in both top lists; the gaps (nats, the leader's lead) are reported either way."""
    both = all(t in lp for t in (plain_token, spec_token) for lp in (one, verify))
    gap_one = one[plain_token] - one[spec_token] if plain_token in one and spec_token in one else None
    gap_verify = (
        verify[spec_token] - verify[plain_token] if plain_token in verify and spec_token in verify else None
    )
    one_top = bool(one) and max(one, key=one.get) == plain_token
    verify_top = bool(verify) and max(verify, key=verify.get) == spec_token
    ok = both and one_top and verify_top
    why = None
    if not ok:
        why = (
            "the plain token does not lead the one-token path"
            if not one_top
            else "the speculative token does not lead the verify path"
            if not verify_top
            else f"a token is outside the top {TOP} of a path"
        )
    return {
        "one_token_gap": gap_one,
        "verify_gap": gap_verify,
        "verdict": ENGINE_NUMERICS if ok else DIFFERS,
        "why": why,
    }


def first_difference(plain: list[int], spec: list[int]) -> int | None:
    at = next((j for j, (a, b) in enumerate(zip(plain, spec)) if a != b), None)
    if at is None and len(plain) != len(spec):
        return min(len(plain), len(spec))
    return at


def divergence(
    scorer: PlainScorer,
    spec_server: llamacpp.LlamaServer,
    ids: list[int],
    plain: list[int],
    spec: list[int],
    max_new_tokens: int,
) -> dict:
    """The record of one prompt whose speculative tokens part from the plain ones (module docstring); the
    speculative request is made again with the timed run's `max_new_tokens` (the drafts near the end depend on
    it)."""
    at = first_difference(plain, spec)
    rec: dict = {"at": at, "plain_token": None, "spec_token": None}

    def fail(why: str) -> dict:
        return {**rec, "one_token_gap": None, "verify_gap": None, "verdict": DIFFERS, "why": why}

    if at >= min(len(plain), len(spec)):
        return fail("one output is a prefix of the other (lengths differ)")
    rec.update(plain_token=plain[at], spec_token=spec[at])
    if at == 0:
        return fail("the first token comes from the prompt's prefill in both runs")
    start = spec_server.log_size()
    r = llamacpp.complete_ids(spec_server.url, ids, max_new_tokens)
    if list(r.get("tokens") or []) != spec:
        return fail("the speculative server did not give its tokens back")
    steps = verify_schedule(spec_server.log_since(start, until=r"stop processing"))
    problem = schedule_problem(steps, len(ids), len(spec))
    if problem:
        return fail(f"unreadable schedule: {problem}")
    try:
        one = scorer.one_token(ids, plain, at)
        verify, window = scorer.verify_path(ids, spec, at, steps)
    except _ReplayError as e:
        return fail(str(e))
    rec.update(window=window, **verdict(plain[at], spec[at], one, verify))
    if rec["verdict"] == ENGINE_NUMERICS and window["inexact"]:
        rec.update(verdict=DIFFERS, why=f"inexact replay: {window['inexact']}")
    return rec


def check_lossless(
    plain_gguf: Path,
    spec: dict[str, tuple[Path, list[str]]],
    encoded: list[list[int]],
    rows: dict[str, list[dict]],
    *,
    max_new_tokens: int,
    context: int,
    threads: int | None,
) -> dict[str, dict[int, dict]]:
    """{drafter: {prompt index: divergence record}} for every prompt whose speculative tokens (rows[name]) part
    from the plain ones (rows["plain"]). `spec[name]`: the GGUF and flags of that drafter's server (its target is
    normally plain_gguf; another model makes a lossy comparison). One plain server and, per drafter that parted,
    one speculative server at debug log level, started after the timed runs."""
    parted = {
        name: [i for i, r in enumerate(rows[name]) if r["tokens"] != rows["plain"][i]["tokens"]]
        for name in spec
    }
    out: dict[str, dict[int, dict]] = {name: {} for name in spec}
    if not any(parted.values()):
        return out
    with llamacpp.LlamaServer(plain_gguf, alias="plain-check", context=context, threads=threads) as plain:
        scorer = PlainScorer(plain.url)
        for name, prompts in parted.items():
            if not prompts:
                continue
            gguf, flags = spec[name]
            with llamacpp.LlamaServer(
                gguf, alias="spec-check", context=context, threads=threads, extra=[*flags, "-lv", "5"]
            ) as server:
                for i in prompts:
                    out[name][i] = divergence(
                        scorer, server, encoded[i], rows["plain"][i]["tokens"], rows[name][i]["tokens"],
                        max_new_tokens,
                    )  # fmt: skip
    return out

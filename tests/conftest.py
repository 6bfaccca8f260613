import os

import pytest
import torch

torch.set_num_threads(2)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# exact fp32 numerics on every machine (CPUs with AMX would otherwise default to bf16: models.default_dtype)
os.environ.setdefault("DRAFTSMITH_CPU_DTYPE", "float32")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    # keep dequantized GGUF copies shared across tests (slow to rebuild), everything else per test
    monkeypatch.setenv(
        "DRAFTSMITH_CACHE", os.environ.get("DRAFTSMITH_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    )


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

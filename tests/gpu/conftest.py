"""GPU tests: every test here is marked `gpu` and skipped without CUDA.

Run them on a GPU machine with `python3 -m pytest -q -m gpu tests/gpu`.
"""

from __future__ import annotations

import gc

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture(autouse=True)
def _release_cuda_memory():
    """Hand cached CUDA blocks back after each test: an engine sizes its KV pool from free memory, and
    blocks cached on another stream are not reused by the next test's allocations."""
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()

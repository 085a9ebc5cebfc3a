import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a test module: tiny matmuls and convolutions on the shared 2-core
    machine run far faster without them. Use with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)

import os

import pytest
import torch  # imported before OMP_NUM_THREADS is set below: this process keeps its threads)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The processes tests start (workers, gloo ranks, servers) run one intra-op thread each: several at one
# thread per core oversubscribe the 2-core machine, and a rank spinning in a collective starves the others.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a test module: tiny matmuls and convolutions on the shared 2-core
    machine run far faster without them. Use with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)

"""A worker process's tensor codec: the channel of each edge follows placement (runtime/codecs.py)."""

import torch

from mstar.runtime.codecs import worker_codec
from mstar.transport.placed_channels import CUDA_IPC, SHM, EdgeTransport
from mstar.transport.tensors import TensorPayload, new_session_id


def test_gpu_workers_of_one_host_share_gpu_tensors_by_cuda_ipc():
    codec = worker_codec(new_session_id(), 0, [torch.device("cuda", 0), torch.device("cuda", 1)])
    assert codec.channel.edges == {"conductor": EdgeTransport(SHM, SHM), "worker-1": EdgeTransport(CUDA_IPC, SHM)}


def test_cpu_workers_use_shared_memory_for_everything():
    codec = worker_codec(new_session_id(), 1, [torch.device("cpu")] * 3)
    assert set(codec.channel.edges) == {"conductor", "worker-0", "worker-2"}
    assert set(codec.channel.edges.values()) == {EdgeTransport(SHM, SHM)}
    payload = codec.pack(torch.arange(4), 0)
    assert isinstance(payload, TensorPayload) and torch.equal(codec.unpack(payload), torch.arange(4))

"""kernels/host_copy.copy_words and finish_ids under the Triton interpreter (CPU tensors stand for pinned
host and device memory); run by tests/unit/test_ar_step_graph.py."""

import torch

from mstar.engines.sampling_graph import finish_ids as finish_ids_off_cuda
from mstar.kernels.host_copy import copy_words, finish_ids

g = torch.Generator().manual_seed(0)
a = torch.randint(0, 1 << 30, (3000,), dtype=torch.int32, generator=g)
b = torch.zeros(3000, dtype=torch.int32)
c = torch.randint(0, 255, (40,), dtype=torch.uint8, generator=g)
d = torch.zeros(40, dtype=torch.uint8)
copy_words([(a, b), (c, d)])  # two spans of different lengths, several programs for the first
assert torch.equal(a, b) and torch.equal(c, d)
e, f = torch.arange(5, dtype=torch.int64), torch.zeros(5, dtype=torch.int64)
copy_words([(e, f)])
assert torch.equal(e, f)
for bad in ([(a, b[:10])], [(c[:3], d[:3])], []):
    try:
        copy_words(bad)
    except ValueError:
        pass
    else:
        raise AssertionError(f"accepted {bad!r}")

# finish_ids: columns clamped into [0, width), the offset added, into out and (when given) the host copy;
# 600 rows: three programs
width = 50
columns = torch.randint(-20, width + 20, (600,), dtype=torch.int64, generator=g)
columns[:4] = torch.tensor([-1, 0, width - 1, width])  # the edges
for offset in (0, 128_256):
    want = columns.clamp(0, width - 1) + offset
    out, host = torch.full((600,), -9, dtype=torch.int64), torch.full((700,), -9, dtype=torch.int64)
    finish_ids(columns, out, width, offset, host[:600])
    assert torch.equal(out, want) and torch.equal(host[:600], want) and bool((host[600:] == -9).all())
    alone = torch.full((600,), -9, dtype=torch.int64)
    finish_ids(columns, alone, width, offset)  # no host copy
    assert torch.equal(alone, want)
    # the sampler graphs' torch ops off CUDA give the same ids
    plain, plain_host = torch.zeros(600, dtype=torch.int64), torch.zeros(600, dtype=torch.int64)
    finish_ids_off_cuda(columns, plain, width, offset, plain_host)
    assert torch.equal(plain, want) and torch.equal(plain_host, want)
finish_ids(columns[:0], out[:0], width, 0)  # no rows: nothing launched
for bad in [(columns.int(), out), (columns, out[:10]), (columns, out, host[:10])]:
    try:
        finish_ids(bad[0], bad[1], width, 0, *bad[2:])
    except ValueError:
        pass
    else:
        raise AssertionError("accepted tensors of the wrong type or length")
print("host_copy ok")

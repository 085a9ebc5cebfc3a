"""kernels/host_copy.copy_words under the Triton interpreter (CPU tensors stand for pinned host and device
memory); run by tests/unit/test_ar_step_graph.py."""

import torch

from mstar.kernels.host_copy import copy_words

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
print("host_copy ok")

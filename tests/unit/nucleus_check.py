"""Run under TRITON_INTERPRET=1 by test_sampling_filters.py: the Triton nucleus race equals the sort-based
reference on CPU tensors (prints "nucleus ok")."""

import torch

from mstar.engines.sampling_filters import race_sorted
from mstar.kernels.nucleus import nucleus_race_

gen = torch.Generator().manual_seed(0)
x = torch.randn(5, 700, generator=gen) * torch.tensor([0.5, 2.0, 4.0, 1.0, 3.0])[:, None]
x[2, :50] = -float("inf")  # banned tokens
x[1, :300] = x[1, 420:] = x[1, 301:308] = -float("inf")  # a head restricted to [300, 420), 7 ids blocked
noise = torch.empty_like(x).exponential_(generator=gen)
lse = x.logsumexp(-1)
top_p = torch.tensor([0.3, 0.8, 0.95, 2.0, 0.6])
pmin = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.02]) * (x.amax(-1) - lse).exp()
need = torch.tensor([True, True, True, True, False])
ids = torch.full((5,), -7, dtype=torch.long)
nucleus_race_(x, noise, ids, need, lse, top_p, pmin, block=256)
expected = race_sorted(x, top_p, pmin, lse, noise)
assert ids[:4].tolist() == expected[:4].tolist(), (ids, expected)
assert bool(x[:4].gather(1, ids[:4, None]).isfinite().all()), ids
assert ids[4] == -7, "a row without need must be left alone"
print("nucleus ok")

"""kernels/fused_sampling.exponential_noise_ under the Triton interpreter; run by
tests/unit/test_sampling_static.py (prints "exponential noise ok"). The noise the sampler graphs race
with: a function of the seed the kernel reads from its tensor, Exp(1) distributed, every value positive
and finite."""

import torch

from mstar.kernels.fused_sampling import exponential_noise_

ROWS, VOCAB = 4, 25_000  # 100,000 samples, over several programs a row


def noise_of(seed: torch.Tensor) -> torch.Tensor:
    return exponential_noise_(torch.empty(ROWS, VOCAB), seed)


seed = torch.tensor(1234, dtype=torch.int64)  # a 0-dim scalar, as the sampler graphs' packed seed is
first = noise_of(seed)
assert torch.equal(first, noise_of(seed)), "the same seed gave other noise"

# Exp(1): positive, finite, mean 1 and variance 1 (their standard errors here: 0.003 and 0.009),
# P(E > 1) = exp(-1)
assert bool((first > 0).all()) and bool(first.isfinite().all()), (first.min(), first.max())
assert abs(first.mean().item() - 1.0) < 0.02, first.mean()
assert abs(first.var().item() - 1.0) < 0.05, first.var()
assert abs((first > 1).float().mean().item() - 0.3679) < 0.01
assert not torch.equal(first[0], first[1]), "two rows drew the same noise"

# the kernel reads the seed from the tensor: a new value, new noise (unrelated to the first); the old
# value, the old noise again
seed.fill_(1235)
second = noise_of(seed)
assert (second == first).float().mean().item() < 0.001, "the next seed repeated the noise"
assert abs(torch.corrcoef(torch.stack([first.flatten(), second.flatten()]))[0, 1].item()) < 0.02
seed.fill_(1234)
assert torch.equal(noise_of(seed), first), "the kernel did not read the seed from its tensor"

# every 64-bit pattern is a seed (the sampler stages them as uint64 bits: negative as int64)
seed.fill_(-(2**62) - 12345)
high = noise_of(seed)
assert bool((high > 0).all()) and bool(high.isfinite().all()) and not torch.equal(high, first)
print("exponential noise ok")

"""kernels/token_mask.mask_logits_ under the Triton interpreter against the PyTorch form
(`token_masks.mask_logits_torch_`), with a window offset, rows past the bitmask's words and unflagged rows;
run by tests/unit/test_token_masks.py."""

import torch

from mstar.engines.token_masks import mask_logits_torch_
from mstar.kernels.token_mask import BLOCK, mask_logits_

g = torch.Generator().manual_seed(0)
for rows, vocab, offset, words in ((3, BLOCK + 77, 0, -(-(BLOCK + 77) // 32)), (2, 300, 45, 9), (1, 64, 0, 2)):
    logits = torch.randn(rows, vocab, generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=g)
    flags = torch.tensor([1, 0, 1][:rows], dtype=torch.int32)
    want = logits.clone()
    mask_logits_torch_(want, bitmask, flags, offset)
    mask_logits_(logits, bitmask, flags, offset)
    assert torch.equal(logits, want), (rows, vocab, offset)
    assert torch.isinf(want).any() and torch.isfinite(want[flags == 1]).any()
print("token mask ok")

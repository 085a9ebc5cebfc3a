"""The rotary tables kernel on CUDA (`fused_ops.rope_cos_sin`) against RotaryEmbedding's PyTorch form."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_rope_cos_sin_kernel_equals_the_five_torch_kernels():
    """`fused_ops.rope_cos_sin` (libdevice cosf/sinf) against RotaryEmbedding's PyTorch form on the GPU at
    Orpheus' rope (llama3 scaling, head 128), positions up to its 131,072 context."""
    from mstar.layers.fused import fused_kernels
    from mstar.layers.rope import RopeSpec, RotaryEmbedding

    rope = RotaryEmbedding(RopeSpec(head_dim=128, theta=500000.0, rope_type="llama3", factor=32.0)).cuda()
    positions = torch.cat([torch.arange(0, 5000), torch.randint(0, 131072, (3000,))]).cuda()
    got = rope(positions)
    with fused_kernels(False):
        want = rope(positions)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-6, rtol=0)
    print("bit-equal:", all(torch.equal(g, w) for g, w in zip(got, want)))

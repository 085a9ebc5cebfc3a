"""One representative float32 shape of each Wan kernel (DiT block ops, the VAE's channel norm, the
channels-last VAE ops) against its PyTorch form, in one process under TRITON_INTERPRET=1: the default
test run's share of wan22_kernels_check.py, wan22_vae_kernels_check.py and wan22_vae_cl_check.py, whose
whole runs are in the slow group. Prints "wan quick ok"."""

from __future__ import annotations

import torch

from mstar.models.wan22 import block_math, wan_ops
from tests.models import wan22_kernels_check, wan22_vae_cl_check, wan22_vae_kernels_check

if __name__ == "__main__":
    assert block_math.wan_kernels(torch.zeros(1)) is wan_ops, "run with TRITON_INTERPRET=1"
    torch.manual_seed(0)
    wan22_kernels_check.quick()
    wan22_vae_kernels_check.quick()
    wan22_vae_cl_check.quick()
    print("wan quick ok")

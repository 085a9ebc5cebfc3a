"""The UniPC step on CUDA tensors: no host sync (its coefficients stay on the CPU as scalars), and the
same latents as on the CPU within float32 rounding, for orders 1-3 and 20 steps."""

from __future__ import annotations

import pytest
import torch

from mstar.models.common import unipc
from mstar.models.common.unipc import UniPCConfig


@pytest.mark.parametrize("order", [1, 2, 3])
def test_unipc_step_on_cuda_never_syncs_and_equals_the_cpu(order):
    config = UniPCConfig(solver_order=order)
    gen = torch.Generator().manual_seed(order)
    latents = torch.randn(1, 48, 3, 8, 8, generator=gen)
    velocities = [torch.randn(1, 48, 3, 8, 8, generator=gen) for _ in range(20)]
    cpu_state, gpu_state = unipc.new_state(config, 20), unipc.new_state(config, 20)
    x_cpu, x_gpu = latents, latents.cuda()
    gpu_velocities = [v.cuda() for v in velocities]
    torch.cuda.synchronize()
    for velocity, velocity_gpu in zip(velocities, gpu_velocities, strict=True):
        x_cpu = unipc.step(cpu_state, velocity, x_cpu)
        torch.cuda.set_sync_debug_mode("error")
        try:
            x_gpu = unipc.step(gpu_state, velocity_gpu, x_gpu)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert x_gpu.is_cuda and cpu_state.done and gpu_state.done
    torch.testing.assert_close(x_gpu.cpu(), x_cpu, rtol=1e-5, atol=1e-5)

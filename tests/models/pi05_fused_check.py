"""Checks of Pi0.5's fused norms (`mstar/models/pi05/norm_kernel.py`), GELU-and-mul (`fused_ops.gelu_and_mul`) and
q and k rotated in one launch against their PyTorch forms in `gemma.py`; run with TRITON_INTERPRET=1 (by test_pi05_fused.py, in a fresh process).

Kernel through the layers: adaRMS's `modulate` and `add_modulate` (a gated residual add and the next norm) under
a modulation of one row per robot and one shared, Gemma's norm and its `add_forward`, the MLP, in float32 and
bf16, at a width that is not a power of two; the attention's projections with q and k rotated together (strided)
and apart. Whole policy: the tiny policy's chunks and its prefix's keys and
values, kernels against PyTorch (`fused_kernels(False)`), with every kernel's guard still in use afterwards.

    TRITON_INTERPRET=1 python3 tests/models/pi05_fused_check.py [--quick]
"""

from __future__ import annotations

import sys

import torch

from mstar.layers import mlp as layers_mlp
from mstar.layers.fused import FUSED, fused_kernels
from mstar.layers.mlp import GatedMLP
from mstar.layers.norm import ADD_LAYER_NORM
from mstar.models.pi05 import gemma
from mstar.models.pi05.gemma import AdaRMSNorm, GemmaAttention, GemmaNorm

F32 = dict(atol=1e-5, rtol=1e-5)
BF16_STEP = 2.0 ** -7  # one bf16 rounding step, relative: the interpreter truncates float32 to bf16, torch rounds


def reference(fn, *args):
    with fused_kernels(False):
        return fn(*args)


def _close(got, want, dtype: torch.dtype, what: str) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype == dtype and g.shape == w.shape, (what, g.dtype, w.dtype, g.shape, w.shape)
        # bf16: a step at the tensor's largest value (a difference in a sum's rounding carries into the norm)
        tol = F32 if dtype == torch.float32 else dict(atol=BF16_STEP * w.abs().max().item(), rtol=BF16_STEP)
        torch.testing.assert_close(g, w, **tol, msg=lambda m: f"{what}: {m}")


def check_adarms(dtype: torch.dtype, width: int = 48) -> None:
    gen = torch.Generator().manual_seed(1)
    norm = AdaRMSNorm(width, 24, 1e-6).to(dtype)
    torch.nn.init.normal_(norm.dense.weight, std=0.5, generator=gen)
    x, branch = ((torch.randn(3, 7, width, generator=gen) * 3).to(dtype) for _ in range(2))
    for rows in (3, 1):  # one modulation per robot, and one shared by all (a flow step's)
        with torch.no_grad():
            modulation = norm.modulation(torch.randn(rows, 24, generator=gen).to(dtype))
            gate = modulation[2] * 2  # a previous norm's gate, as the layer hands it on
            _close(norm.modulate(x, modulation), reference(norm.modulate, x, modulation), dtype,
                   f"modulate {rows} {dtype}")
            got = norm.add_modulate(x, branch, gate, modulation)
            want = reference(norm.add_modulate, x, branch, gate, modulation)
            _close(got, want, dtype, f"add_modulate {rows} {dtype}")
            assert not torch.equal(got[1], reference(norm.modulate, x, modulation)[0])  # of the sum


def check_gemma(dtype: torch.dtype, width: int = 48) -> None:
    gen = torch.Generator().manual_seed(2)
    norm = GemmaNorm(width, 1e-6).to(dtype)
    torch.nn.init.normal_(norm.weight, std=0.5, generator=gen)
    x, branch = ((torch.randn(2, 5, width, generator=gen) * 3).to(dtype) for _ in range(2))
    mlp = GatedMLP(width, 40, activation="gelu_tanh").to(dtype)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.3, generator=gen)
    with torch.no_grad():
        _close([norm(x)], [reference(norm, x)], dtype, f"gemma norm {dtype}")
        got = norm.add_forward(x, branch)
        _close(got, reference(norm.add_forward, x, branch), dtype, f"gemma add_forward {dtype}")
        assert dtype != torch.float32 or torch.equal(got[0], x + branch)  # bf16: the interpreter truncates
        _close([mlp(x)], [reference(mlp, x)], dtype, f"gemma mlp {dtype}")


def check_project(dtype: torch.dtype) -> None:
    """q and k rotated in one launch, as views of one tensor, are the values rotated apart, kernel and PyTorch."""
    from mstar.layers.rope import RopeSpec, RotaryEmbedding
    from mstar.models.pi05.tiny import tiny_config

    shape = tiny_config().expert
    attn = GemmaAttention(shape).to(dtype)
    gen = torch.Generator().manual_seed(4)
    torch.nn.init.normal_(attn.qkv.weight, std=0.5, generator=gen)
    x = torch.randn(2, 5, shape.width, generator=gen).to(dtype)
    cos, sin = RotaryEmbedding(RopeSpec(shape.head_dim))(torch.arange(10) + 7)
    with torch.no_grad():
        apart = reference(attn.project, x, cos, sin)
        for got in (attn.project(x, cos, sin, strided=True), attn.project(x, cos, sin),
                    reference(attn.project, x, cos, sin, True)):
            _close(got, apart, dtype, f"project {dtype}")
        assert not attn.project(x, cos, sin, strided=True)[0].is_contiguous()


def check_gelu_and_mul(dtype: torch.dtype) -> None:
    """The kernel alone: more columns than one program's block, large gates (tanh's saturation), strided rows."""
    from mstar.kernels.fused_ops import gelu_and_mul

    gen = torch.Generator().manual_seed(3)
    wide = (torch.randn(3, 2 * 1500 + 8, generator=gen) * 4).to(dtype)
    wide[0, :4] = torch.tensor([30.0, -30.0, 0.0, -1e-4]).to(dtype)
    rows = wide[:, :3000]
    want = torch.nn.functional.gelu(rows[:, :1500], approximate="tanh") * rows[:, 1500:]
    _close([gelu_and_mul(rows)], [want], dtype, f"gelu_and_mul {dtype}")


def check_vision(dtype: torch.dtype) -> None:
    """The tiny vision tower (one camera and three): every residual add with the LayerNorm after it, the last
    with the final norm, in one kernel each (2 * layers + 1 launches a forward), and its PyTorch form's tokens."""
    from mstar.kernels import fused_ops
    from mstar.models.pi05.siglip import VisionTower
    from mstar.models.pi05.tiny import tiny_config

    shape = tiny_config().vision
    tower = VisionTower(shape, 24).to(dtype).eval()
    for p in tower.parameters():
        torch.nn.init.normal_(p, std=0.3, generator=torch.Generator().manual_seed(p.numel()))
    kernel, launches = fused_ops.layer_norm, []
    fused_ops.layer_norm = lambda *a, **k: (launches.append(1), kernel(*a, **k))[1]
    try:
        for cameras in (1, 3):
            images = torch.rand(cameras, 3, shape.image_size, shape.image_size, generator=torch.Generator().manual_seed(cameras)) * 2 - 1
            launches.clear()
            with torch.no_grad():
                got = tower(images)
            assert len(launches) == 2 * shape.num_layers + 1, (cameras, len(launches))
            with torch.no_grad():
                want = reference(tower, images)
            _close([got], [want], dtype, f"vision tower, {cameras} cameras, {dtype}")
    finally:
        fused_ops.layer_norm = kernel


def check_policy() -> None:
    """The tiny policy's prefix keys and values and its chunks (of 3 steps) for two robots: kernels and PyTorch."""
    from mstar.models.pi05.network import PolicyNet
    from mstar.models.pi05.weights import build
    from tests.models.test_pi05_fast_path import CONFIG, ROBOTS, _chunks, _items, _policy, _robot

    gemma._FLOW_ATTENTION.usable = False  # the masked form: pi05_flow_attention_check.py interprets the kernel
    net = build(lambda: PolicyNet(CONFIG), torch.float32, "cpu", None, None, seed=4, std=0.1).eval()
    robots = {rid: _robot(*ROBOTS[rid]) for rid in ("a", "b")}  # of different cameras and prompts
    fused, plain = _policy(net), _policy(net)
    with torch.no_grad():
        fused.run_items(_items("prefix", robots))
        with fused_kernels(False):
            plain.run_items(_items("prefix", robots))
    got, want = fused.pool.view(list(robots)), plain.pool.view(list(robots))
    valid = want.valid[None, :, :, None, None]
    for a, b in ((got.keys, want.keys), (got.values, want.values)):
        torch.testing.assert_close(a * valid, b * valid, atol=1e-5, rtol=0)
    chunks = _chunks(_policy(net), robots, steps=3)  # the interpreter runs a program at a time: a short flow
    with fused_kernels(False):
        plain_chunks = _chunks(_policy(net), robots, steps=3)
    for a, b in zip(chunks, plain_chunks, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert not torch.allclose(chunks[0], chunks[1], atol=1e-3)
    assert gemma._NORM.usable and layers_mlp._GELU_AND_MUL.usable, "a kernel failed: the PyTorch form gave the chunks"
    assert ADD_LAYER_NORM.usable, "the vision tower's add + layer norm kernel failed: the PyTorch form gave the keys"


def main() -> None:
    assert FUSED.ops_for(torch.zeros(1)) is not None, "run with TRITON_INTERPRET=1"
    torch.set_num_threads(1)
    quick = "--quick" in sys.argv[1:]
    for dtype in (torch.float32,) if quick else (torch.float32, torch.bfloat16):
        check_adarms(dtype)
        check_gemma(dtype)
        check_gelu_and_mul(dtype)
        check_project(dtype)
        check_vision(dtype)
    assert gemma._NORM.usable and layers_mlp._GELU_AND_MUL.usable, "a kernel failed: the PyTorch form served"
    check_policy()
    print("pi05 fused ok")


if __name__ == "__main__":
    main()

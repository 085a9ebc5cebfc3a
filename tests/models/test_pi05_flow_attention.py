"""Pi0.5's flow attention over the valid keys only (mstar/models/pi05/flow_attention.py) equals the masked form,
kernel alone and as the tiny policy's chunks (run on CPU through the Triton interpreter)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.interpreted import run_interpreted

pytest.importorskip("triton")
CHECK = Path(__file__).with_name("pi05_flow_attention_check.py")


@pytest.mark.slow  # every kernel case; CI's slow group runs it
def test_flow_attention_matches_the_masked_form():
    proc = run_interpreted(CHECK, OMP_NUM_THREADS="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "flow attention ok" in proc.stdout


def test_flow_attention_matches_the_masked_form_one_shape():
    """The default run's representative of the check above: one kernel case and the policy's chunks."""
    proc = run_interpreted(CHECK, "--quick", OMP_NUM_THREADS="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "flow attention ok" in proc.stdout


def test_a_flow_kernel_that_fails_hands_over_to_the_masked_form(monkeypatch, caplog):
    """A Triton that cannot build or launch the flow kernel (never yet run on a GPU) costs one logged failure,
    not every robot's chunk: `attend_prefix` gives the masked form, and the kernel is not tried again."""
    import torch

    import mstar.models.pi05.flow_attention as flow_attention
    from mstar.kernels.guard import KernelGuard
    from mstar.layers.fused import FUSED, fused_kernels
    from mstar.models.pi05 import gemma
    from mstar.models.pi05.tiny import tiny_config

    monkeypatch.setattr(FUSED, "interpret", True)  # the fused path is taken for these CPU tensors
    # a guard of the test's own, so the kernel it retires is not retired for the tests after it
    monkeypatch.setattr(gemma, "_FLOW_ATTENTION", KernelGuard("flow attention"), raising=False)
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("out of resources: shared memory")

    monkeypatch.setattr(flow_attention, "valid_keys_attention", broken)
    attn = gemma.GemmaAttention(tiny_config().expert).eval()
    gen = torch.Generator().manual_seed(3)
    shape = tiny_config().expert
    q = torch.randn(2, 5, shape.num_heads, shape.head_dim, generator=gen)
    k, v = (torch.randn(2, 5, shape.num_kv_heads, shape.head_dim, generator=gen) for _ in range(2))
    prefix = tuple(torch.randn(2, 12, shape.num_kv_heads, shape.head_dim, generator=gen) for _ in range(2))
    lengths = torch.tensor([7, 12])
    with torch.no_grad():
        got = [attn.attend_prefix(q, prefix, lengths, k, v) for _ in range(2)]
        with fused_kernels(False):
            want = attn.attend_prefix(q, prefix, lengths, k, v)
    assert all(torch.equal(g, want) for g in got)
    assert len(calls) == 1 and "flow attention kernel failed" in caplog.text

"""Opt-in torch.compile of the Wan DiT blocks (wan22 `model_kwargs: {compile: true}`).

Each WanBlock runs two pure-tensor halves around the self-attention core: `pre_attention` (modulation,
float32 layer norm, q/k/v projections, RMS norms, rope) and `post_attention` (output projection, gated
residual, cross-attention, modulated FFN, gated residual). Inductor fuses their many float32
elementwise passes over [B, L, D]; the `attend` callable between them stays eager, so Ulysses
sequence parallelism (collectives) keeps working unchanged.

Compilation is lazy: the first forward of each new shape family pays it (tens of seconds on a GPU for
the full model). `dynamic=None` lets dynamo mark a dimension dynamic after it first changes, so new
row counts or video sizes cost one recompile each (then one dynamic graph serves them all; a batch of
one row is specialised once more), well under dynamo's default recompile limit of 8. Every block shares
the same compiled code (same code objects, parameters passed as graph inputs).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


def compile_blocks(transformer: Any, fullgraph: bool = True, mode: str | None = None) -> int:
    """Replace every block's `pre_attention` and `post_attention` of `transformer` (a WanTransformer)
    with torch.compile'd versions (inductor); returns the number of blocks wrapped.

    Outputs equal the eager ones up to float rounding of the fused kernels. Calling it twice is an
    error (the blocks would be wrapped twice).
    """
    import torch

    blocks = list(transformer.blocks)
    if any(getattr(block, "_mstar_compiled", False) for block in blocks):
        raise RuntimeError("compile_blocks was already applied to this transformer; call it once per model")
    for block in blocks:
        # Instance attributes shadow the methods: forward() looks them up through self, so the eager
        # `attend` between the two compiled halves is untouched.
        for name in ("pre_attention", "post_attention"):
            compiled = torch.compile(getattr(block, name), fullgraph=fullgraph, dynamic=None, mode=mode)
            setattr(block, name, _unaliased(compiled, torch.Tensor))
        block._mstar_compiled = True
    logger.info("torch.compile set on %d Wan DiT blocks (fullgraph=%s, mode=%s); the first forward of each "
                "new shape compiles", len(blocks), fullgraph, mode)
    return len(blocks)


def _unaliased(fn: Callable[..., Any], tensor: type) -> Callable[..., Any]:
    """`fn` called on detached tensor arguments (inference only: no gradients flow through).

    Dynamo guards on whether an input is a view (`x._base`): the first block's input is a fresh tensor,
    later blocks' are views (float32 `.to()` is a no-op view), so without this every shape change would
    compile two variants. `detach()` shares the storage (no copy) and is never a view.
    """

    def call(*args: Any) -> Any:
        return fn(*(a.detach() if isinstance(a, tensor) else a for a in args))

    return call


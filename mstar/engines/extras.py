"""Optional inputs and outputs of one packed forward, beyond token ids and positions.

A `CausalLM` that sets `accepts_extras = True` takes `forward(input_ids, positions, attn, extras)`
where `extras` is a `ForwardExtras` or None. The autoregressive engine builds one when an item
carries `inputs["input_embeds"]` (embeddings replacing the lookup of some tokens), model-declared
per-token features (`model.token_features`, e.g. Qwen3-Omni's deepstack visual features), or asks
for hidden states (`options["return_hidden"]`). Models use the two helpers so that every model
treats them the same way:

    x = extras.embed(self.embed_tokens, input_ids) if extras else self.embed_tokens(input_ids)
    extras.record(0, x); ...; extras.record(layer + 1, x); ...; extras.record(FINAL, normed)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

FINAL = -1  # layer index of the final hidden states (after the last norm)


@dataclass
class ForwardExtras:
    """Per-step extras of a packed batch of T tokens (rows index that batch)."""

    embeds: torch.Tensor | None = None  # [M, H]: used instead of the embedding lookup at `embeds_rows`
    embeds_rows: torch.Tensor | None = None  # [M] int64 rows of the packed batch
    features: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [M, ...] aligned with embeds_rows
    capture: frozenset[int] = frozenset()  # layers to record: 0 = embeddings, k = output of layer k, FINAL
    captured: dict[int, torch.Tensor] = field(default_factory=dict)  # filled by the model: layer -> [T, H]

    def embed(self, table: nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding lookup of `input_ids` [T] with the given rows replaced by `embeds`."""
        x = table(input_ids)
        if self.embeds is not None and self.embeds_rows is not None:
            x = x.index_copy(0, self.embeds_rows, self.embeds.to(x.dtype))
        return x

    def record(self, layer: int, x: torch.Tensor) -> None:
        """Record hidden states `x` [T, H] of `layer` if it was asked for."""
        if layer in self.capture:
            self.captured[layer] = x

    def layer_outputs(self, change: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
                      changed: frozenset[int] = frozenset()
                      ) -> tuple[frozenset[int], Callable[[int, torch.Tensor], torch.Tensor]]:
        """(outputs_at, on_output) for `layers.decoder.run_layers`: the outputs of the captured layers
        (numbered from 1 here, from 0 there) are recorded, and `change(i, out)` is applied to those of the
        layers in `changed` after."""
        def on_output(i: int, out: torch.Tensor) -> torch.Tensor:
            self.record(i + 1, out)
            return change(i, out) if change is not None and i in changed else out

        return frozenset(k - 1 for k in self.capture if k > 0) | changed, on_output

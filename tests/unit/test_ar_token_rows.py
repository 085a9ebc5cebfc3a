"""TokenInputs keeps embedding-row indexes on the host and picks a step's rows there (a device read per
decode step was a host sync): the rows picked for any token range are the ones the mask put there."""

from __future__ import annotations

import torch

from mstar.engines.autoregressive.token_inputs import ItemExtras, TokenInputs, parse_item
from mstar.engines.base import StepItem


class _Model:
    accepts_extras = True
    token_features = ("deep",)


def _item(mask: list[bool], embeds: torch.Tensor, deep: torch.Tensor) -> StepItem:
    return StepItem("r", "w", "n", {"input_ids": torch.zeros(len(mask), dtype=torch.long), "input_embeds": embeds,
                                    "embeds_mask": torch.tensor(mask), "deep": deep})


def test_rows_in_picks_the_masked_rows_of_any_range() -> None:
    mask = [False, True, True, False, True, False, True, True]
    embeds = torch.arange(5 * 2, dtype=torch.float32).reshape(5, 2)
    deep = embeds * 10
    extras = parse_item(_item(mask, embeds, deep), len(mask), _Model())
    assert extras is not None and extras.rows.device.type == "cpu" and extras.rows.tolist() == [1, 2, 4, 6, 7]
    inputs = TokenInputs()
    inputs.add(20, len(mask), extras)
    assert inputs.num_shareable == 21  # the first token with an embedding
    masked = [20 + i for i, m in enumerate(mask) if m]
    for start in range(18, 30):
        for n in (1, 3, 8):
            want = [k for k, t in enumerate(masked) if start <= t < start + n]
            got = inputs.rows_in(start, n)
            if not got:
                assert start >= 28 or start + n <= 20, (start, n)
                continue
            (offsets, values, feats), = got
            assert offsets.device.type == "cpu"
            assert offsets.tolist() == [masked[k] - start for k in want]
            assert torch.equal(values, embeds[want]) and torch.equal(feats["deep"], deep[want])


def test_unmasked_embeddings_cover_every_token() -> None:
    embeds = torch.randn(4, 3)
    extras = ItemExtras(embeds=embeds, rows=torch.arange(4))
    inputs = TokenInputs()
    inputs.add(0, 4, extras)
    (offsets, values, _), = inputs.rows_in(2, 1)  # a decode step's one row: a slice of the item's rows
    assert offsets.tolist() == [0] and values.data_ptr() == embeds[2].data_ptr()

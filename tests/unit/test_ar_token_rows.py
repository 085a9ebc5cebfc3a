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


def test_decode_positions_keep_what_was_given_and_the_fast_path_only_when_default():
    """One-token adds (decode steps): positions equal to the default leave no explicit entry (the
    sequence keeps its prefix-cache share), others are stored; either way `positions` returns what
    was given, for 1- and 3-row positions and after shifted prompts."""
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 3):
        ti = TokenInputs()
        prompt = torch.arange(6).expand(rows, -1).contiguous() + 4  # shifted by 4
        ti.add(0, 6, ItemExtras(positions=prompt))
        n, shareable = 6, ti.num_shareable
        for _ in range(40):
            default = int(ti.positions(n, 1)[0, 0])
            jump = int(torch.randint(0, 3, (), generator=gen))  # 0: the default position (fast path)
            given = torch.full((rows, 1), default + jump, dtype=torch.long)
            ti.add(n, 1, ItemExtras(positions=given))
            assert ti.positions(n, 1).tolist() == [[default + jump]] * (3 if ti.multi_row else 1)
            if jump == 0:
                assert ti.num_shareable == shareable, "a default position must not be stored"
            shareable = ti.num_shareable
            n += 1

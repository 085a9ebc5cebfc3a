"""V-JEPA 2-AC's action-conditioned predictor, with a KV cache that grows one frame at a time.

Each frame is a block of tokens: its action, its state (and extrinsics when the checkpoint uses them),
then its patch latents. Attention is block-causal over frames, so a frame's keys and values never
change once computed: a rollout appends the frame it just predicted to the cache and attends to
everything before, instead of re-running the whole growing context at every step. The output at a
frame's patch tokens predicts the next frame's latents.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar.models.vjepa2.config import ACPredictorConfig
from mstar.models.vjepa2.layers import LayerKV, blocks
from mstar.models.vjepa2.rope import grid_positions, rope_tables


class RolloutCache:
    """Keys and values of every layer for a batch of sequences that hold the same frames so far."""

    def __init__(self, layers: list[LayerKV], tokens_per_block: int) -> None:
        self.layers, self.tokens_per_block = layers, tokens_per_block

    @property
    def frames(self) -> int:
        """Frames (blocks) held."""
        return self.layers[0].length // self.tokens_per_block

    @property
    def capacity(self) -> int:
        return self.layers[0].keys.shape[2] // self.tokens_per_block

    @property
    def batch(self) -> int:
        return self.layers[0].keys.shape[0]

    def truncate(self, frames: int) -> None:
        """Forget every frame after the first `frames` (their slots are overwritten by later appends)."""
        for layer in self.layers:
            layer.length = frames * self.tokens_per_block

    def rows(self, batch: int) -> RolloutCache:
        """The first `batch` rows of this cache, sharing its buffers (a smaller batch on a larger cache)."""
        layers = [LayerKV(layer.keys[:batch], layer.values[:batch], layer.length) for layer in self.layers]
        return RolloutCache(layers, self.tokens_per_block)

    def share(self, into: RolloutCache) -> None:
        """Write this one-row cache's frames into every row of `into` (computed once, for every row) and
        make `into` hold exactly them."""
        assert self.batch == 1, "only a one-row cache is shared"
        held = self.layers[0].length
        for source, target in zip(self.layers, into.layers, strict=True):
            target.keys[:, :, :held] = source.keys[:, :, :held]
            target.values[:, :, :held] = source.values[:, :, :held]
            target.length = held


class ACPredictor(nn.Module):
    """(frame latents, actions, states) -> next-frame latents, frame by frame (module docstring)."""

    def __init__(self, config: ACPredictorConfig) -> None:
        super().__init__()
        self.config = config
        width, action = config.vit.hidden_size, config.action_dim
        self.predictor_embed = nn.Linear(config.embed_dim, width)
        self.action_encoder = nn.Linear(action, width)
        self.state_encoder = nn.Linear(action, width)
        self.extrinsics_encoder = nn.Linear(action - 1, width)  # in every checkpoint; used with use_extrinsics
        self.blocks = blocks(config.vit)
        self.norm = nn.LayerNorm(width, eps=config.vit.layer_norm_eps)
        self.proj = nn.Linear(width, config.embed_dim)
        self._rope: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # device -> tables from frame 0

    @property
    def block_tokens(self) -> int:
        """Tokens per frame: the conditioning tokens, then the patches."""
        return self.config.cond_tokens + self.config.tokens_per_frame

    def new_cache(self, batch: int, frames: int, dtype: torch.dtype | None = None,
                  device: torch.device | None = None) -> RolloutCache:
        """An empty cache for `batch` sequences of up to `frames` frames."""
        weight = self.proj.weight
        shape = self._cache_shape(batch, frames)
        dtype, device = dtype or weight.dtype, device or weight.device
        layers = [LayerKV(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
                  for _ in self.blocks]
        return RolloutCache(layers, self.block_tokens)

    def cache_bytes(self, batch: int, frames: int) -> int:
        """Bytes `new_cache(batch, frames)` allocates in the weights' dtype: keys and values of every layer."""
        shape = self._cache_shape(batch, frames)
        return 2 * len(self.blocks) * shape[0] * shape[1] * shape[2] * shape[3] * self.proj.weight.element_size()

    def _cache_shape(self, batch: int, frames: int) -> tuple[int, int, int, int]:
        vit = self.config.vit
        return batch, vit.num_heads, frames * self.block_tokens, vit.head_dim

    def rope(self, first: int, frames: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [frames * block_tokens, head_dim] of frames first .. first + frames - 1, sliced from
        tables computed once per device (a step launches no work and copies nothing for them)."""
        tables = self._rope.get(device)
        end = (first + frames) * self.block_tokens
        if tables is None or tables[0].shape[0] < end:
            tables = self._rope[device] = self.rope_tables(max(first + frames, self.config.num_frames), device)
        start = first * self.block_tokens
        return tables[0][start:end], tables[1][start:end]

    def rope_tables(self, frames: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [frames * block_tokens, head_dim] of frames 0 .. frames - 1: patches turn by (frame,
        row, column), conditioning tokens by frame only."""
        rows, cols = self.config.grid
        cond = self.config.cond_tokens
        patches = grid_positions(frames, rows, cols, device, col_scale=rows / cols).view(frames, rows * cols, 3)
        positions = torch.cat([patches[:, :1].expand(-1, cond, -1), patches], dim=1)  # cond tokens: frame only
        rotate = torch.ones(frames, cond + rows * cols, 3, dtype=torch.bool, device=device)
        rotate[:, :cond, 1:] = False
        return rope_tables(positions.reshape(-1, 3), self.config.vit.head_dim, rotate.reshape(-1, 3))

    def embed(self, latents: torch.Tensor, actions: torch.Tensor, states: torch.Tensor,
              extrinsics: torch.Tensor | None = None) -> torch.Tensor:
        """latents [B, T, HW, E], actions and states [B, T, A] -> tokens [B, T * block_tokens, width]."""
        dtype = self.proj.weight.dtype
        cond = [self.action_encoder(actions.to(dtype)), self.state_encoder(states.to(dtype))]
        if self.config.use_extrinsics:
            if extrinsics is None:
                raise ValueError("this predictor conditions on extrinsics; pass them")
            cond.append(self.extrinsics_encoder(extrinsics.to(dtype)))
        x = torch.cat([*(c.unsqueeze(2) for c in cond), self.predictor_embed(latents.to(dtype))], dim=2)
        return x.flatten(1, 2)

    def forward(self, latents: torch.Tensor, actions: torch.Tensor, states: torch.Tensor,
                extrinsics: torch.Tensor | None = None, cache: RolloutCache | None = None,
                last_only: bool = False) -> torch.Tensor:
        """Predict the frame after each of the T frames given ([B, T, HW, E] latents, [B, T, A] actions
        and states): [B, T, HW, E], or [B, 1, HW, E] for the last with `last_only`. With `cache`, the
        frames are appended after the ones it holds and attend to them too."""
        batch, frames = latents.shape[:2]
        first = cache.frames if cache is not None else 0
        if cache is not None and first + frames > cache.capacity:
            raise ValueError(f"the rollout cache holds {cache.capacity} frames; {first + frames} needed")
        x = self.embed(latents, actions, states, extrinsics)
        rope = self.rope(first, frames, x.device)
        mask = None if frames == 1 else block_causal_mask(frames, self.block_tokens, first * self.block_tokens,
                                                          x.device)
        x = self.blocks.run(x, rope, mask, cache.layers if cache is not None else None)
        x = x.view(batch, frames, self.block_tokens, -1)
        if last_only:
            x = x[:, -1:]
        return self.proj(self.norm(x[:, :, self.config.cond_tokens:]))


def block_causal_mask(frames: int, block: int, before: int, device: torch.device) -> torch.Tensor:
    """[frames * block, before + frames * block] bool: every new token sees the `before` cached tokens,
    its own frame and earlier new frames."""
    frame = torch.arange(frames * block, device=device) // block  # not repeat_interleave: it syncs for its size
    new = frame[:, None] >= frame[None, :]
    return torch.cat([new.new_ones(len(frame), before), new], dim=1)


def normalize_latents(latents: torch.Tensor) -> torch.Tensor:
    """Layer norm without scale or shift over the latent width, as V-JEPA 2-AC compares and feeds them."""
    return F.layer_norm(latents, (latents.shape[-1],))

"""The Wan DiT forward replayed from CUDA graphs: one launch a step instead of ~870.

A denoising step at 832x480 is ~115 ms of GPU work in ~870 kernels; launched one by one from Python
the GPU sits idle a few milliseconds a forward between them. `DiTGraphs` captures the forward per
latent shape (with its timestep shape and text length) and per exact batch size (rows = requests x
guidance branches), on the first forward of that shape and size: the DiT is compute-bound, so a batch
padded to a larger captured size would pay for its padding rows in full.

Inputs reach the graph through static buffers: latents and timesteps are copied in every step (a few
MB); the cross-attention keys and values of the batch's text (`TextKVCache`, ~189 MB a row) are copied
only when the batch's composition changes, which in a serving loop is rare (requests keep their rows
from step to step). All shapes share one memory pool; each forward's output is copied out before the
next replay, which is what sharing needs.
"""

from __future__ import annotations

import torch

from mstar.engines.cuda_graphs import BatchGraphs
from mstar.models.wan22.transformer import TextKV, WanTransformer


class DiTGraphs:
    """`__call__(latents [B, C, F, H, W], timesteps [B, ...], text_kv) -> velocity`, as the transformer's
    forward with `text_kv`, for B up to `max_rows` (the caller runs larger batches eagerly).

    The returned tensor is a view into the graph's static output: valid until the next call.
    """

    def __init__(self, transformer: WanTransformer, max_rows: int, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"DiT graphs need a CUDA device, got {device}")
        self.transformer, self.max_rows, self.device = transformer, max_rows, device
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple, BatchGraphs] = {}
        self._kv: dict[tuple, list[torch.Tensor]] = {}  # per text (length, heads, head dim): static k, v per block
        self._staged: tuple[object, int, tuple] | None = None  # (text_kv list, rows, kv key) now in the buffers

    @property
    def captured(self) -> dict[tuple, list[int]]:
        """Batch sizes captured so far per (latent shape, timestep shape, text shape)."""
        return {key: graphs.captured_sizes for key, graphs in self._graphs.items()}

    def __call__(self, latents: torch.Tensor, timesteps: torch.Tensor, text_kv: TextKV) -> torch.Tensor:
        rows = latents.shape[0]
        if rows > self.max_rows:
            raise ValueError(f"a DiT batch of {rows} rows is over the graphs' {self.max_rows}")
        k0 = text_kv[0][0]  # [B, H, Lt, d]
        kv_key = (k0.shape[2], k0.shape[1], k0.shape[3], k0.dtype)
        static_kv = self._stage(text_kv, rows, kv_key)
        key = (tuple(latents.shape[1:]), latents.dtype, tuple(timesteps.shape[1:]), timesteps.dtype, kv_key)
        graphs = self._graphs.get(key)
        if graphs is None:
            example = [(tuple(latents.shape[1:]), latents.dtype), (tuple(timesteps.shape[1:]), timesteps.dtype)]
            example += [(tuple(t.shape[1:]), t.dtype) for t in static_kv]
            graphs = self._graphs[key] = BatchGraphs(
                self._forward, range(1, self.max_rows + 1), example, self.device,
                static_inputs=[None, None, *static_kv], lazy=True, pool=self._pool)
        return graphs(latents, timesteps, *(t[:rows] for t in static_kv))[0]

    def _forward(self, latents: torch.Tensor, timesteps: torch.Tensor, *kv: torch.Tensor) -> torch.Tensor:
        """What each graph records: the forward on static buffers (k, v stored [B, Lt, H, d])."""
        text_kv = [(kv[i].transpose(1, 2), kv[i + 1].transpose(1, 2)) for i in range(0, len(kv), 2)]
        return self.transformer(latents, timesteps, None, text_kv=text_kv)

    def _stage(self, text_kv: TextKV, rows: int, kv_key: tuple) -> list[torch.Tensor]:
        """The static k, v buffers holding `text_kv` in their first `rows` rows (copied unless already)."""
        static = self._kv.get(kv_key)
        if static is None:
            length, heads, head_dim, dtype = kv_key
            static = self._kv[kv_key] = [
                torch.empty((self.max_rows, length, heads, head_dim), dtype=dtype, device=self.device)
                for _ in range(2 * len(text_kv))]
        staged = self._staged
        if staged is None or staged[0] is not text_kv or staged[1] != rows or staged[2] != kv_key:
            for i, (k, v) in enumerate(text_kv):
                static[2 * i][:rows].copy_(k.transpose(1, 2))
                static[2 * i + 1][:rows].copy_(v.transpose(1, 2))
            self._staged = (text_kv, rows, kv_key)  # holds the list, so its identity stays unique
        return static

"""The toy model's components. Integer-valued float64 weights keep every result exact, so batched
and unbatched runs (and any placement) give identical outputs."""

from __future__ import annotations

import math
import time

import torch
from torch import nn

from mstar.engines.base import StatelessBase
from mstar.models.toy.processor import painted_size

PRINTABLE = (32, 127)  # the guide picks tokens in this byte range


def _weights(cfg, *shape: int, salt: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + salt)
    return torch.randint(-8, 9, shape, generator=gen).double()


class Encoder(StatelessBase, nn.Module):
    """prompt bytes -> context (sum of byte embeddings) and a first token (the last prompt byte)."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.register_buffer("embed", _weights(cfg, cfg.vocab, cfg.hidden, salt=1))

    def run_batch(self, walk, node, inputs, options):
        return [
            {"context": self.embed[x["prompt_ids"]].sum(0), "token": x["prompt_ids"][-1:],
             "position": torch.zeros(1, dtype=torch.long, device=self.embed.device)}
            for x in inputs
        ]


class Decoder(StatelessBase, nn.Module):
    """(token, position, context) -> scores; a missing context (the unconditional branch) counts as zeros."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.delay = cfg.step_delay_s
        self.register_buffer("embed", _weights(cfg, cfg.vocab, cfg.hidden, salt=2))
        self.register_buffer("mix", _weights(cfg, cfg.hidden, cfg.vocab, salt=3))
        self.register_buffer("pos", _weights(cfg, 64, cfg.hidden, salt=4))

    def run_batch(self, walk, node, inputs, options):
        if self.delay:
            time.sleep(self.delay)
        tokens = torch.cat([x["token"] for x in inputs])
        positions = torch.cat([x["position"] for x in inputs]) % self.pos.shape[0]
        zeros = torch.zeros(self.embed.shape[1], dtype=self.embed.dtype, device=self.embed.device)
        context = torch.stack([x.get("context", zeros) for x in inputs])
        scores = (self.embed[tokens] + self.pos[positions] + context) @ self.mix  # one matmul for the batch
        return [{"scores": row} for row in scores]


class Guide(StatelessBase, nn.Module):
    """Guidance combine: uncond + g * (cond - uncond); argmax over printable bytes; stop on '.'-like
    tokens (token % 11 == 0) unless the request turns `stop_early` off. With the request option
    `report_progress`, it also returns `progress`: tokens generated so far / max_tokens, in (0, 1]."""

    def __init__(self, cfg) -> None:
        super().__init__()

    def run_batch(self, walk, node, inputs, options):
        out = []
        for x, opts in zip(inputs, options):
            g = float(opts.get("guidance", 2.0))
            guided = x["uncond_scores"] + g * (x["cond_scores"] - x["uncond_scores"])
            lo, hi = PRINTABLE
            token = guided[lo:hi].argmax().view(1) + lo
            stop = bool(opts.get("stop_early", True)) and int(token) % 11 == 0
            result = {"token": token, "generated": token.clone(), "position": x["position"] + 1, "stop": stop}
            if opts.get("report_progress"):
                done = float(x["position"][0]) + 1  # position counts the tokens generated before this one
                result["progress"] = torch.tensor([min(1.0, done / int(opts["max_tokens"]))], dtype=torch.float32)
            out.append(result)
        return out


class Painter(StatelessBase, nn.Module):
    """generated tokens -> an image [H, N, 3] and a two-frame video [2, H, N, 3], uint8 (N tokens; with option
    `size` the tokens repeat across its width and H is its height)."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.height = cfg.image_height

    def run_batch(self, walk, node, inputs, options):
        out = []
        for x, opts in zip(inputs, options, strict=True):
            row, height = x["generated"].to(torch.uint8), self.height
            size = painted_size(opts, self.height)
            if size is not None:  # the tokens repeated across the asked width
                width, height = size
                row = row[torch.arange(width, device=row.device) % row.numel()] if row.numel() else row.new_zeros(width)
            image = torch.stack([row, 255 - row, row // 2], dim=-1).expand(height, -1, -1).contiguous()
            out.append({"image": image, "video": torch.stack([image, 255 - image])})
        return out


class Vocoder(StatelessBase, nn.Module):
    """A window of tokens -> float32 samples for the window's new tokens (a tone per token)."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.spt = cfg.samples_per_token

    def run_batch(self, walk, node, inputs, options):
        out = []
        for x in inputs:
            new = int(x["codes_new"])
            tokens = x["codes"][len(x["codes"]) - new:].double() if new else x["codes"][:0].double()
            k = torch.arange(self.spt, dtype=torch.float64, device=tokens.device)
            wave = torch.sin(2 * math.pi * (tokens[:, None] / 256.0) * (k[None, :] + 1))
            out.append({"audio": wave.reshape(-1).float()})
        return out

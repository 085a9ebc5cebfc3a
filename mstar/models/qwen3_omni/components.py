"""The served components of Qwen3-Omni that join the thinker, talker, code predictor and Code2Wav.

- `TalkerInput` (stateless, next to the talker): turns the thinker's streamed states into the
  talker's input rows. Iteration 0 builds the talker prompt (`talker.build_prompt`); later
  iterations add the next thinker token's projected embedding (then tts_eos once, then tts_pad) to
  the previous frame's `codec_embed_sum`.
- `CodecTalker`: the talker backbone whose logits never pick the codec's special ids but EOS
  (the reference's `suppress_tokens`).
- `FrameCodePredictor`: the code predictor that emits no frame for the codec EOS.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from mstar.layers.moe import MoEGraphCapture
from mstar.models.qwen3_omni.code_predictor import CodePredictor
from mstar.models.qwen3_omni.config import TalkerConfig
from mstar.models.qwen3_omni.talker import Qwen3OmniTalker, ResizeMLP, build_prompt

logger = logging.getLogger(__name__)

SUPPRESSED_SPECIALS = 1024  # the top ids of the talker's codec vocabulary are control tokens


class TalkerInput(nn.Module):
    """The stateless `talker_input` component (one call per talker step, see the module doc).

    Inputs per request: `thinker_states` [2, r, Ht] (rows: the thinker's input embeddings and its
    `accept_hidden_layer` states; absent once the thinker's stream has ended), `prompt_ids` [n],
    `talker_positions` [3, m] (the talker prompt's M-RoPE positions), and the loop-back edges
    `frame_index`, `first_code`, `codec_embed_sum`, `text_ended` (absent on iteration 0).
    Outputs: `talker_ids`, `talker_embeds`, `talker_pos` (what the talker step submits),
    `frame_index` (this step's), `text_ended`.
    """

    def __init__(self, config: TalkerConfig, token_ids: Mapping[str, int]) -> None:
        super().__init__()
        self.config = config
        self.token_ids = dict(token_ids)
        text = config.text
        self.text_projection = ResizeMLP(config.thinker_hidden_size, text.intermediate_size, text.hidden_size)
        self.hidden_projection = ResizeMLP(config.thinker_hidden_size, text.intermediate_size, text.hidden_size)
        self.codec_embedding = nn.Embedding(text.vocab_size, text.hidden_size)
        # thinker input embeddings of tts_bos, tts_eos, tts_pad (rows of the thinker's embed_tokens)
        self.tts_rows = nn.Parameter(torch.zeros(3, config.thinker_hidden_size), requires_grad=False)

    def embed_codec(self, ids: torch.Tensor) -> torch.Tensor:
        """Codec ids [n] -> talker embeddings [n, H] (what `build_prompt` calls)."""
        return self.codec_embedding(ids)

    def tts(self) -> dict[str, torch.Tensor]:
        """Projected tts_bos / tts_eos / tts_pad rows: name -> [H]."""
        rows = self.text_projection(self.tts_rows)
        return dict(zip(("tts_bos", "tts_eos", "tts_pad"), rows))

    @torch.no_grad()
    def run_batch(self, walk: str, node: str, inputs: Sequence[Mapping[str, torch.Tensor]],
                  options: Sequence[Mapping[str, Any]]) -> list[dict[str, torch.Tensor]]:
        tts = self.tts()
        return [self._prompt(x, o, tts) if "frame_index" not in x else self._step(x, tts)
                for x, o in zip(inputs, options)]

    def _prompt(self, x: Mapping[str, torch.Tensor], opts: Mapping[str, Any],
                tts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ids = x["prompt_ids"].reshape(-1)
        states = x.get("thinker_states")
        n = ids.shape[0]
        if states is None or states.shape[1] < n:
            raise ValueError(f"talker_input needs the thinker states of all {n} prompt tokens, got "
                             f"{None if states is None else tuple(states.shape)}")
        embeds, hidden = states[0].to(tts["tts_pad"].dtype), states[1].to(tts["tts_pad"].dtype)
        first = embeds[n:n + 1]
        ended = first.shape[0] == 0  # the thinker stopped at its first token: nothing more to say
        if ended:  # the first text row is then tts_eos (as a raw row, unprojected: project its source)
            first = self.tts_rows[1:2].to(embeds.dtype)
        voice = str(opts.get("voice") or "Ethan")
        prompt = build_prompt(self, ids, embeds[:n], hidden[:n], first, tts, voice, self.token_ids)
        m = prompt.embeds.shape[0]
        return {"talker_ids": torch.full((m,), self.config.codec_ids["pad"], dtype=torch.long, device=ids.device),
                "talker_embeds": prompt.embeds, "talker_pos": x["talker_positions"],
                "frame_index": torch.zeros((), dtype=torch.long, device=ids.device),
                "text_ended": torch.tensor(ended, device=ids.device)}

    def _step(self, x: Mapping[str, torch.Tensor], tts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        states = x.get("thinker_states")
        ended = x["text_ended"]
        if states is not None and states.shape[1] > 0:
            text = self.text_projection(states[0, -1].to(tts["tts_pad"].dtype))
        else:  # the thinker's text is over: tts_eos once, then tts_pad
            text = torch.where(ended, tts["tts_pad"], tts["tts_eos"])
            ended = torch.ones_like(ended)
        frame = x["frame_index"] + 1
        position = x["talker_positions"].max() + frame  # where the engine continues anyway (no host sync)
        return {"talker_ids": x["first_code"].reshape(1), "talker_embeds": (x["codec_embed_sum"] + text)[None],
                "talker_pos": position.reshape(1, 1).expand(3, 1), "frame_index": frame, "text_ended": ended}


class CodecTalker(MoEGraphCapture, nn.Module):
    """A `Qwen3OmniTalker` for the autoregressive engine whose logits exclude the codec control ids
    (the top `SUPPRESSED_SPECIALS` of the vocabulary) except EOS."""

    accepts_extras = True
    multirow_positions = True

    def __init__(self, talker: Qwen3OmniTalker) -> None:
        super().__init__()
        self.talker = talker
        self.kv_layout = talker.kv_layout
        self.hidden_size = talker.hidden_size
        self.graph_hidden_layers = talker.graph_hidden_layers
        vocab = talker.config.text.vocab_size
        mask = torch.zeros(vocab, dtype=torch.bool, device=talker.codec_head.weight.device)
        mask[max(0, vocab - SUPPRESSED_SPECIALS):] = True
        mask[talker.config.codec_ids["eos"]] = False
        self.register_buffer("suppressed", mask, persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Any, extras: Any = None) -> torch.Tensor:
        return self.talker(input_ids, positions, attn, extras)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> float32 codec logits [N, vocab], control ids at -inf."""
        return self.talker.compute_logits(hidden).masked_fill(self.suppressed, float("-inf"))


class FrameCodePredictor(CodePredictor):
    """The `code_predictor` component of the served model: a frame per talker code, none for EOS
    (the reference never decodes the EOS step; its codes are outside the codebooks)."""

    codec_eos: int = -1

    @torch.no_grad()
    def run_batch(self, walk: str, node: str, inputs: Sequence[Mapping[str, torch.Tensor]],
                  options: Sequence[Mapping[str, Any]]) -> list[dict[str, torch.Tensor]]:
        # the talker returns its final states of every token of the step: the last one made the code
        inputs = [{**x, "talker_hidden": x["talker_hidden"].reshape(-1, self.cfg.hidden_size)[-1]} for x in inputs]
        # one host read per batch, before the launch: it waits for the first codes' copy only, not for
        # the prediction, so the next component's host work overlaps the predictor's GPU work
        firsts = torch.cat([x["first_code"].reshape(1) for x in inputs]).tolist()
        outputs = super().run_batch(walk, node, inputs, options)
        return [{} if first == self.codec_eos else out for first, out in zip(firsts, outputs)]

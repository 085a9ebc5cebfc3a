"""Qwen3-Omni's talker backbone as a `CausalLM`, and the embeddings the talker lane feeds it.

The talker is a Qwen3-MoE decoder (every layer sparse, with a gated shared expert) over codec
tokens whose inputs are embeddings, never ids: the prompt mixes projected thinker states with
codec embeddings, and each decode step feeds the sum of the previous frame's codec embeddings
(first codebook from `embed_codec`, the others from the code predictor) plus the projection of the
next thinker text token (or tts_pad once the text has run out). `codec_head` gives the logits of
the next frame's first codebook. The pure functions below build those embeddings as the
reference's `Qwen3OmniMoeForConditionalGeneration.generate` does, one request at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mstar.engines.base import CausalLMBase, KVLayout
from mstar.engines.extras import FINAL, ForwardExtras
from mstar.layers.decoder import run_layers
from mstar.layers.moe import MoEGraphCapture
from mstar.layers.norm import RMSNorm
from mstar.models.common.meta import build_on_meta
from mstar.models.qwen3_omni.config import TalkerConfig
from mstar.models.qwen3_omni.decoder import empty_fp8_layers, moe_decoder_layer
from mstar.models.qwen3_omni.mrope import MRotaryEmbedding


class ResizeMLP(nn.Module):
    """fc2(silu(fc1(x))): thinker width -> talker width (`text_projection`, `hidden_projection`)."""

    def __init__(self, in_size: int, mid_size: int, out_size: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(in_size, mid_size)
        self.linear_fc2 = nn.Linear(mid_size, out_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class TalkerBody(nn.Module):
    """Decoder layers, final norm and codec embedding (the `talker.model.` prefix of the checkpoint)."""

    def __init__(self, config: TalkerConfig) -> None:
        super().__init__()
        text = config.text
        # the reference makes every talker layer sparse, whatever decoder_sparse_step says
        self.layers = nn.ModuleList(moe_decoder_layer(text, i, sparse=True) for i in range(text.num_layers))
        self.norm = RMSNorm(text.hidden_size, text.rms_norm_eps)
        self.codec_embedding = nn.Embedding(text.vocab_size, text.hidden_size)


class Qwen3OmniTalker(MoEGraphCapture, CausalLMBase, nn.Module):
    """`forward` -> final hidden [T, H] (items bring `input_embeds`); `compute_logits` -> codec logits."""

    accepts_extras = True
    multirow_positions = True

    def __init__(self, config: TalkerConfig) -> None:
        super().__init__()
        self.config = config
        text = config.text
        self.kv_layout = KVLayout(text.num_layers, text.num_kv_heads, text.head_dim, text.dtype)
        self.model = TalkerBody(config)
        self.rotary = MRotaryEmbedding(text.rope)
        self.codec_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.text_projection = ResizeMLP(config.thinker_hidden_size, text.intermediate_size, text.hidden_size)
        self.hidden_projection = ResizeMLP(config.thinker_hidden_size, text.intermediate_size, text.hidden_size)
        self.hidden_size = text.hidden_size
        self.logit_width = text.vocab_size
        self.graph_hidden_layers = (FINAL,)  # the code predictor reads each step's final state

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Any,
                extras: ForwardExtras | None = None) -> torch.Tensor:
        """input_ids [T] (codec ids; rows with input_embeds ignore them), positions [T] or [3, T] -> [T, H]."""
        cos, sin = self.rotary(positions)
        extras = extras or ForwardExtras()
        x = extras.embed(self.model.codec_embedding, input_ids)
        extras.record(0, x)
        # FINAL, the last token's state, is the code predictor's first input
        out = run_layers(self.model.layers, self.model.norm, x, cos, sin, attn, *extras.layer_outputs())
        extras.record(FINAL, out)
        return out

    def compute_logits(self, hidden: torch.Tensor, input_ids: torch.Tensor | None = None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, H] -> float32 codec logits [N, vocab] (the head does not depend on `input_ids`; `out`
        unused)."""
        return self.codec_head(hidden).float()

    def embed_codec(self, ids: torch.Tensor) -> torch.Tensor:
        """Codec ids [n] -> embeddings [n, H] (first codebook and the codec special tokens)."""
        return self.model.codec_embedding(ids)


@dataclass
class TalkerPrompt:
    """What the talker lane submits first, and the text rows it feeds during decoding."""

    embeds: torch.Tensor  # [m, H]: the prefill's input_embeds
    rope_ids: torch.Tensor  # [m]: the ids whose layout gives the prefill's M-RoPE positions
    trailing_text: torch.Tensor  # [k, H]: text rows for decode steps 0..k-1 (tts_pad afterwards)


def tts_embeds(talker: Qwen3OmniTalker, thinker_embed: nn.Embedding, token_ids: dict[str, int]) -> dict[str, torch.Tensor]:
    """The projected thinker embeddings of tts_bos, tts_eos and tts_pad: name -> [H]."""
    names = ("tts_bos", "tts_eos", "tts_pad")
    ids = torch.tensor([token_ids[n] for n in names], device=thinker_embed.weight.device)
    rows = talker.text_projection(thinker_embed(ids))
    return dict(zip(names, rows))


def user_part(talker: Qwen3OmniTalker, thinker_embeds: torch.Tensor, thinker_hidden: torch.Tensor,
              multimodal: torch.Tensor) -> torch.Tensor:
    """Talker rows of user-turn tokens: hidden_projection of the thinker's `accept_hidden_layer`
    states at media placeholders, text_projection of the thinker's input embeddings elsewhere."""
    out = talker.text_projection(thinker_embeds)
    if bool(multimodal.any()):
        out[multimodal] = talker.hidden_projection(thinker_hidden[multimodal]).to(out.dtype)
    return out


def build_prompt(talker: Qwen3OmniTalker, prompt_ids: torch.Tensor, thinker_embeds: torch.Tensor,
                 thinker_hidden: torch.Tensor, generated_embeds: torch.Tensor, tts: dict[str, torch.Tensor],
                 speaker: str, token_ids: dict[str, int]) -> TalkerPrompt:
    """The talker's prefill for one request, as the reference's generate builds it.

    prompt_ids [n] and the thinker's input embeddings / `accept_hidden_layer` states of the prompt
    ([n, Ht] each); `generated_embeds` [g, Ht]: thinker input embeddings of the generated text
    tokens (at least the first; the later ones feed `trailing_text`, ending with tts_eos).
    """
    cfg = talker.config
    speaker_id = cfg.speakers.get(speaker.lower())
    if speaker_id is None:
        raise ValueError(f"unknown speaker {speaker!r}; this checkpoint has {sorted(cfg.speakers)}")
    user = _user_mask(prompt_ids, token_ids)
    media = _media_mask(prompt_ids, cfg)
    user_rows = user_part(talker, thinker_embeds[user], thinker_hidden[user], media[user])
    assistant = _assistant_start(prompt_ids, token_ids)
    head = talker.text_projection(torch.cat([thinker_embeds[assistant:], generated_embeds[:1]]))  # "<im_start>assistant\n" + 1st
    if head.shape[0] != 4:
        raise ValueError(f"the assistant turn must end the prompt with 3 tokens (<|im_start|>assistant\\n), "
                         f"got {head.shape[0] - 1}")
    text = torch.cat([head[:3], tts["tts_pad"].expand(4, -1), tts["tts_bos"][None], head[3:4]])
    codec_ids = [cfg.codec_ids[k] for k in ("nothink", "think_bos", "think_eos")] + [speaker_id]
    codec_ids += [cfg.codec_ids["pad"], cfg.codec_ids["bos"]]
    codec = talker.embed_codec(torch.tensor(codec_ids, device=text.device))
    codec = torch.cat([codec.new_zeros(3, codec.shape[1]), codec])
    trailing = torch.cat([talker.text_projection(generated_embeds[1:]), tts["tts_eos"][None]])
    rope_ids = torch.cat([prompt_ids[user], torch.full((9,), token_ids["tts_pad"], device=prompt_ids.device)])
    return TalkerPrompt(torch.cat([user_rows, text + codec]), rope_ids, trailing)


def step_embeds(codec_embeds: torch.Tensor, step: int, trailing_text: torch.Tensor,
                tts_pad: torch.Tensor) -> torch.Tensor:
    """Input embedding [1, H] of decode step `step` (0-based after the prefill).

    `codec_embeds` [num_code_groups, H]: the previous frame's codebook embeddings (talker
    codec_embedding for the first, the code predictor's tables for the others).
    """
    text = trailing_text[step] if step < trailing_text.shape[0] else tts_pad
    return (codec_embeds.sum(0) + text)[None]


def _user_mask(ids: torch.Tensor, token_ids: dict[str, int]) -> torch.Tensor:
    # role of a token = the token after the latest <|im_start|> at or before it
    n = ids.shape[0]
    index = torch.arange(n, device=ids.device)
    starts = torch.where(ids == token_ids["im_start"], index, torch.full_like(index, -1))
    latest = torch.cummax(starts, dim=0).values.clamp_min(0)
    return ids[(latest + 1).clamp_max(n - 1)] == token_ids["user"]


def _media_mask(ids: torch.Tensor, cfg: TalkerConfig) -> torch.Tensor:
    t = cfg.tokens
    return (ids == t.audio_token_id) | (ids == t.image_token_id) | (ids == t.video_token_id)


def _assistant_start(ids: torch.Tensor, token_ids: dict[str, int]) -> int:
    hits = torch.nonzero((ids[:-1] == token_ids["im_start"]) & (ids[1:] == token_ids["assistant"])).flatten()
    if hits.numel() == 0:
        raise ValueError("the prompt has no '<|im_start|>assistant' turn; apply the chat template with "
                         "add_generation_prompt=True")
    return int(hits[-1])


def build_talker(config: TalkerConfig, dtype: torch.dtype | None = None,
                 device: str | torch.device = "cpu", quantization: str | None = None) -> Qwen3OmniTalker:
    """A talker in `dtype` (the config's by default) on `device` with UNINITIALISED weights; load next. With
    `quantization`, the decoder layers' linears and routed experts are FP8 (`decoder.empty_fp8_layers`),
    quantized as they load; the thinker-side projections and the codec head stay."""
    dtype = dtype or config.text.dtype

    def make() -> Qwen3OmniTalker:
        model = Qwen3OmniTalker(config)
        if quantization is not None:
            empty_fp8_layers(model.model.layers, quantization)
        return model

    model = build_on_meta(make, dtype, device)
    assert isinstance(model, Qwen3OmniTalker)
    t = config.text
    model.kv_layout = KVLayout(t.num_layers, t.num_kv_heads, t.head_dim, dtype)
    return model

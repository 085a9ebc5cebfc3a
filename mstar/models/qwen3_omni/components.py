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

from mstar.engines.base import CausalLMBase, StatelessBase
from mstar.engines.cuda_graphs import to_device_async
from mstar.layers.moe import MoEGraphCapture
from mstar.models.common.derived import derived
from mstar.models.qwen3_omni.code_predictor import CodePredictor
from mstar.models.qwen3_omni.config import TalkerConfig
from mstar.models.qwen3_omni.talker import Qwen3OmniTalker, ResizeMLP, build_prompt

logger = logging.getLogger(__name__)

SUPPRESSED_SPECIALS = 1024  # the top ids of the talker's codec vocabulary are control tokens


class TalkerInput(StatelessBase, nn.Module):
    """The stateless `talker_input` component (one call per talker step, see the module doc).

    Inputs per request: `thinker_states` [2, r, Ht] (rows: the thinker's input embeddings and its
    `accept_hidden_layer` states; absent once the thinker's stream has ended), `prompt_ids` [n],
    `talker_positions` [3, m] (the talker prompt's M-RoPE positions), and the loop-back edges
    `frame_index`, `first_code`, `codec_embed_sum`, `text_ended`, `talker_pos` (absent on iteration 0).
    Outputs: `talker_ids`, `talker_embeds`, `talker_pos` (what the talker step submits),
    `frame_index` (this step's), `text_ended`.

    Per frame nothing is read back from the device (`host_inputs`): the talker's first code arrives on
    the host and its ids go out as it came, and the step's position, frame index and text-ended flag
    are host tensors carried from the previous iteration; only the embedding row is device work. So
    the talker's submit reads its ids and positions without waiting for the GPU. Iteration 0 reads
    the prompt on the host once (building the prompt reads it anyway).
    """

    host_inputs = True

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
        """Projected tts_bos / tts_eos / tts_pad rows: name -> [H]. Computed once per state of the
        weights it reads (their in-place version counters), not on every talker step."""
        return derived(self, "tts", (self.tts_rows, *self.text_projection.parameters()),
                       lambda: dict(zip(("tts_bos", "tts_eos", "tts_pad"), self.text_projection(self.tts_rows))))

    @torch.no_grad()
    def run_batch(self, walk: str, node: str, inputs: Sequence[Mapping[str, torch.Tensor]],
                  options: Sequence[Mapping[str, Any]]) -> list[dict[str, torch.Tensor]]:
        tts = self.tts()
        steps = [i for i, x in enumerate(inputs) if "frame_index" in x]
        texts = self._step_texts([inputs[i] for i in steps], tts)
        outputs: list[dict[str, torch.Tensor]] = [{} for _ in inputs]
        if steps:  # every step's embedding row (codec sum + text) in one add, not one per request
            sums = torch.stack([self._on_device(inputs[i]["codec_embed_sum"]) for i in steps])
            embeds = sums + torch.stack(texts)
            for row, i in enumerate(steps):
                outputs[i] = self._step(inputs[i], embeds[row : row + 1])
        for i, (x, o) in enumerate(zip(inputs, options)):
            if "frame_index" not in x:
                outputs[i] = self._prompt(x, o, tts)
        return outputs

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        device = self.tts_rows.device
        return t if t.device == device else to_device_async(t, device)

    def _prompt(self, x: Mapping[str, torch.Tensor], opts: Mapping[str, Any],
                tts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ids = self._on_device(x["prompt_ids"].reshape(-1))
        states = x.get("thinker_states")
        n = ids.shape[0]
        if states is None or states.shape[1] < n:
            raise ValueError(f"talker_input needs the thinker states of all {n} prompt tokens, got "
                             f"{None if states is None else tuple(states.shape)}")
        states = self._on_device(states)
        embeds, hidden = states[0].to(tts["tts_pad"].dtype), states[1].to(tts["tts_pad"].dtype)
        first = embeds[n:n + 1]
        ended = first.shape[0] == 0  # the thinker stopped at its first token: nothing more to say
        if ended:  # the first text row is then tts_eos (as a raw row, unprojected: project its source)
            first = self.tts_rows[1:2].to(embeds.dtype)
        voice = str(opts.get("voice") or "Ethan")
        prompt = build_prompt(self, ids, embeds[:n], hidden[:n], first, tts, voice, self.token_ids)
        m = prompt.embeds.shape[0]
        return {"talker_ids": torch.full((m,), self.config.codec_ids["pad"], dtype=torch.long),
                "talker_embeds": prompt.embeds, "talker_pos": x["talker_positions"].cpu(),  # once per request
                "frame_index": torch.zeros((), dtype=torch.long), "text_ended": torch.tensor(ended)}

    def _step_texts(self, inputs: Sequence[Mapping[str, torch.Tensor]], tts: dict[str, torch.Tensor]
                    ) -> list[torch.Tensor]:
        """Each step's text row [H]: the projection of the next thinker token's embedding (all of the
        batch's in one projection), else tts_eos once the thinker's text is over, then tts_pad."""
        texts: list[torch.Tensor | None] = [None] * len(inputs)
        rows, fed = [], []
        for i, x in enumerate(inputs):
            states = x.get("thinker_states")
            if states is not None and states.shape[1] > 0:
                rows.append(self._on_device(states[0, -1]))
                fed.append(i)
            else:
                texts[i] = tts["tts_pad"] if bool(x["text_ended"]) else tts["tts_eos"]
        if rows:
            projected = self.text_projection(torch.stack(rows).to(tts["tts_pad"].dtype))
            for row, i in enumerate(fed):
                texts[i] = projected[row]
        return texts  # type: ignore[return-value]

    def _step(self, x: Mapping[str, torch.Tensor], embeds: torch.Tensor) -> dict[str, torch.Tensor]:
        states = x.get("thinker_states")
        ended = x["text_ended"] if states is not None and states.shape[1] > 0 else torch.tensor(True)
        # the previous step's position (the prompt's, at the first step) plus one: where the engine
        # continues anyway (kept on the host, so the talker reads it without a sync)
        last = x["talker_pos"] if "talker_pos" in x else x["talker_positions"] + int(x["frame_index"])
        position = int(last.max()) + 1
        return {"talker_ids": x["first_code"].reshape(1), "talker_embeds": embeds,
                "talker_pos": torch.full((3, 1), position, dtype=torch.long),
                "frame_index": x["frame_index"] + 1, "text_ended": ended}


class CodecTalker(MoEGraphCapture, CausalLMBase, nn.Module):
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
        vocab = self.logit_width = talker.config.text.vocab_size
        mask = torch.zeros(vocab, dtype=torch.bool, device=talker.codec_head.weight.device)
        mask[max(0, vocab - SUPPRESSED_SPECIALS):] = True
        mask[talker.config.codec_ids["eos"]] = False
        self.register_buffer("suppressed", mask, persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: Any, extras: Any = None) -> torch.Tensor:
        return self.talker(input_ids, positions, attn, extras)

    def compute_logits(self, hidden: torch.Tensor, input_ids: torch.Tensor | None = None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, H] -> float32 codec logits [N, vocab], control ids at -inf (`input_ids`, `out` unused)."""
        return self.talker.compute_logits(hidden).masked_fill(self.suppressed, float("-inf"))


class FrameCodePredictor(CodePredictor):
    """The `code_predictor` component of the served model: a frame per talker code, none for EOS
    (the reference never decodes the EOS step; its codes are outside the codebooks); a talk that goes on
    past EOS (talker.ignore_eos) is fed the EOS code's embedding next.

    Inputs stay as they came (`host_inputs`): the first codes (the talker's sampled ids) and frame
    indexes are host tensors, read there for free; the batch's first codes reach the device in one
    pinned copy, and the talker's states are on the device already.
    """

    host_inputs = True
    codec_eos: int = -1

    @torch.no_grad()
    def run_batch(self, walk: str, node: str, inputs: Sequence[Mapping[str, torch.Tensor]],
                  options: Sequence[Mapping[str, Any]]) -> list[dict[str, torch.Tensor]]:
        # the talker returns its final states of every token of the step: the last one made the code
        inputs = [{**x, "talker_hidden": x["talker_hidden"].reshape(-1, self.cfg.hidden_size)[-1]} for x in inputs]
        # a host read of host tensors: no sync (device ones, when a caller passes them, cost one per batch)
        firsts = torch.cat([x["first_code"].reshape(1) for x in inputs]).tolist()
        outputs = super().run_batch(walk, node, inputs, options)
        if self.codec_eos not in firsts:
            return outputs
        # An EOS step has no frame. Its talker sequence ends there, unless the request keeps it going
        # (talker.ignore_eos): the next step's input is then the EOS code's embedding alone (what the
        # frame's running sum holds before any residual code), as a text LM is fed back its EOS token.
        eos_sum = self.talker_codec_embedding.weight[self.codec_eos]
        return [{"codec_embed_sum": eos_sum} if first == self.codec_eos else out for first, out in zip(firsts, outputs)]

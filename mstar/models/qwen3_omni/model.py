"""Qwen3-Omni as a served model: three lanes joined by two streams.

Lane `thinker`:  prefill | prefill_media -> decode
  prefill   a text prompt through the thinker MoE once; the first token goes to the client
            ("text") and is carried on. A text-only request never touches the encoders.
  prefill_media  (a prompt with audio, images or video; the processor sets option "media")
            audio_encoder -> vision_encoder -> thinker: each encoder places its rows into the
            prompt's multimodal rows (`mm_embeds`, `deepstack_embeds`; a request without media of
            its kind passes through), then the thinker prefill takes them at the placeholder
            tokens (`mm_mask`) with 3-row M-RoPE `positions`; it emits like `prefill`.
  decode    Loop over the thinker fed its last token, stopped by eos or thinker.max_tokens.
  When the request asks for audio, every thinker step also returns `thinker_states`
  [2, tokens, Ht]: the input embeddings and the `accept_hidden_layer` states of the tokens it
  took (the prompt, then each fed token). They stream to the talker.
Lane `talker` (only when "audio" is in the request's modalities):
  talk      Loop of talker_input -> talker -> code_predictor. Its first iteration takes the
            prompt's states joined with the first fed token's (Fixed(1, first=2)) and prefills the
            talker with the reference's prompt; each later one takes the next text token (tts_eos,
            then tts_pad once the thinker is done: the talker keeps speaking after it) plus the
            previous frame's `codec_embed_sum`. Stopped by codec EOS or after talker.max_tokens - 1
            frames (as many as transformers' generate speaks for talker_max_new_tokens). Every
            frame's `codes` [1, G] streams to Code2Wav.
Lane `code2wav` (audio only):
  vocode    Code2Wav over the codes stream in LeftContext(chunk, context) chunks, seamless trim;
            emits "audio" (24 kHz float32).
Per-request options: plain sampling keys and thinker.* go to the thinker (`structured_outputs` too: the thinker's
engine masks its text to the grammar; `logprobs` too: the text tokens' come with "text", spoken or not, while
talker.logprobs is refused: codec codes are no text), talker.* to the talker,
code_predictor.* to the code predictor (defaults are the checkpoint's), `voice` (Ethan, Chelsie,
Aiden), `modalities`, `use_audio_in_video` (default true: a video's sound track is heard, as the
reference's switch does; `media_inputs`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from mstar.engines.sampling import SAMPLING_OPTIONS
from mstar.graph import (
    CARRY,
    ComponentSpec,
    Emit,
    Fixed,
    Lane,
    LeftContext,
    Loop,
    ModelGraph,
    Node,
    Sequential,
    StreamEdge,
    Walk,
)
from mstar.models.base import BuiltComponent, Model
from mstar.models.common.serve_config import LMServeConfig
from mstar.models.llama.processor import LOGPROB_OUTPUTS, TEXT_OPTIONS
from mstar.models.qwen3_omni import options as omni_options

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class OmniServeConfig(LMServeConfig):
    """Serving options of Qwen3-Omni (YAML `model_kwargs`); the architecture comes from config.json."""

    max_model_len: int | None = None  # thinker context (prompt + text); None: 32768 (tiny: 2048, see context)
    talker_max_model_len: int = 8192  # talker context (prompt + frames)
    code2wav_chunk: int = 25  # frames of new audio per Code2Wav step (25 = 2 s)
    code2wav_left_context: int = 25  # earlier frames each chunk sees (see code2wav.py on exactness)
    # pad shorter chunks to chunk + left_context frames: one shape, replayed from CUDA graphs (code2wav.py);
    # None: on where Code2Wav runs on CUDA
    code2wav_pad: bool | None = None
    video_fps: float = 2.0  # frames a second sampled from input videos
    # with the thinker tensor-parallel (tp_size > 1): split its attention heads over the ranks too (one
    # more all-reduce a layer, half the attention weights and KV read per rank); False: every rank runs
    # whole attention with a whole KV cache and only the experts are split
    thinker_tp_attention: bool = True

    @property
    def context(self) -> int:
        """The thinker's context, the default bound on a text answer (prompt + max_tokens). The tiny flavour's
        random weights never sample eos, so its smaller default ends a default request in seconds."""
        return self.max_model_len or (2048 if self.tiny else 32768)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.code2wav_chunk < 1 or self.code2wav_left_context < 0:
            raise ValueError(f"code2wav_chunk={self.code2wav_chunk} must be >= 1 and code2wav_left_context="
                             f"{self.code2wav_left_context} >= 0")


def speaks(options: Any) -> bool:
    """Whether a request wants audio out (wakes the talker and Code2Wav lanes)."""
    return "audio" in (options.get("modalities") or ())


def omni_graph(cfg: OmniServeConfig) -> ModelGraph:
    """The graph of the module doc; never depends on placement."""
    def thinker_steps(options: Any) -> int:
        return max(int(options["thinker.max_tokens"]) - 1, 0)

    def talker_steps(options: Any) -> int:
        # the reference's talker.generate(max_new_tokens=N) samples N codes but runs the code predictor, which
        # completes a frame, in the step after each one: its last code never becomes a frame
        return max(int(options["talker.max_tokens"]) - 1, 0)

    def thinker_first(options: Any) -> str:
        return "prefill_media" if options.get(omni_options.MEDIA_OPTION) else "prefill"

    thinker_in = {"input_ids": "prompt_ids", "input_embeds": "mm_embeds", "embeds_mask": "mm_mask",
                  "positions": "positions", "deepstack_embeds": "deepstack_embeds"}
    # the text token, its logprobs when asked (option logprobs), the talker's states when speaking
    thinker_out = {"token": "token", **{name: name for name in LOGPROB_OUTPUTS}, "hidden": "thinker_states"}
    prefill = Node("thinker", inputs=thinker_in, outputs=thinker_out)
    decode = Node("thinker", inputs={"input_ids": "token", "prompt_ids": "prompt_ids"}, outputs=thinker_out)
    talker_input = Node("talker_input", inputs=("thinker_states", "prompt_ids", "talker_positions", "frame_index",
                                                "first_code", "codec_embed_sum", "text_ended", "talker_pos"),
                        outputs=("talker_ids", "talker_embeds", "talker_pos", "frame_index", "text_ended"))
    talker = Node("talker", inputs={"input_ids": "talker_ids", "input_embeds": "talker_embeds",
                                    "positions": "talker_pos"},
                  outputs={"token": "first_code", "hidden": "talker_hidden"})
    predictor = Node("code_predictor", inputs=("talker_hidden", "first_code", "frame_index"),
                     outputs=("codes", "codec_embed_sum"))
    media = ("mm_embeds", "mm_mask", "positions", "deepstack_embeds")
    placed = ("mm_embeds", "deepstack_embeds")
    audio = Node("audio_encoder", inputs=("audio_features", "audio_lengths", "mm_kinds"), outputs=placed)
    vision = Node("vision_encoder", inputs=("pixel_values", "vision_grid_thw", "mm_kinds") + placed, outputs=placed)
    logprobs = tuple(Emit(name, name=name) for name in LOGPROB_OUTPUTS)
    first_emits = (Emit("token", name="text"), *logprobs, Emit("token", CARRY))
    return ModelGraph(
        components={
            "thinker": ComponentSpec("autoregressive", "text + media rows -> next text token (MoE, M-RoPE)",
                                     option_namespace="thinker", tensor_parallel=True),
            "audio_encoder": ComponentSpec("stateless", "log-mel frames -> thinker-width audio rows"),
            "vision_encoder": ComponentSpec("stateless", "image / video patches -> visual rows + deepstack"),
            "talker_input": ComponentSpec("stateless", "thinker states + last frame -> the talker's input rows"),
            "talker": ComponentSpec("autoregressive", "input rows -> first codec code of the next frame",
                                    option_namespace="talker"),
            "code_predictor": ComponentSpec("stateless", "talker state + first code -> the frame's codes"),
            "code2wav": ComponentSpec("stateless", "codec frames -> 24 kHz audio"),
        },
        walks=(
            Walk("prefill", "thinker", prefill, inputs=("prompt_ids",), optional_inputs=media, emits=first_emits),
            Walk("prefill_media", "thinker", Sequential(audio, vision, prefill),
                 inputs=("prompt_ids", "mm_mask", "mm_kinds", "positions"),
                 optional_inputs=("audio_features", "audio_lengths", "pixel_values", "vision_grid_thw"),
                 emits=first_emits),
            Walk("decode", "thinker", Loop(decode, max_iterations=thinker_steps, name="decode"),
                 inputs=("token", "prompt_ids"), emits=(Emit("token", name="text"), *logprobs)),
            Walk("talk", "talker", Loop(Sequential(talker_input, talker, predictor), max_iterations=talker_steps,
                                        name="speak"),
                 inputs=("prompt_ids", "talker_positions", "thinker_states"),
                 optional_inputs=("frame_index", "first_code", "codec_embed_sum", "text_ended",  # loop-backs
                                  "talker_pos")),
            Walk("vocode", "code2wav", Node("code2wav", inputs=("codes",), outputs=("audio",)),
                 inputs=("codes",), emits=(Emit("audio"),)),
        ),
        lanes=(
            Lane("thinker", thinker_first, {"prefill": "decode", "prefill_media": "decode", "decode": None}),
            Lane("talker", lambda o: "talk" if speaks(o) else None),
            Lane("code2wav", lambda o: "vocode" if speaks(o) else None),
        ),
        streams=(
            StreamEdge("thinker_states", "thinker", "talk", "thinker_states", Fixed(1, first=2), dim=1),
            StreamEdge("codes", "talker", "vocode", "codes", LeftContext(cfg.code2wav_chunk, cfg.code2wav_left_context)),
        ),
    )


class Qwen3Omni(Model):
    """Qwen/Qwen3-Omni-30B-A3B-Instruct (Hugging Face layout): text, images, audio and video in; text and
    speech out."""

    name = "qwen3_omni"
    input_modalities = ("text", "image", "audio", "video")
    output_modalities = ("text", "audio")
    context_component = "thinker"
    voices = ("Aiden", "Chelsie", "Ethan")  # the talker's speakers in the released checkpoint's config.json
    default_options = {"modalities": ["text"], "voice": "Ethan", "use_audio_in_video": True}
    # plain sampling keys are the thinker's; `speed` and `instructions` are taken to be refused with a reason
    extra_options = (SAMPLING_OPTIONS | TEXT_OPTIONS | omni_options.NAMESPACED_OPTIONS
                     | {"speed", "instructions"})

    config_class = OmniServeConfig
    # the decoder layers' linears and routed experts in FP8, routers excepted (decoder.empty_fp8_layers)
    quantizable = ("thinker", "talker")

    def graph(self) -> ModelGraph:
        return omni_graph(self.config)

    @cached_property
    def checkpoint(self):
        """Where configs, weights and the tokenizer come from (see `checkpoint.py`)."""
        from mstar.models.qwen3_omni.checkpoint import OmniCheckpoint

        return OmniCheckpoint.open(self.config, self.model_path, self.load_format)

    def build_component(self, name: str, device: torch.device) -> BuiltComponent:
        from mstar.models.qwen3_omni.builders import build_component

        return build_component(self.checkpoint, self.config, name, device, self.engine_spec, self.quantization)

    def processor(self):
        from mstar.models.qwen3_omni.processor import OmniProcessor

        ckpt = self.checkpoint
        return OmniProcessor(ckpt.tokenizer, ckpt.omni, self.config.context, ckpt.media_spec(self.config.video_fps),
                             ckpt.grammars)

    def request_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """Checkpoint defaults, then the request's options (plain sampling keys belong to the thinker)."""
        ckpt = self.checkpoint
        accept = ckpt.omni.talker.accept_hidden_layer if ckpt.omni.talker else None
        return omni_options.resolve({**ckpt.option_defaults, **self.default_options}, options, accept)

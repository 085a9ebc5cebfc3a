"""Orpheus TTS: a Llama LM speaks SNAC audio tokens; the SNAC decoder turns them into 24 kHz audio.

Lane `lm`:       prefill -> decode
  prefill   the prompt (voice and text, see tokens.py) goes through `llm` once; its token starts
            the audio-token stream and is carried to decode.
  decode    Loop over `llm` fed its own last token, up to max_tokens - 1 times, stopped by the
            end-of-speech token (the engine's only eos).
Lane `vocoder`:  vocode
  vocode    `snac` reads the lm lane's tokens through a StreamEdge: tokens that are no audio code
            at their frame place are dropped (tokens.accept_audio_token), the rest is cut in windows
            of 28 tokens (4 frames) advancing by 7 (one frame), recut once at the end; each window
            emits the audio of the frames it owns (vocoder.py), so the client hears speech while
            the LM still talks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import cached_property, partial
from pathlib import Path

import torch

from mstar.engines.base import AutoregressiveSpec, StatelessSpec
from mstar.engines.sampling import SAMPLING_OPTIONS
from mstar.graph import (
    CARRY,
    ComponentSpec,
    Emit,
    Lane,
    Loop,
    ModelGraph,
    Node,
    SlidingWindow,
    StreamEdge,
    Walk,
)
from mstar.models.base import BuiltComponent, Model
from mstar.models.common.serve_config import LMServeConfig, capped_context, decode_steps
from mstar.models.orpheus.processor import OrpheusProcessor
from mstar.models.orpheus.tokens import (
    DEFAULT_VOICE,
    FRAME,
    LLAMA3_VOCAB,
    VOICES,
    OrpheusTokens,
    accept_audio_token,
)

logger = logging.getLogger(__name__)

WINDOW_TOKENS, STRIDE_TOKENS = 4 * FRAME, FRAME
EARLY_WINDOW_TOKENS = 2 * FRAME  # vocoder.EARLY_FRAMES; the first audio after 2 frames, not 4 (vocoder.py: it emits frame 0)


@dataclass(frozen=True)
class OrpheusConfig(LMServeConfig):
    """Serving options of Orpheus (YAML `model_kwargs`); the LM architecture comes from config.json, and
    `max_model_len` defaults to its max_position_embeddings (and the KV pool). `dtype` is the LM's: SNAC
    runs in float32."""

    snac_path: str | None = None  # SNAC folder or Hub id; default hubertsiuzdak/snac_24khz
    audio_token_base: int | None = None  # id of <custom_token_0>; default 128256 (Llama-3 vocabulary)
    early_window: bool = True  # first audio from a 2-frame window at 14 tokens; False: after 28, as the original
    # the LM head reads only the end-of-speech and audio-token rows (28,680 of 156,940 at full size); other
    # ids are never sampled; False: the full head, as the original
    audio_logits_only: bool = True
    # with audio_logits_only: each step scores only end of speech and the codes the next frame place can
    # take (4,096 of the 28,680 rows where the kernel serves, tokens.place_windows); False: every audio id,
    # whose out-of-place draws the vocoder drops or skips, as the original's decoder does
    frame_place_logits: bool = True


def orpheus_graph(context_len: int, tokens: OrpheusTokens, early_window: bool = True) -> ModelGraph:
    """The two-lane graph; `context_len` bounds decode for a request without max_tokens."""
    prefill = Node("llm", inputs={"input_ids": "prompt_ids"}, outputs={"token": "token"})
    decode = Node("llm", inputs={"input_ids": "token", "prompt_ids": "prompt_ids"}, outputs={"token": "token"})
    vocode = Node("snac", inputs=("codes",), outputs=("audio",))
    window = SlidingWindow(WINDOW_TOKENS, STRIDE_TOKENS, recut_at_end=True,
                           first=EARLY_WINDOW_TOKENS if early_window else 0)
    return ModelGraph(
        components={
            "llm": ComponentSpec("autoregressive", "text and voice -> audio tokens (paged KV cache)"),
            "snac": ComponentSpec("stateless", "windows of audio tokens -> 24 kHz samples (SNAC decoder)"),
        },
        walks=(
            Walk("prefill", "lm", prefill, inputs=("prompt_ids",), emits=(Emit("token", CARRY),)),
            Walk("decode", "lm", Loop(decode, max_iterations=decode_steps(context_len), name="decode"),
                 inputs=("token", "prompt_ids")),
            Walk("vocode", "vocoder", vocode, inputs=("codes",), emits=(Emit("audio"),)),
        ),
        lanes=(Lane("lm", "prefill", {"prefill": "decode", "decode": None}),
               Lane("vocoder", "vocode", {"vocode": None})),
        streams=(StreamEdge("token", "lm", "vocode", "codes", window,
                            accept=partial(accept_audio_token, tokens)),),
    )


class OrpheusModel(Model):
    """canopylabs/orpheus-3b-0.1-ft (or --model-path) with hubertsiuzdak/snac_24khz."""

    name = "orpheus"
    input_modalities = ("text",)
    output_modalities = ("audio",)
    context_component = "llm"
    quantizable = ("llm",)  # the Llama backbone; the SNAC vocoder stays as it is
    voices = VOICES
    default_options = {"voice": DEFAULT_VOICE, "temperature": 0.6, "top_p": 0.8, "repetition_penalty": 1.3,
                       "max_tokens": 1200}
    # OpenAI's speech `speed` and `instructions` are taken to be refused with a reason (processor)
    extra_options = SAMPLING_OPTIONS | {"speed", "instructions"}

    config_class = OrpheusConfig

    # -- what the checkpoints say ------------------------------------------------------------------

    @property
    def _builtin_lm(self) -> bool:
        """Dummy weights without a checkpoint folder: the built-in Orpheus-3B config and a Llama-3 tokenizer."""
        return self.load_format == "dummy" and not self.model_path and not self.config.tiny

    def checkpoint_path(self) -> Path:
        from mstar.models.common.loading import resolve_checkpoint
        from mstar.models.orpheus.weights import ORPHEUS_REPO

        return resolve_checkpoint(self.model_path or ORPHEUS_REPO)

    @cached_property
    def tokenizer(self):
        from mstar.models.common.text import Tokenizer

        if self.config.tokenizer_path:
            return Tokenizer.from_pretrained(self.config.tokenizer_path)
        if self.config.tiny:
            from mstar.models.llama.tiny import tiny_tokenizer_folder

            return Tokenizer.from_pretrained(tiny_tokenizer_folder())
        if self._builtin_lm:
            from mstar.models.common.tokenizer_build import cached_tokenizer_folder

            return Tokenizer.from_pretrained(cached_tokenizer_folder("llama3"))
        path = self.checkpoint_path()
        return Tokenizer.from_pretrained(path if path.is_dir() else path.parent)

    @cached_property
    def snac_folder(self) -> Path | None:
        """The SNAC checkpoint folder; None for tiny, or dummy weights without a snac_path."""
        if self.config.tiny or (self.load_format == "dummy" and not self.config.snac_path):
            return None
        from mstar.models.orpheus.weights import snac_folder

        return snac_folder(self.config.snac_path)

    @cached_property
    def snac_config(self):
        from mstar.models.orpheus.snac import SnacConfig

        if self.snac_folder is not None:
            from mstar.models.orpheus.weights import read_snac_config

            return read_snac_config(self.snac_folder)
        if self.config.tiny:
            from mstar.models.orpheus.tiny import TINY_SNAC

            return TINY_SNAC
        return SnacConfig()

    @cached_property
    def tokens(self) -> OrpheusTokens:
        tok = self.tokenizer
        default_base = tok.vocab_size if self.config.tiny else LLAMA3_VOCAB
        end_of_text = tok.token_to_id("<|eot_id|>")
        return OrpheusTokens(base=self.config.audio_token_base or default_base,
                             codebook_size=self.snac_config.codebook_size,
                             end_of_text=end_of_text if end_of_text is not None else tok.eos_token_id,
                             bos=tok.bos_token_id)

    @cached_property
    def llama_config(self):
        from mstar.models.llama.config import LlamaConfig

        if self.config.tiny:
            from mstar.models.orpheus.tiny import tiny_lm_hf_config

            cfg = LlamaConfig.from_hf(tiny_lm_hf_config(self.tokens))
        elif self._builtin_lm:
            from mstar.models.orpheus.weights import ORPHEUS_3B_CONFIG

            cfg = LlamaConfig.from_hf(ORPHEUS_3B_CONFIG)
        else:
            from mstar.models.llama.weights import load_config

            cfg = load_config(self.checkpoint_path())
        if cfg.vocab_size < self.tokens.vocab_size - 2:
            raise ValueError(f"the LM vocabulary ({cfg.vocab_size}) ends before the last audio token "
                             f"({self.tokens.vocab_size - 3}); check model_kwargs.audio_token_base and the SNAC "
                             "codebook_size")
        return cfg

    @property
    def max_model_len(self) -> int:
        return capped_context(self.llama_config.max_position_embeddings, self.config.max_model_len)

    # -- the model contract ------------------------------------------------------------------------

    def graph(self) -> ModelGraph:
        return orpheus_graph(self.max_model_len, self.tokens, self.config.early_window)

    def build_component(self, name: str, device: torch.device) -> BuiltComponent:
        if name == "llm":
            return BuiltComponent(self._load_lm(device), AutoregressiveSpec(
                eos_token_ids=(self.tokens.end_of_speech,), max_model_len=self.max_model_len))
        if name == "snac":
            from mstar.models.orpheus.vocoder import OrpheusVocoder
            from mstar.models.orpheus.weights import load_snac

            snac = load_snac(self.snac_config, self.snac_folder, device, seed=self.config.seed)
            vocoder = OrpheusVocoder(snac, self.tokens).to(device)
            # windows decoded together at most; its engine captures the vocoder's graphs up to that batch
            return BuiltComponent(vocoder, self.engine_spec("snac", StatelessSpec(max_batch_size=64)))
        raise KeyError(f"orpheus has no component {name!r}; its components are 'llm' and 'snac'")

    def _load_lm(self, device: torch.device) -> torch.nn.Module:
        from mstar.models.common.loading import fill_dummy_weights
        from mstar.models.llama.model import build_model
        from mstar.models.orpheus.tiny import shape_audio_lm

        dtype = self.config.torch_dtype(device)
        if self.config.tiny or self.load_format == "dummy":
            # Untied head: a bigram-shaped head cannot be the embedding (tiny.py says why).
            module = build_model(replace(self.llama_config, tie_word_embeddings=False), dtype=dtype, device=device,
                                 quantization=self.quantization.get("llm"))
            fill_dummy_weights(module, seed=self.config.seed, std=0.1 if self.config.tiny else 0.02)
            shape_audio_lm(module, self.tokens, seed=self.config.seed, strength=3.0 if self.config.tiny else 50.0)
        else:
            from mstar.models.llama.weights import load_model

            module = load_model(self.checkpoint_path(), dtype=dtype, device=device,
                                quantization=self.quantization.get("llm"))
        if self.config.audio_logits_only:
            from mstar.models.orpheus.head import SpanHeadLM

            windows = self.tokens.place_windows(module.config.vocab_size) if self.config.frame_place_logits else None
            return SpanHeadLM(module, self.tokens.speakable_span, blocked=self.tokens.span_markers, windows=windows)
        return module

    def processor(self) -> OrpheusProcessor:
        return OrpheusProcessor(self.tokenizer, self.tokens, self.max_model_len, self.snac_config.sampling_rate)

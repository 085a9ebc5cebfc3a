"""Building each served component of Qwen3-Omni on a device, with its weights and engine spec."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any

import torch

from mstar.engines.base import AutoregressiveSpec, StatelessSpec
from mstar.models.base import BuiltComponent
from mstar.models.common import loading
from mstar.models.qwen3_omni.checkpoint import OmniCheckpoint
from mstar.models.qwen3_omni.components import CodecTalker, FrameCodePredictor, TalkerInput

logger = logging.getLogger(__name__)

COMPONENTS = ("thinker", "audio_encoder", "vision_encoder", "talker_input", "talker", "code_predictor", "code2wav")
THINKER_SIDE = ("thinker", "audio_encoder", "vision_encoder")  # built without a talker too
ENCODER_BATCH = 16  # requests per encoder call (bounds activation memory)
CODE2WAV_BATCH = 32  # chunks per Code2Wav call (its graphs: batch sizes 1, 2, 4, ... up to it)
MAX_BATCH_TOKENS = 4096  # tokens per thinker or talker step (prefill chunk budget)
_TINY_STD = 0.3  # tiny random weights large enough for varied greedy tokens


SpecOf = Callable[[str, Any], Any]  # Model.engine_spec: a component's engine defaults with the deployment's settings


def model_defaults(component: str, spec: Any) -> Any:
    """`SpecOf` without deployment settings: the model's defaults as they are."""
    return spec


def build_component(ckpt: OmniCheckpoint, cfg, name: str, device: torch.device,
                    spec_of: SpecOf = model_defaults, quantization: Mapping[str, str] | None = None) -> BuiltComponent:
    """The component `name` on `device`, its engine spec from `spec_of`, its weights quantized where
    `quantization` (component -> method; only thinker and talker) says; KeyError lists the components."""
    dtype = cfg.torch_dtype(device)
    quantization = quantization or {}
    builders = {"thinker": partial(_thinker, quantization=quantization.get("thinker")),
                "audio_encoder": _audio_encoder, "vision_encoder": _vision_encoder,
                "talker_input": _talker_input, "talker": partial(_talker, quantization=quantization.get("talker")),
                "code_predictor": _code_predictor, "code2wav": _code2wav}
    if name not in builders:
        raise KeyError(f"qwen3_omni has no component {name!r}; components are {list(COMPONENTS)}")
    if name not in THINKER_SIDE and ckpt.omni.talker is None:
        raise ValueError(f"{ckpt.root} has no talker (enable_audio_output is false): it cannot speak; "
                         "place only the thinker")
    return builders[name](ckpt, cfg, device, dtype, spec_of)


def _fill_dummy(module: torch.nn.Module, cfg, salt: int) -> None:
    loading.fill_dummy_weights(module, seed=cfg.seed * 100 + salt, std=_TINY_STD if cfg.tiny else 0.02)


def _construct(factory, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """`factory()` built straight on `device` (no float32 copy on the CPU first), then cast to `dtype`."""
    with torch.device(device):
        module = factory()
    return module.to(dtype=dtype).eval()


def _thinker(ckpt: OmniCheckpoint, cfg, device: torch.device, dtype: torch.dtype, spec_of: SpecOf,
             quantization: str | None = None) -> BuiltComponent:
    from mstar.layers.parallel import current_tensor_parallel
    from mstar.models.qwen3_omni.thinker import build_thinker
    from mstar.models.qwen3_omni.weights import load_thinker

    tp = current_tensor_parallel()  # one rank's share of a tensor-parallel replica, or None
    if ckpt.root is None:
        module = build_thinker(ckpt.omni.thinker, dtype, device, tp, cfg.thinker_tp_attention, quantization)
        _fill_dummy(module, cfg, 1)
    else:
        module = load_thinker(ckpt.root, ckpt.load_format, dtype, device, tp=tp,
                              split_attention=cfg.thinker_tp_attention, quantization=quantization)
    if ckpt.omni.talker is not None:  # a spoken answer's decode steps return these (engine decode graphs)
        module.graph_hidden_layers = (0, ckpt.omni.talker.accept_hidden_layer)
    eos = (ckpt.omni.token_ids["im_end"],)  # the reference's thinker_eos_token_id
    # on CUDA the thinker steps on a stream of its own (engines/own_stream.py): its decode forwards run
    # beside the talk loop's steps when both share a worker
    return BuiltComponent(module, spec_of("thinker", AutoregressiveSpec(
        eos_token_ids=eos, max_model_len=cfg.context, max_batch_tokens=MAX_BATCH_TOKENS, own_stream=True,
        grammars=ckpt.grammars)))


def _encoder(ckpt: OmniCheckpoint, cfg, module: torch.nn.Module, salt: int) -> None:
    from mstar.models.qwen3_omni.encoder_weights import fill_encoder_dummy_weights, load_encoder

    if ckpt.root is None or ckpt.load_format == "dummy":  # LayerNorms at identity (their names vary)
        fill_encoder_dummy_weights(module, seed=cfg.seed * 100 + salt, std=_TINY_STD if cfg.tiny else 0.02)
    else:
        load_encoder(module, ckpt.root, ckpt.load_format, tensors=loading.iter_checkpoint_tensors(ckpt.root))


def _audio_encoder(ckpt: OmniCheckpoint, cfg, device: torch.device, dtype: torch.dtype, spec_of: SpecOf
                   ) -> BuiltComponent:
    from mstar.models.qwen3_omni.encoder_components import BatchedAudioEncoder
    from mstar.models.qwen3_omni.encoder_weights import build_audio_encoder

    module = build_audio_encoder(ckpt.media_spec().audio, dtype, device)
    _encoder(ckpt, cfg, module, 6)
    return BuiltComponent(BatchedAudioEncoder(module, ckpt.omni.thinker.num_deepstack),
                          spec_of("audio_encoder", StatelessSpec(max_batch_size=ENCODER_BATCH)))


def _vision_encoder(ckpt: OmniCheckpoint, cfg, device: torch.device, dtype: torch.dtype, spec_of: SpecOf
                    ) -> BuiltComponent:
    from mstar.models.qwen3_omni.encoder_components import BatchedVisionEncoder
    from mstar.models.qwen3_omni.encoder_weights import build_vision_encoder

    module = build_vision_encoder(ckpt.media_spec().vision, dtype, device)
    _encoder(ckpt, cfg, module, 7)
    return BuiltComponent(BatchedVisionEncoder(module), spec_of("vision_encoder", StatelessSpec(max_batch_size=ENCODER_BATCH)))


def _talker_spec(ckpt: OmniCheckpoint, cfg, spec_of: SpecOf) -> AutoregressiveSpec:
    talker_cfg = ckpt.omni.talker
    assert talker_cfg is not None
    return spec_of("talker", AutoregressiveSpec(eos_token_ids=(talker_cfg.codec_ids["eos"],),
                                                max_model_len=cfg.talker_max_model_len,
                                                max_batch_tokens=MAX_BATCH_TOKENS, enable_prefix_caching=False))


def _talker(ckpt: OmniCheckpoint, cfg, device: torch.device, dtype: torch.dtype, spec_of: SpecOf,
            quantization: str | None = None) -> BuiltComponent:
    from mstar.models.qwen3_omni.talker import build_talker
    from mstar.models.qwen3_omni.weights import load_talker

    talker_cfg = ckpt.omni.talker
    assert talker_cfg is not None
    if ckpt.root is None:
        talker = build_talker(talker_cfg, dtype, device, quantization)
        _fill_dummy(talker, cfg, 2)
    else:
        talker = load_talker(ckpt.root, ckpt.load_format, dtype, device, quantization=quantization)
    return BuiltComponent(CodecTalker(talker), _talker_spec(ckpt, cfg, spec_of))


def _talker_input(ckpt: OmniCheckpoint, cfg, device: torch.device, dtype: torch.dtype, spec_of: SpecOf
                  ) -> BuiltComponent:
    talker_cfg = ckpt.omni.talker
    assert talker_cfg is not None
    module = _construct(lambda: TalkerInput(talker_cfg, ckpt.omni.token_ids), device, dtype)
    if ckpt.root is None or ckpt.load_format == "dummy":
        _fill_dummy(module, cfg, 3)
    else:
        load_talker_input(module, loading.iter_checkpoint_tensors(ckpt.root))
    return BuiltComponent(module)


def load_talker_input(module: TalkerInput, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy the talker's projections and codec embedding and the thinker's tts_bos/eos/pad embedding
    rows out of a Qwen3-Omni checkpoint; ValueError when one is missing."""
    ids = [module.token_ids[k] for k in ("tts_bos", "tts_eos", "tts_pad")]
    params = dict(module.named_parameters())
    filled: set[str] = set()
    with torch.no_grad():
        for name, tensor in named_tensors:
            if name == "thinker.model.embed_tokens.weight":
                module.tts_rows.copy_(tensor[ids])
                filled.add("tts_rows")
            elif name.startswith(("talker.text_projection.", "talker.hidden_projection.")):
                local = name.removeprefix("talker.")
                params[local].copy_(tensor)
                filled.add(local)
            elif name == "talker.model.codec_embedding.weight":
                module.codec_embedding.weight.copy_(tensor)
                filled.add("codec_embedding.weight")
    missing = sorted(set(params) - filled)
    if missing:
        raise ValueError(f"checkpoint lacks the talker input tensors {missing}; is it Qwen3-Omni with a talker?")


def _code_predictor(ckpt: OmniCheckpoint, cfg, device: torch.device, dtype: torch.dtype, spec_of: SpecOf
                    ) -> BuiltComponent:
    from mstar.models.qwen3_omni.codec_weights import load_code_predictor

    module = _construct(lambda: FrameCodePredictor(ckpt.code_predictor_config), device, dtype)
    module.codec_eos = ckpt.omni.talker.codec_ids["eos"]
    if ckpt.root is None or ckpt.load_format == "dummy":
        _fill_dummy(module, cfg, 4)
    else:
        load_code_predictor(module, loading.iter_checkpoint_tensors(ckpt.root))
    # a step holds at most one frame per talker sequence: no larger batch (nor graph) is needed
    rows = min(_talker_spec(ckpt, cfg, spec_of).max_num_seqs, StatelessSpec().max_batch_size)
    return BuiltComponent(module, spec_of("code_predictor", StatelessSpec(max_batch_size=rows)))


def _code2wav(ckpt: OmniCheckpoint, cfg, device: torch.device, dtype: torch.dtype, spec_of: SpecOf) -> BuiltComponent:
    from mstar.models.qwen3_omni.code2wav import Code2Wav
    from mstar.models.qwen3_omni.codec_weights import build_code2wav

    if ckpt.root is None or ckpt.load_format == "dummy":
        module = _construct(lambda: Code2Wav(ckpt.code2wav_config), device, dtype)
        _fill_dummy(module, cfg, 5)
    else:
        module = build_code2wav(ckpt.code2wav_config, ckpt.root, ckpt.load_format, dtype, device)
    module.pad_frames, widths = code2wav_widths(cfg, device)
    if device.type == "cuda" and not module.pad_frames:  # padded, its engine captures graphs of the one width
        module.warm_up(widths)  # the first request would pay kernel loading and cuDNN plans otherwise
    return BuiltComponent(module, spec_of("code2wav", StatelessSpec(max_batch_size=CODE2WAV_BATCH)))


def code2wav_widths(cfg, device: torch.device | str = "cpu") -> tuple[int, list[int]]:
    """(Code2Wav's pad_frames, the chunk widths it decodes in steady state) under the serve config: the
    one padded width, or (unpadded) the first chunk (no context) and a full chunk with its left context.
    `code2wav_pad` None pads on CUDA."""
    full = cfg.code2wav_chunk + cfg.code2wav_left_context
    pad = cfg.code2wav_pad if cfg.code2wav_pad is not None else torch.device(device).type == "cuda"
    return (full, [full]) if pad else (0, [cfg.code2wav_chunk, full])

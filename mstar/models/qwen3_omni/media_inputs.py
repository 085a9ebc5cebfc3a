"""Qwen3-Omni media -> walk inputs (processor side): encoder inputs, expanded placeholders, positions.

A rendered prompt holds one `<|audio_pad|>` / `<|image_pad|>` / `<|video_pad|>` per media item; each
is repeated as many times as the encoder makes rows for that item (as the checkpoint's processor
does). The walk inputs of a media prompt are then:

- `prompt_ids` [n] (expanded), `mm_mask` [n] bool (the placeholder rows), `mm_kinds` [m] int64
  (`MM_AUDIO` or `MM_VISION` per placeholder row, in prompt order), `positions` [3, n] (M-RoPE);
- `audio_features` [mel, frames] and `audio_lengths` [audios] when there is audio;
- `pixel_values` [patches, patch_dim] and `vision_grid_thw` [items, 3] when there are images or
  videos: images and videos packed in prompt order, so the vision encoder's rows land in order.

With `use_audio_in_video` (the reference's switch, on by default), a video that carries its sound
track is heard too: its `<|video_pad|>` becomes `<|audio_start|>`, the frames' rows and the track's
audio rows interleaved by time (as M-RoPE places them), then `<|audio_end|>`, all inside the video's
`<|vision_start|>`...`<|vision_end|>`, as the reference processor lays it out; the track joins the
audio inputs at the video's place in the prompt.

Media arrive as `mstar.server.media.decode` makes them: {"type": "image", "data": HxWx3 uint8},
{"type": "audio", "data": float32 samples, "sample_rate": int}, {"type": "video", "data": TxHxWx3
uint8, "fps": float}, the video with "audio" (float32 mono samples) and "sample_rate" when it has sound.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from mstar.models.qwen3_omni.audio_encoder import audio_output_lengths
from mstar.models.qwen3_omni.config import MultimodalTokens
from mstar.models.qwen3_omni.encoder_config import AudioEncoderConfig, VisionEncoderConfig
from mstar.models.qwen3_omni.features import (
    MelSpec,
    VisionInputs,
    VisionPreprocessSpec,
    log_mel_features,
    preprocess_images,
    preprocess_videos,
)
from mstar.models.qwen3_omni.positions import mrope_positions

MM_AUDIO, MM_VISION = 0, 1  # values of `mm_kinds`: which encoder fills a placeholder row
KINDS = ("audio", "image", "video")
_CHECKPOINT_FACTOR = 32  # patch 16 x merge 2: the pixel bounds below are the checkpoint's at this factor


@dataclass(frozen=True)
class MediaSpec:
    """How decoded media become encoder inputs, derived from the checkpoint's encoder configs."""

    audio: AudioEncoderConfig
    vision: VisionEncoderConfig
    video_fps: float = 2.0  # frames a second sampled from a video (Qwen's default)

    @classmethod
    def from_hf(cls, thinker: Mapping[str, Any], video_fps: float = 2.0) -> MediaSpec:
        """From `thinker_config` of config.json."""
        if video_fps <= 0:
            raise ValueError(f"video_fps={video_fps}: use a positive frame rate")
        return cls(AudioEncoderConfig.from_hf(thinker.get("audio_config", {})),
                   VisionEncoderConfig.from_hf(thinker.get("vision_config", {})), video_fps)

    @property
    def mel(self) -> MelSpec:
        return MelSpec(num_mel_bins=self.audio.num_mel_bins)

    @property
    def pixels(self) -> VisionPreprocessSpec:
        """The checkpoint's resizing bounds, kept in merged tokens when the patch grid is smaller (tiny)."""
        v = self.vision
        base = VisionPreprocessSpec(v.patch_size, v.temporal_patch_size, v.spatial_merge_size)
        scale = (base.factor / _CHECKPOINT_FACTOR) ** 2
        if scale == 1:
            return base
        return replace(base, **{k: max(base.factor**2, int(getattr(base, k) * scale)) for k in
                                ("image_min_pixels", "image_max_pixels", "video_min_pixels", "video_max_pixels")})


@dataclass
class PromptMedia:
    """A media prompt's walk inputs and what its M-RoPE positions were computed from."""

    inputs: dict[str, torch.Tensor]
    rope: dict[str, Any] = field(default_factory=dict)  # mrope_positions keyword arguments
    kinds: tuple[str, ...] = ()  # media kinds present, sorted


def media_prompt(ids: Sequence[int], media: Sequence[Mapping[str, Any]], spec: MediaSpec,
                 tokens: MultimodalTokens, use_audio_in_video: bool = True) -> PromptMedia:
    """Walk inputs of a prompt `ids` holding one placeholder per item of `media` (see the module doc).

    ValueError when the placeholders and the media do not match or an item is malformed.
    """
    by_kind = _split(media)
    pads = {"audio": tokens.audio_token_id, "image": tokens.image_token_id, "video": tokens.video_token_id}
    order = [kind for t in ids for kind, pad in pads.items() if t == pad]  # placeholders in prompt order
    for kind in KINDS:
        if order.count(kind) != len(by_kind[kind]):
            raise ValueError(f"the prompt has {order.count(kind)} {kind} placeholder(s) but the request has "
                             f"{len(by_kind[kind])} {kind} input(s); put one {kind} part in the messages per {kind}")
    tracks = [_track(v) if use_audio_in_video else None for v in by_kind["video"]]
    heard = _heard_in_order(order, by_kind["audio"], tracks, spec)
    inputs: dict[str, torch.Tensor] = {}
    rope: dict[str, Any] = {}
    audio_rows: list[int] = []
    if heard:
        feats = log_mel_features([a for a, _ in heard], [r for _, r in heard], spec.mel)
        inputs["audio_features"], inputs["audio_lengths"] = feats.features, feats.lengths
        audio_rows = audio_output_lengths(feats.lengths.tolist(), spec.audio)
        rope["audio_feature_lengths"] = feats.lengths.tolist()
    images = [preprocess_images([_array(m, "image")], spec.pixels) for m in by_kind["image"]]
    videos = [_video(m, spec) for m in by_kind["video"]]
    if images:
        rope["image_grid_thw"] = torch.cat([v.grid_thw for v in images])
    if videos:
        rope["video_grid_thw"] = torch.cat([v.grid_thw for v in videos])
        rope["video_second_per_grid"] = [v.second_per_grid[0] for v in videos]
    if any(t is not None for t in tracks):
        rope["use_audio_in_video"] = True
    vision = _in_prompt_order([k for k in order if k != "audio"], images, videos)
    if vision:
        inputs["pixel_values"] = torch.cat([v.pixel_values for v in vision])
        inputs["vision_grid_thw"] = torch.cat([v.grid_thw for v in vision])
    blocks = _blocks(order, iter(audio_rows), images, videos, tracks, spec, tokens)
    expanded, kinds = _expand(ids, set(pads.values()), blocks, tokens)
    inputs["prompt_ids"] = expanded
    inputs["mm_mask"] = kinds >= 0
    inputs["mm_kinds"] = kinds[kinds >= 0]
    inputs["positions"], _delta = mrope_positions(expanded, tokens, **rope)
    return PromptMedia(inputs, rope, tuple(sorted({k for k in order})))


def _track(video: Mapping[str, Any]) -> tuple[np.ndarray, int] | None:
    """A video item's sound track (mono samples, rate), or None when it has none."""
    audio = video.get("audio")
    if audio is None:
        return None
    if not isinstance(audio, np.ndarray) or audio.ndim != 1 or not audio.size:
        raise ValueError("a video's 'audio' must be decoded mono float32 samples")
    return audio, int(video.get("sample_rate") or 16000)


def _heard_in_order(order: list[str], audios: list[Mapping[str, Any]], tracks: list[tuple[np.ndarray, int] | None],
                    spec: MediaSpec) -> list[tuple[np.ndarray, int]]:
    """(samples, rate) of every audio the thinker hears, in prompt order: audio inputs and heard video tracks."""
    audio_items, video_tracks, heard = iter(audios), iter(tracks), []
    for kind in order:
        if kind == "audio":
            item = next(audio_items)
            heard.append((_array(item, "audio"), int(item.get("sample_rate", spec.mel.sampling_rate))))
        elif kind == "video" and (track := next(video_tracks)) is not None:
            heard.append(track)
    return heard


Block = list[tuple[int, int]]  # what one placeholder becomes: (token id, MM_AUDIO / MM_VISION, or -1 for text)


def _blocks(order: list[str], audio_rows: Any, images: list[VisionInputs], videos: list[VisionInputs],
            tracks: list[tuple[np.ndarray, int] | None], spec: MediaSpec, tokens: MultimodalTokens) -> list[Block]:
    """Each placeholder's rows, in prompt order (`audio_rows`: an iterator of the heard audios' row counts)."""
    merge = spec.vision.spatial_merge_size
    image_items, video_items, video_tracks = iter(images), iter(videos), iter(tracks)
    audio = [(tokens.audio_token_id, MM_AUDIO)]
    blocks: list[Block] = []
    for kind in order:
        if kind == "audio":
            blocks.append(audio * next(audio_rows))
        elif kind == "image":
            blocks.append([(tokens.image_token_id, MM_VISION)] * next(image_items).num_tokens(merge)[0])
        else:
            video, track = next(video_items), next(video_tracks)
            if track is None:
                blocks.append([(tokens.video_token_id, MM_VISION)] * video.num_tokens(merge)[0])
                continue
            if tokens.audio_end_token_id is None:
                raise ValueError("the checkpoint's config names no audio_end_token_id: send the video without sound "
                                 "or set use_audio_in_video false")
            step = video.second_per_grid[0] * tokens.position_id_per_seconds
            rows = av_interleave(video.grid_thw[0].tolist(), merge, step, next(audio_rows))
            pieces = [(tokens.video_token_id if k == MM_VISION else tokens.audio_token_id, k) for k in rows]
            blocks.append([(tokens.audio_start_token_id, -1), *pieces, (tokens.audio_end_token_id, -1)])
    return blocks


def av_interleave(grid_thw: Sequence[int], merge: int, step: float, audio_rows: int) -> list[int]:
    """MM_VISION / MM_AUDIO per row of a heard video: frame rows (at time t * `step`) and audio rows (one a
    position) merged by time, a frame first on a tie, as the reference processor orders them."""
    t, h, w = (int(x) for x in grid_thw)
    times = [ti * step for ti in range(t) for _ in range((h // merge) * (w // merge))]
    out, v, a = [], 0, 0
    while v < len(times) and a < audio_rows:
        if times[v] <= a:
            out.append(MM_VISION)
            v += 1
        else:
            out.append(MM_AUDIO)
            a += 1
    return out + [MM_VISION] * (len(times) - v) + [MM_AUDIO] * (audio_rows - a)


def _split(media: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    out: dict[str, list[Mapping[str, Any]]] = {k: [] for k in KINDS}
    for item in media:
        kind = item.get("type") if isinstance(item, Mapping) else None
        if kind not in out:
            raise ValueError(f"media item of type {kind!r}: qwen3_omni takes {list(KINDS)}")
        out[kind].append(item)
    return out


def _array(item: Mapping[str, Any], what: str) -> np.ndarray:
    data = item.get("data")
    if not isinstance(data, np.ndarray):
        raise ValueError(f"{what} data must be a decoded numpy array, got {type(data).__name__}")
    return data


def _video(item: Mapping[str, Any], spec: MediaSpec) -> VisionInputs:
    frames = _array(item, "video")
    fps = item.get("fps")
    if fps and frames.ndim == 4 and frames.shape[0] >= spec.vision.temporal_patch_size:
        return preprocess_videos([frames], video_fps=[float(fps)], fps=spec.video_fps, spec=spec.pixels)
    return preprocess_videos([frames], spec=spec.pixels)  # too short to sample: every frame, 1 fps timing


def _in_prompt_order(order: list[str], images: list[VisionInputs], videos: list[VisionInputs]) -> list[VisionInputs]:
    queues = {"image": iter(images), "video": iter(videos)}
    return [next(queues[kind]) for kind in order]


def _expand(ids: Sequence[int], pad_ids: set[int], blocks: list[Block],
            tokens: MultimodalTokens) -> tuple[torch.Tensor, torch.Tensor]:
    """(expanded ids [n], per token: MM_AUDIO, MM_VISION or -1 for text): each placeholder replaced by its block."""
    todo = iter(blocks)
    out_ids: list[int] = []
    out_kinds: list[int] = []
    for i, t in enumerate(int(t) for t in ids):
        if t not in pad_ids:
            out_ids.append(t)
            out_kinds.append(-1)
            continue
        block = next(todo)
        if block and block[0][0] == tokens.audio_start_token_id and (i == 0 or ids[i - 1] != tokens.vision_start_token_id):
            raise ValueError("a video heard with its sound must sit inside <|vision_start|>...<|vision_end|>")
        out_ids += [tok for tok, _ in block]
        out_kinds += [kind for _, kind in block]
    return torch.tensor(out_ids, dtype=torch.long), torch.tensor(out_kinds, dtype=torch.long)

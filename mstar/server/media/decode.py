"""Decoding client media into arrays: images, audio and video.

Every decoder accepts what `load_media_bytes` accepts (bytes, data URL, base64, an allowed URL) and
raises `MediaError` on failure: 400 for corrupt or unsupported data, 413 when too large. Pillow,
soundfile, scipy and PyAV are imported inside the functions that use them.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from math import gcd
from typing import Any

import numpy as np

from mstar.server.media.sources import MediaError, MediaPolicy, load_media_bytes

logger = logging.getLogger(__name__)

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


@dataclass(frozen=True)
class DecodedAudio:
    """Audio as float32 samples shaped (frames, channels), values in [-1, 1]."""

    samples: np.ndarray
    sample_rate: int

    @property
    def channels(self) -> int:
        return int(self.samples.shape[1])

    @property
    def duration_s(self) -> float:
        return self.samples.shape[0] / self.sample_rate

    def mono(self) -> np.ndarray:
        """The channels averaged into one 1-D float32 array."""
        return self.samples.mean(axis=1, dtype=np.float32)


@dataclass(frozen=True)
class DecodedVideo:
    """Video frames as uint8 RGB shaped (frames, height, width, 3), with the stream's frame rate and the
    container's sound track, if it has one."""

    frames: np.ndarray
    fps: float
    audio: DecodedAudio | None = None

    def media_item(self) -> dict[str, Any]:
        """A processor request's media item: frames and fps, and the sound as mono samples with their rate."""
        item: dict[str, Any] = {"type": "video", "data": self.frames, "fps": self.fps}
        if self.audio is not None:
            item.update(audio=self.audio.mono(), sample_rate=self.audio.sample_rate)
        return item


def decode_image(source, policy: MediaPolicy | None = None) -> np.ndarray:
    """Decode a PNG, JPEG, WEBP or GIF (first frame) into a uint8 (H, W, 3) RGB array.

    EXIF orientation is applied, so phone photos come out upright.
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    policy = policy or MediaPolicy()
    data = load_media_bytes(source, policy)
    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.format not in IMAGE_FORMATS:
                raise MediaError(400, f"unsupported image format {img.format}; use one of {', '.join(IMAGE_FORMATS)}")
            width, height = img.size
            if width * height > policy.max_image_pixels:
                raise MediaError(
                    413, f"image is {width}x{height}, over the limit of {policy.max_image_pixels} pixels"
                )
            img.seek(0)
            rgb = ImageOps.exif_transpose(img).convert("RGB")
            return np.asarray(rgb, dtype=np.uint8).copy()
    except MediaError:
        raise
    except Image.DecompressionBombError:  # Pillow refuses at open what is far past its own limit
        raise MediaError(413, f"image is over the limit of {policy.max_image_pixels} pixels") from None
    except UnidentifiedImageError:
        raise MediaError(400, f"could not decode image: not one of {', '.join(IMAGE_FORMATS)}, or corrupt") from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise MediaError(400, f"could not decode image (corrupt or truncated): {exc}") from None


PCM16_RATE = 24000  # raw pcm16 carries no rate: OpenAI's, for chat's input_audio and /generate alike


def decode_pcm16(source, policy: MediaPolicy | None = None) -> DecodedAudio:
    """Raw little-endian 16-bit mono PCM at PCM16_RATE (OpenAI's `pcm16`) to float32; an odd last byte is dropped."""
    raw = load_media_bytes(source, policy)
    return DecodedAudio(np.frombuffer(raw[: len(raw) // 2 * 2], "<i2").astype(np.float32)[:, None] / 32768.0,
                        PCM16_RATE)


def decode_audio(
    source, policy: MediaPolicy | None = None, target_rate: int | None = None
) -> DecodedAudio:
    """Decode WAV, FLAC, OGG (Vorbis/Opus), MP3 (soundfile) or AAC/M4A and others (PyAV) to float32.

    With `target_rate`, the audio is resampled to that rate (polyphase filter).
    """
    policy = policy or MediaPolicy()
    data = load_media_bytes(source, policy)
    try:
        audio = _decode_audio_soundfile(data, policy)
    except _NotForSoundfile:
        audio = _decode_audio_av(data, policy)
    if audio.samples.shape[0] == 0:
        raise MediaError(400, "audio input has no samples")
    if target_rate is not None and target_rate != audio.sample_rate:
        audio = DecodedAudio(resample_audio(audio.samples, audio.sample_rate, target_rate), target_rate)
    return audio


def resample_audio(samples: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """Resample float32 audio along axis 0 from `from_rate` to `to_rate` Hz."""
    if from_rate <= 0 or to_rate <= 0:
        raise ValueError(f"sample rates must be positive, got {from_rate} -> {to_rate}")
    if from_rate == to_rate:
        return samples.astype(np.float32, copy=False)
    from scipy.signal import resample_poly

    g = gcd(from_rate, to_rate)
    return resample_poly(samples, to_rate // g, from_rate // g, axis=0).astype(np.float32)


class _NotForSoundfile(Exception):
    """libsndfile does not recognise the container; PyAV may."""


def _decode_audio_soundfile(data: bytes, policy: MediaPolicy) -> DecodedAudio:
    import soundfile as sf

    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            if f.frames > 0 and f.frames / f.samplerate > policy.max_audio_seconds:
                raise MediaError(
                    413, f"audio lasts {f.frames / f.samplerate:.1f} s, over the limit of {policy.max_audio_seconds} s"
                )
            _check_audio_samples(f.frames * f.channels, policy)
            samples = f.read(dtype="float32", always_2d=True)
            return DecodedAudio(samples, int(f.samplerate))
    except sf.LibsndfileError as exc:
        raise _NotForSoundfile(str(exc)) from None
    except (RuntimeError, TypeError) as exc:  # soundfile raises these for some broken headers
        raise _NotForSoundfile(str(exc)) from None


def _decode_audio_av(data: bytes, policy: MediaPolicy) -> DecodedAudio:
    pieces: list[np.ndarray] = []
    total = 0
    with _av_stream(data, "audio") as (container, stream):
        rate = int(stream.codec_context.sample_rate or stream.rate)
        for frame in container.decode(stream):
            pieces.append(_audio_frame_to_array(frame))
            total += pieces[-1].shape[0]
            if total / rate > policy.max_audio_seconds:
                raise MediaError(413, f"audio lasts over the limit of {policy.max_audio_seconds} s")
            _check_audio_samples(total * pieces[-1].shape[1], policy)
    if not pieces:
        raise MediaError(400, "could not decode audio: the stream has no samples")
    return DecodedAudio(np.concatenate(pieces, axis=0), rate)


@contextlib.contextmanager
def _av_stream(data: bytes, kind: str) -> Iterator[tuple[Any, Any]]:
    """(container, its first `kind` stream: "audio" or "video"); a decoding error in the block becomes
    MediaError 400."""
    import av  # a dependency; imported here since few requests carry video

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            streams = container.streams.audio if kind == "audio" else container.streams.video
            if not streams:
                raise MediaError(400, f"could not decode {kind}: no {kind} stream found")
            yield container, streams[0]
    except MediaError:
        raise
    except (av.FFmpegError, ValueError, IndexError) as exc:
        raise MediaError(400, f"could not decode {kind} (unsupported or corrupt): {exc}") from None


def _check_audio_samples(values: int, policy: MediaPolicy) -> None:
    if values > policy.max_audio_samples:
        raise MediaError(413, f"audio decodes to {values} samples (frames x channels), over the limit of "
                              f"{policy.max_audio_samples}: send fewer channels, a lower rate or a shorter clip")


def _audio_frame_to_array(frame) -> np.ndarray:
    """One PyAV AudioFrame -> float32 (samples, channels)."""
    arr = frame.to_ndarray()
    channels = len(frame.layout.channels)
    if frame.format.is_planar:
        arr = arr.T  # planar: (channels, samples)
    else:
        arr = arr.reshape(-1, channels)  # packed: interleaved in one row
    if np.issubdtype(arr.dtype, np.integer):
        arr = arr.astype(np.float32) / float(np.iinfo(arr.dtype).max)
    return arr.astype(np.float32, copy=False)


def decode_video(source, policy: MediaPolicy | None = None, max_frames: int = 256) -> DecodedVideo:
    """Decode the first video stream into at most `max_frames` uint8 RGB frames (T, H, W, 3), and the first
    audio stream, if any, under the policy's audio limits (cut to the frames kept when `max_frames` cut
    the video short)."""
    if max_frames < 1:
        raise ValueError(f"max_frames must be >= 1, got {max_frames}")
    policy = policy or MediaPolicy()
    data = load_media_bytes(source, policy)
    frames: list[np.ndarray] = []
    with _av_stream(data, "video") as (container, stream):
        width, height = stream.codec_context.width, stream.codec_context.height
        if width * height > policy.max_image_pixels:
            raise MediaError(413, f"video is {width}x{height}, over the limit of {policy.max_image_pixels} pixels")
        fps = float(stream.average_rate or stream.guessed_rate or 0.0)
        for frame in container.decode(stream):
            if (len(frames) + 1) * width * height > policy.max_video_pixels:
                raise MediaError(413, f"video decodes to over {policy.max_video_pixels} pixels (frames x "
                                      f"{width}x{height}); send fewer frames or a smaller size")
            frames.append(frame.to_ndarray(format="rgb24"))
            if len(frames) >= max_frames:
                break
        has_sound = bool(container.streams.audio)
    if not frames:
        raise MediaError(400, "could not decode video: no frames")
    audio = None
    if has_sound:
        try:
            audio = _decode_audio_av(data, policy)
        except MediaError as exc:
            raise MediaError(exc.status_code, f"the video's sound track: {exc.message}") from None
        if len(frames) >= max_frames and fps > 0:
            audio = DecodedAudio(audio.samples[: int(len(frames) / fps * audio.sample_rate)], audio.sample_rate)
    return DecodedVideo(np.stack(frames), fps, audio)

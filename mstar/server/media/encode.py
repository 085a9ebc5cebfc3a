"""Encoding model outputs for clients: audio containers, images and MP4 video.

Audio goes through soundfile (libsndfile) for wav, flac, mp3 and ogg/opus, and through PyAV for aac
(ADTS) or when the installed libsndfile lacks a format. Video is H.264 in MP4 through PyAV, with an
optional AAC audio track. Failures raise `MediaError` (500: the server could not encode its own
output; 400 for a format name the client chose that does not exist).
"""

from __future__ import annotations

import io
import logging
import struct
import time
from fractions import Fraction

import numpy as np

from mstar.server.media.decode import DecodedAudio, resample_audio
from mstar.server.media.sources import MediaError

logger = logging.getLogger(__name__)

AUDIO_FORMATS = ("wav", "pcm", "flac", "mp3", "opus", "aac")
AUDIO_MIME = {
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
}
_OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
_MP3_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)


def as_frames(samples: np.ndarray) -> np.ndarray:
    """Float32 audio shaped (frames, channels) from a 1-D or 2-D array, clipped to [-1, 1]."""
    arr = np.asarray(samples, dtype=np.float32)
    if arr.ndim == 1:
        arr = arr[:, None]
    if arr.ndim != 2 or arr.shape[1] > 8:
        raise MediaError(500, f"audio must be (frames,) or (frames, channels<=8), got shape {arr.shape}")
    return np.clip(arr, -1.0, 1.0)


def pcm_s16le(samples: np.ndarray) -> bytes:
    """Interleaved signed 16-bit little-endian PCM."""
    return (as_frames(samples) * 32767.0).round().astype("<i2").tobytes()


def wav_stream_header(sample_rate: int, channels: int = 1) -> bytes:
    """A 16-bit PCM WAV header of unknown length, for streaming: s16le frames may follow forever."""
    unknown = 0xFFFFFFFF
    block = channels * 2
    return (
        b"RIFF" + struct.pack("<I", unknown) + b"WAVE"
        + b"fmt " + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, sample_rate * block, block, 16)
        + b"data" + struct.pack("<I", unknown)
    )


def encode_audio(samples: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """Encode float32 audio ((frames,) or (frames, channels)) as one of `AUDIO_FORMATS`.

    `pcm` is raw s16le at `sample_rate`. opus and mp3 are resampled when the codec does not support
    `sample_rate` (opus to 48 kHz; mp3 to the nearest rate it supports).
    """
    fmt = fmt.lower()
    if fmt not in AUDIO_FORMATS:
        raise MediaError(400, f"unsupported audio format {fmt!r}; use one of {', '.join(AUDIO_FORMATS)}")
    frames = as_frames(samples)
    if fmt == "pcm":
        return pcm_s16le(frames)
    if fmt == "opus" and sample_rate not in _OPUS_RATES:
        frames, sample_rate = resample_audio(frames, sample_rate, 48000), 48000
    if fmt == "mp3" and sample_rate not in _MP3_RATES:
        target = min(_MP3_RATES, key=lambda r: abs(r - sample_rate))
        frames, sample_rate = resample_audio(frames, sample_rate, target), target
    if fmt == "aac":
        return _encode_audio_av(frames, sample_rate, "adts", "aac")
    try:
        return _encode_audio_soundfile(frames, sample_rate, fmt)
    except Exception as exc:  # libsndfile builds differ; PyAV is the fallback, never a crash
        logger.debug("soundfile could not write %s (%s); trying PyAV", fmt, exc)
    fallback = {"wav": ("wav", "pcm_s16le"), "flac": ("flac", "flac"), "mp3": ("mp3", "libmp3lame"),
                "opus": ("ogg", "libopus")}[fmt]
    return _encode_audio_av(frames, sample_rate, *fallback)


_SF_ARGS = {
    "wav": ("WAV", "PCM_16"),
    "flac": ("FLAC", "PCM_16"),
    "mp3": ("MP3", "MPEG_LAYER_III"),
    "opus": ("OGG", "OPUS"),
}


def _encode_audio_soundfile(frames: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    import soundfile as sf

    container, subtype = _SF_ARGS[fmt]
    buf = io.BytesIO()
    sf.write(buf, frames, sample_rate, format=container, subtype=subtype)
    return buf.getvalue()


def _encode_audio_av(frames: np.ndarray, sample_rate: int, container_format: str, codec: str) -> bytes:
    import av  # a dependency; imported here since few requests carry video
    buf = io.BytesIO()
    try:
        with av.open(buf, mode="w", format=container_format) as container:
            stream = container.add_stream(codec, rate=sample_rate)
            stream.layout = _layout(frames.shape[1])
            _mux_audio(container, stream, frames, sample_rate)
    except (av.FFmpegError, ValueError) as exc:
        raise MediaError(500, f"could not encode audio as {codec} in {container_format}: {exc}") from None
    return buf.getvalue()


def _layout(channels: int) -> str:
    return {1: "mono", 2: "stereo"}.get(channels, f"{channels}c")


def _mux_audio(container, stream, frames: np.ndarray, sample_rate: int) -> None:
    """Encode (frames, channels) float32 into `stream`, in codec-sized frames, and flush it."""
    import av
    frame = av.AudioFrame.from_ndarray(
        np.ascontiguousarray(frames.reshape(1, -1)), format="flt", layout=_layout(frames.shape[1])
    )
    frame.sample_rate = sample_rate
    frame.pts = 0
    # The resampler converts to the codec's sample format and re-chunks to its frame size.
    resampler = av.AudioResampler(
        format=stream.codec_context.format or "fltp", layout=stream.layout, rate=sample_rate,
        frame_size=stream.codec_context.frame_size or None,
    )
    for out in resampler.resample(frame) + resampler.resample(None):
        for packet in stream.encode(out):
            container.mux(packet)
    for packet in stream.encode(None):
        container.mux(packet)


def warm_encoders(outputs: tuple[str, ...] | list[str], sample_rate: int) -> dict[str, float]:
    """Encode a few milliseconds of silence or black frames once per container a model with `outputs`
    (its output modalities) may be asked for, so that the first request does not pay the codecs' and
    libraries' first use, several times a warm encode. Never raises (a format that fails is logged and
    left cold). Seconds each warm-up took, by format."""
    jobs = []
    if "audio" in outputs:
        silence = np.zeros(max(1, sample_rate // 20), dtype=np.float32)
        jobs += [(fmt, lambda fmt=fmt: encode_audio(silence, sample_rate, fmt)) for fmt in AUDIO_FORMATS]
    if "image" in outputs or "video" in outputs:
        jobs += [(fmt, lambda fmt=fmt: encode_image(np.zeros((8, 8, 3), dtype=np.uint8), fmt)) for fmt in ("png", "jpeg")]
    if "video" in outputs:
        jobs.append(("mp4", lambda: encode_video(np.zeros((2, 16, 16, 3), dtype=np.uint8), 16.0)))
    took = {}
    for name, job in jobs:
        start = time.perf_counter()
        try:
            job()
        except Exception as exc:  # a missing codec: that format's first request pays (and reports) it
            logger.info("warming the %s encoder failed (%s: %s)", name, type(exc).__name__, exc)
            continue
        took[name] = time.perf_counter() - start
    return took


def encode_image(image, fmt: str = "png", quality: int = 90) -> bytes:
    """Encode a uint8 (H, W, 3|4) array or a PIL image as PNG or JPEG bytes."""
    from PIL import Image

    fmt = fmt.lower()
    names = {"png": "PNG", "jpeg": "JPEG", "jpg": "JPEG", "webp": "WEBP"}
    if fmt not in names:
        raise MediaError(400, f"unsupported image format {fmt!r}; use png, jpeg or webp")
    img = image if isinstance(image, Image.Image) else Image.fromarray(np.asarray(image, dtype=np.uint8))
    if names[fmt] == "JPEG" and img.mode != "RGB":
        img = img.convert("RGB")  # JPEG has no alpha
    buf = io.BytesIO()
    img.save(buf, format=names[fmt], **({"quality": quality} if names[fmt] != "PNG" else {}))
    return buf.getvalue()


def encode_video(frames: np.ndarray, fps: float, audio: DecodedAudio | None = None, crf: int = 20) -> bytes:
    """Encode uint8 RGB frames (T, H, W, 3) as H.264 MP4 at `fps`, with an optional AAC track.

    Odd widths or heights are padded by one edge pixel (H.264 with yuv420p needs even sizes).
    """
    import av
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or frames.shape[0] == 0:
        raise MediaError(500, f"video frames must be uint8 (T, H, W, 3) with T >= 1, got {frames.dtype} {frames.shape}")
    if fps <= 0:
        raise MediaError(500, f"video fps must be > 0, got {fps}")
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    if pad_h or pad_w:
        frames = np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    buf = io.BytesIO()
    try:
        with av.open(buf, mode="w", format="mp4") as container:
            stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
            stream.width, stream.height = frames.shape[2], frames.shape[1]
            stream.pix_fmt = "yuv420p"
            # Macroblock-tree rate control can make different bitstreams from the same frames from run to
            # run, so a same-seed job would not give the same file; off, at a small cost in size.
            stream.options = {"crf": str(crf), "x264-params": "mbtree=0"}
            audio_stream = None
            if audio is not None:
                audio_stream = container.add_stream("aac", rate=audio.sample_rate)
                audio_stream.layout = _layout(audio.channels)
            for i, rgb in enumerate(frames):
                vf = av.VideoFrame.from_ndarray(rgb, format="rgb24")
                vf.pts = i
                for packet in stream.encode(vf):
                    container.mux(packet)
            for packet in stream.encode(None):
                container.mux(packet)
            if audio_stream is not None:
                _mux_audio(container, audio_stream, as_frames(audio.samples), audio.sample_rate)
    except (av.FFmpegError, ValueError) as exc:
        raise MediaError(500, f"could not encode video: {exc}") from None
    return buf.getvalue()

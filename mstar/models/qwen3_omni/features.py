"""Qwen3-Omni input features: 16 kHz log-mel spectrograms and patchified images and video frames.

These reproduce the checkpoint's processors (transformers' WhisperFeatureExtractor with 128 mel bins,
the Qwen2-VL image processor and video processor with patch 16, temporal patch 2, merge 2) without
torchaudio or transformers: numpy and torch for the STFT and mel filters, Pillow for image resizing,
scipy for resampling. Inputs are the arrays `mstar.server.media.decode` produces.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class MelSpec:
    """The log-mel front-end of the checkpoint (preprocessor_config.json of Qwen3-Omni)."""

    sampling_rate: int = 16000
    n_fft: int = 400
    hop_length: int = 160
    num_mel_bins: int = 128
    max_frequency: float = 8000.0


@dataclass(frozen=True)
class AudioFeatures:
    """Log-mel features of several audios, concatenated along time."""

    features: torch.Tensor  # [num_mel_bins, sum(lengths)] float32, audio after audio
    lengths: torch.Tensor  # [num_audios] int64: mel frames of each audio


def _hertz_to_mel(freq: np.ndarray) -> np.ndarray:
    # Slaney scale: linear below 1 kHz, logarithmic above.
    mels = 3.0 * freq / 200.0
    log_region = freq >= 1000.0
    mels[log_region] = 15.0 + np.log(freq[log_region] / 1000.0) * (27.0 / np.log(6.4))
    return mels


def _mel_to_hertz(mels: np.ndarray) -> np.ndarray:
    freq = 200.0 * mels / 3.0
    log_region = mels >= 15.0
    freq[log_region] = 1000.0 * np.exp(np.log(6.4) / 27.0 * (mels[log_region] - 15.0))
    return freq


def mel_filter_bank(spec: MelSpec = MelSpec()) -> np.ndarray:
    """Slaney-scale, area-normalised triangular filters [n_fft // 2 + 1, num_mel_bins] (float64)."""
    num_freqs = spec.n_fft // 2 + 1
    mel_edges = np.linspace(0.0, _hertz_to_mel(np.array([spec.max_frequency]))[0], spec.num_mel_bins + 2)
    edges_hz = _mel_to_hertz(mel_edges)
    fft_freqs = np.linspace(0, spec.sampling_rate // 2, num_freqs)
    slopes = edges_hz[None, :] - fft_freqs[:, None]
    widths = np.diff(edges_hz)
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    filters = np.maximum(0.0, np.minimum(down, up))
    return filters * (2.0 / (edges_hz[2:] - edges_hz[:-2]))[None, :]


def to_mono(samples: np.ndarray, sample_rate: int, spec: MelSpec = MelSpec()) -> np.ndarray:
    """float32 mono at `spec.sampling_rate` from (frames,) or (frames, channels) audio at `sample_rate`."""
    samples = np.asarray(samples, dtype=np.float32)
    if samples.ndim == 2:
        samples = samples.mean(axis=1, dtype=np.float32)
    if samples.ndim != 1:
        raise ValueError(f"audio must be shaped (frames,) or (frames, channels), got {samples.shape}")
    if sample_rate <= 0:
        raise ValueError(f"audio sample rate must be positive, got {sample_rate}")
    if sample_rate == spec.sampling_rate:
        return samples
    from scipy.signal import resample_poly

    g = math.gcd(sample_rate, spec.sampling_rate)
    return resample_poly(samples, spec.sampling_rate // g, sample_rate // g).astype(np.float32)


def log_mel_features(
    waveforms: Sequence[np.ndarray], sample_rates: int | Sequence[int] = 16000, spec: MelSpec = MelSpec()
) -> AudioFeatures:
    """Log-mel features of the audios of one request, as the checkpoint's processor computes them.

    Like the reference, the audios are zero-padded to the longest one before the STFT (so a short
    audio's last frames see zeros, not reflection) and each is normalised by its own maximum.
    """
    if not waveforms:
        raise ValueError("log_mel_features needs at least one audio")
    rates = [sample_rates] * len(waveforms) if isinstance(sample_rates, int) else list(sample_rates)
    if len(rates) != len(waveforms):
        raise ValueError(f"got {len(waveforms)} audios but {len(rates)} sample rates")
    mono = [to_mono(w, r, spec) for w, r in zip(waveforms, rates)]
    padded_len = max(len(m) for m in mono)
    if padded_len <= spec.n_fft // 2:
        raise ValueError(
            f"audio too short: {padded_len} samples at {spec.sampling_rate} Hz; "
            f"need more than {spec.n_fft // 2}"
        )
    batch = torch.zeros(len(mono), padded_len, dtype=torch.float32)
    for i, m in enumerate(mono):
        batch[i, : len(m)] = torch.from_numpy(m)
    log_spec = _log_mel(batch, spec)
    lengths = torch.tensor(
        [_valid_frames(len(m), padded_len, spec.hop_length) for m in mono], dtype=torch.int64
    )
    features = torch.cat([log_spec[i, :, :n] for i, n in enumerate(lengths.tolist())], dim=1)
    return AudioFeatures(features=features, lengths=lengths)


def _log_mel(batch: torch.Tensor, spec: MelSpec) -> torch.Tensor:
    """[B, samples] -> [B, mels, samples // hop] normalised log10 mel power (Whisper convention)."""
    window = torch.hann_window(spec.n_fft)
    stft = torch.stft(batch, spec.n_fft, spec.hop_length, window=window, return_complex=True)
    power = (stft[..., :-1].abs() ** 2).contiguous()  # the last frame is dropped, as in Whisper
    filters = torch.from_numpy(mel_filter_bank(spec)).to(torch.float32)
    log_spec = torch.clamp(filters.T @ power, min=1e-10).log10()
    peak = log_spec.amax(dim=(1, 2), keepdim=True)
    log_spec = torch.maximum(log_spec, peak - 8.0)  # an 80 dB dynamic range below each audio's peak
    return (log_spec + 4.0) / 4.0


def _valid_frames(length: int, padded_len: int, hop: int) -> int:
    # The reference subsamples the sample mask every `hop` samples and drops the last entry when the
    # padded length is not a multiple of hop.
    count = -(-length // hop)
    if padded_len % hop and count == -(-padded_len // hop):
        count -= 1
    return count


# ---------------------------------------------------------------- images and video


@dataclass(frozen=True)
class VisionPreprocessSpec:
    """Resizing bounds, normalisation and patch geometry of the checkpoint's image and video processors."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_min_pixels: int = 3136
    image_max_pixels: int = 12845056
    video_min_pixels: int = 128 * 32 * 32  # Qwen3OmniMoeProcessor's video defaults
    video_max_pixels: int = 768 * 32 * 32
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    min_frames: int = 4  # bounds of fps-based frame sampling
    max_frames: int = 768

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: one merged token covers factor x factor pixels."""
        return self.patch_size * self.merge_size


@dataclass(frozen=True)
class VisionInputs:
    """Flattened patches of several images or videos, and the patch grid of each."""

    pixel_values: torch.Tensor  # [sum(t*h*w), C * temporal_patch * patch * patch] float32
    grid_thw: torch.Tensor  # [num_inputs, 3] int64: temporal, height, width in patches
    # Videos only: seconds one temporal patch spans (temporal_patch_size / sampling fps, 1 fps when
    # frames were not resampled, as the reference processor assumes); feeds the thinker's positions.
    second_per_grid: tuple[float, ...] = ()

    def num_tokens(self, merge_size: int = 2) -> list[int]:
        """Thinker tokens of each input once the merger joined merge_size x merge_size patches."""
        return [t * h * w // merge_size**2 for t, h, w in self.grid_thw.tolist()]


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) rounded to multiples of `factor`, area within [min_pixels, max_pixels], aspect kept."""
    if min(height, width) <= 0:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image aspect ratio must be under 200, got {height}x{width}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def preprocess_images(
    images: Sequence[np.ndarray], spec: VisionPreprocessSpec = VisionPreprocessSpec()
) -> VisionInputs:
    """Patches of uint8 (H, W, 3) RGB images: PIL bicubic resize, rescale, normalise, each frame
    repeated over the temporal patch (as the image processor does)."""
    from PIL import Image

    patches, grids = [], []
    for image in images:
        _check_rgb(image, "image")
        h, w = smart_resize(
            image.shape[0], image.shape[1], spec.factor, spec.image_min_pixels, spec.image_max_pixels
        )
        resized = np.asarray(Image.fromarray(image).resize((w, h), resample=Image.BICUBIC))
        scaled = (resized.astype(np.float64) * (1 / 255)).astype(np.float32)
        normed = (scaled - np.array(spec.mean, np.float32)) / np.array(spec.std, np.float32)
        frames = torch.from_numpy(np.ascontiguousarray(normed.transpose(2, 0, 1)))[None]
        frames = frames.expand(spec.temporal_patch_size, -1, -1, -1)
        flat, grid = _patchify(frames, spec)
        patches.append(flat)
        grids.append(grid)
    return _stack(patches, grids)


def sample_frame_indices(
    total_frames: int, video_fps: float, fps: float, spec: VisionPreprocessSpec = VisionPreprocessSpec()
) -> np.ndarray:
    """Indices of the frames kept when sampling `fps` frames a second from a `video_fps` stream: an even
    count within [min_frames, max_frames], spread uniformly (the video processor's rule)."""
    if video_fps <= 0 or fps <= 0:
        raise ValueError(f"frame rates must be positive, got video fps {video_fps} and sampling fps {fps}")
    tp = spec.temporal_patch_size
    max_frames = math.floor(min(spec.max_frames, total_frames) / tp) * tp
    wanted = min(max(total_frames / video_fps * fps, spec.min_frames), max_frames, total_frames)
    count = math.floor(wanted / tp) * tp
    if count <= 0:
        raise ValueError(f"video has {total_frames} frames; at least {tp} are needed")
    return torch.arange(0, total_frames, total_frames / count).int().numpy()


def preprocess_videos(
    videos: Sequence[np.ndarray],
    video_fps: Sequence[float] | None = None,
    fps: float | None = None,
    spec: VisionPreprocessSpec = VisionPreprocessSpec(),
) -> VisionInputs:
    """Patches of uint8 (T, H, W, 3) videos. With `fps`, frames are first sampled at that rate (each
    video's own rate from `video_fps`); the last frame is repeated to fill the last temporal patch."""
    if fps is not None and (video_fps is None or len(video_fps) != len(videos)):
        raise ValueError("sampling at `fps` needs the frame rate of every video in `video_fps`")
    patches, grids = [], []
    for i, video in enumerate(videos):
        _check_rgb(video, "video", ndim=4)
        if fps is not None:
            video = video[sample_frame_indices(video.shape[0], float(video_fps[i]), fps, spec)]
        h, w = smart_resize(
            video.shape[1], video.shape[2], spec.factor, spec.video_min_pixels, spec.video_max_pixels
        )
        frames = _resize_frames(torch.from_numpy(np.ascontiguousarray(video)).permute(0, 3, 1, 2), h, w)
        mean = torch.tensor(spec.mean).view(1, 3, 1, 1) * 255.0
        std = torch.tensor(spec.std).view(1, 3, 1, 1) * 255.0
        flat, grid = _patchify((frames.float() - mean) / std, spec)
        patches.append(flat)
        grids.append(grid)
    seconds = (spec.temporal_patch_size / (fps if fps is not None else 1.0),) * len(grids)
    return _stack(patches, grids, seconds)


def _resize_frames(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 [T, C, H, W] -> uint8 [T, C, height, width], antialiased bicubic (torchvision's CPU path)."""
    if frames.shape[-2:] == (height, width):
        return frames
    return torch.nn.functional.interpolate(
        frames, size=(height, width), mode="bicubic", align_corners=False, antialias=True
    )


def _patchify(frames: torch.Tensor, spec: VisionPreprocessSpec) -> tuple[torch.Tensor, list[int]]:
    """[T, C, H, W] float -> ([t*h*w, C*tp*P*P], [t, h, w]); patches in 2x2 merge-block order."""
    tp, p, m = spec.temporal_patch_size, spec.patch_size, spec.merge_size
    if pad := -frames.shape[0] % tp:
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
    t, c = frames.shape[0] // tp, frames.shape[1]
    gh, gw = frames.shape[2] // p, frames.shape[3] // p
    x = frames.reshape(t, tp, c, gh // m, m, p, gw // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # t, block row, block col, in row, in col, C, tp, P, P
    return x.reshape(t * gh * gw, c * tp * p * p), [t, gh, gw]


def _stack(
    patches: list[torch.Tensor], grids: list[list[int]], seconds: tuple[float, ...] = ()
) -> VisionInputs:
    if not patches:
        raise ValueError("no images or videos to preprocess")
    return VisionInputs(torch.cat(patches).contiguous(), torch.tensor(grids, dtype=torch.int64), seconds)


def _check_rgb(array: np.ndarray, what: str, ndim: int = 3) -> None:
    if (
        not isinstance(array, np.ndarray)
        or array.ndim != ndim
        or array.shape[-1] != 3
        or array.dtype != np.uint8
    ):
        shape = "(T, H, W, 3)" if ndim == 4 else "(H, W, 3)"
        got = f"{type(array).__name__} {getattr(array, 'shape', '')} {getattr(array, 'dtype', '')}"
        raise ValueError(f"{what} must be a uint8 RGB array shaped {shape}, got {got}")

"""Media codecs: every audio format, images and MP4 encode and decode back faithfully."""

import io
import wave

import numpy as np
import pytest

from mstar.server.media import (
    AUDIO_FORMATS,
    DecodedAudio,
    MediaError,
    decode_audio,
    decode_image,
    decode_video,
    encode_audio,
    encode_image,
    encode_video,
    pcm_s16le,
    resample_audio,
    wav_stream_header,
)

RATE = 24000


def _tone(seconds=0.5, rate=RATE, channels=1):
    t = np.arange(int(seconds * rate)) / rate
    mono = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    return mono if channels == 1 else np.stack([mono, -mono], axis=1)


def _dominant_hz(samples, rate):
    spectrum = np.abs(np.fft.rfft(samples))
    return np.argmax(spectrum) * rate / len(samples)


@pytest.mark.parametrize("fmt", [f for f in AUDIO_FORMATS if f != "pcm"])
@pytest.mark.parametrize("channels", [1, 2])
def test_audio_formats_roundtrip(fmt, channels):
    src = _tone(channels=channels)
    out = decode_audio(encode_audio(src, RATE, fmt))
    assert out.sample_rate == RATE
    assert out.channels == channels
    n = src.shape[0]
    # Lossy codecs add encoder delay and pad to their frame size (AAC: 1024-sample frames).
    slack = 0 if fmt in ("wav", "flac", "mp3") else 2048
    assert n <= out.samples.shape[0] <= n + slack, (fmt, out.samples.shape)
    assert abs(_dominant_hz(out.samples[:, 0], RATE) - 440) < 5
    if fmt in ("wav", "flac"):
        np.testing.assert_allclose(out.samples[:, 0], src if channels == 1 else src[:, 0], atol=1e-4)


def test_pcm_is_s16le_and_wav_stream_header_parses():
    src = _tone(0.1)
    pcm = encode_audio(src, RATE, "pcm")
    assert pcm == pcm_s16le(src) and len(pcm) == 2 * len(src)
    np.testing.assert_allclose(np.frombuffer(pcm, "<i2") / 32767, src, atol=1e-4)
    with wave.open(io.BytesIO(wav_stream_header(RATE, 1) + pcm)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (RATE, 1, 2)


def test_opus_at_unsupported_rate_is_resampled_to_48k():
    out = decode_audio(encode_audio(_tone(0.5, rate=22050), 22050, "opus"))
    assert out.sample_rate == 48000 and abs(out.duration_s - 0.5) < 0.05


def test_unknown_audio_format_is_400():
    with pytest.raises(MediaError) as info:
        encode_audio(_tone(), RATE, "ogg-vorbis")
    assert info.value.status_code == 400 and "opus" in info.value.message


def test_decode_audio_resamples():
    out = decode_audio(encode_audio(_tone(0.5), RATE, "wav"), target_rate=16000)
    assert out.sample_rate == 16000 and out.samples.shape == (8000, 1)
    assert abs(_dominant_hz(out.mono(), 16000) - 440) < 5
    assert resample_audio(np.zeros((10, 2), np.float32), 100, 50).shape == (5, 2)


def test_corrupt_and_too_long_audio():
    with pytest.raises(MediaError) as info:
        decode_audio(b"RIFF\x00\x00garbage" * 30)
    assert info.value.status_code == 400
    from mstar.server.media import MediaPolicy

    with pytest.raises(MediaError) as info:
        decode_audio(encode_audio(_tone(1.0), RATE, "flac"), MediaPolicy(max_audio_seconds=0.5))
    assert info.value.status_code == 413


@pytest.mark.parametrize("fmt", ["flac", "wav", "aac"])  # soundfile reads the header; PyAV counts as it decodes
def test_audio_over_the_sample_limit_counts_channels(fmt):
    from mstar.server.media import MediaPolicy

    policy = MediaPolicy(max_audio_samples=int(1.5 * RATE))  # 1.5 s of mono
    assert decode_audio(encode_audio(_tone(1.0, channels=1), RATE, fmt), policy).samples.shape[1] == 1
    with pytest.raises(MediaError, match="frames x channels") as info:
        decode_audio(encode_audio(_tone(1.0, channels=2), RATE, fmt), policy)
    assert info.value.status_code == 413


def test_image_roundtrip_png_exact_jpeg_close():
    rng = np.random.default_rng(0)
    img = rng.integers(0, 255, (17, 23, 3), dtype=np.uint8)
    np.testing.assert_array_equal(decode_image(encode_image(img, "png")), img)
    smooth = np.zeros((16, 16, 3), np.uint8) + np.arange(16, dtype=np.uint8)[None, :, None] * 8
    jpeg = decode_image(encode_image(smooth, "jpeg", quality=95))
    assert jpeg.shape == (16, 16, 3) and np.abs(jpeg.astype(int) - smooth).max() < 12


def test_image_rgba_and_webp_gif_decode_to_rgb():
    from PIL import Image

    rgba = np.zeros((5, 7, 4), np.uint8)
    rgba[..., 0] = 255
    rgba[..., 3] = 255
    assert decode_image(encode_image(rgba, "png")).shape == (5, 7, 3)
    buf = io.BytesIO()
    Image.fromarray(np.full((5, 7, 3), 10, np.uint8)).save(buf, format="GIF")
    assert decode_image(buf.getvalue()).shape == (5, 7, 3)
    assert decode_image(encode_image(rgba[..., :3], "webp")).shape == (5, 7, 3)


def test_image_unsupported_corrupt_and_too_large():
    from PIL import Image

    from mstar.server.media import MediaPolicy

    buf = io.BytesIO()
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(buf, format="BMP")
    for data, status in ((buf.getvalue(), 400), (encode_image(np.zeros((4, 4, 3), np.uint8))[:40], 400)):
        with pytest.raises(MediaError) as info:
            decode_image(data)
        assert info.value.status_code == status
    with pytest.raises(MediaError) as info:
        decode_image(encode_image(np.zeros((20, 20, 3), np.uint8)), MediaPolicy(max_image_pixels=100))
    assert info.value.status_code == 413


def test_mp4_roundtrip_frame_count_fps_and_odd_size():
    frames = np.zeros((9, 31, 45, 3), np.uint8)
    frames[:, :, :, 1] = np.linspace(0, 250, 9, dtype=np.uint8)[:, None, None]
    video = decode_video(encode_video(frames, fps=12))
    assert video.frames.shape == (9, 32, 46, 3) and video.fps == pytest.approx(12)
    # Per-frame brightness survives H.264 closely enough to tell frames apart and in order.
    means = video.frames[:, :31, :45, 1].mean(axis=(1, 2))
    assert np.all(np.diff(means) > 10)
    assert decode_video(encode_video(frames, fps=12), max_frames=4).frames.shape[0] == 4


def test_mp4_with_audio_track():
    frames = np.zeros((8, 16, 16, 3), np.uint8)
    audio = DecodedAudio(_tone(1.0, channels=2), RATE)
    mp4 = encode_video(frames, fps=8, audio=audio)
    video = decode_video(mp4)
    assert video.frames.shape[0] == 8
    track = decode_audio(mp4)
    assert track.sample_rate == RATE and track.channels == 2 and abs(track.duration_s - 1.0) < 0.1
    # the video decodes with its sound (a processor hears it as mono); cut to the frames when they are cut
    assert video.audio is not None and np.array_equal(video.audio.samples, track.samples)
    item = video.media_item()
    assert item["sample_rate"] == RATE and item["audio"].shape == (track.samples.shape[0],)
    half = decode_video(mp4, max_frames=4).audio
    assert abs(half.duration_s - 0.5) < 1e-3
    silent = decode_video(encode_video(frames, fps=8))
    assert silent.audio is None and "audio" not in silent.media_item()


def test_video_over_the_pixel_limit_is_413():
    from mstar.server.media import MediaPolicy

    clip = encode_video(np.zeros((6, 32, 48, 3), np.uint8), 8.0)
    assert decode_video(clip, MediaPolicy(max_video_pixels=6 * 32 * 48)).frames.shape[0] == 6
    with pytest.raises(MediaError, match="frames x 48x32") as info:
        decode_video(clip, MediaPolicy(max_video_pixels=5 * 32 * 48))
    assert info.value.status_code == 413


def test_corrupt_video_is_400():
    with pytest.raises(MediaError) as info:
        decode_video(b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 100)
    assert info.value.status_code == 400


def test_a_small_flac_declaring_an_hour_of_48k_stereo_is_refused_from_its_header():
    import struct

    data = bytearray(encode_audio(_tone(0.1, rate=48000, channels=2), 48000, "flac"))
    assert data[:4] == b"fLaC" and data[4] & 0x7F == 0  # the first metadata block is STREAMINFO
    field = struct.unpack(">Q", data[18:26])[0]  # rate, channels, bits per sample, then 36 bits of frames
    data[18:26] = struct.pack(">Q", (field & ~((1 << 36) - 1)) | 48000 * 3600)
    with pytest.raises(MediaError, match="345600000 samples") as info:  # the header's count: 0.1 s is inside
        decode_audio(bytes(data))  # the default policy: an hour is allowed, 57.6 M decoded values are not
    assert info.value.status_code == 413 and len(data) < 50_000

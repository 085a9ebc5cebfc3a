"""What every example shares: the `--base-url` / `--model` arguments and small sample inputs (a PNG, a WAV,
camera frames), so each script runs without files of your own. `python examples/common.py` writes
input.png, input.wav and input.mp4 here for the curl lines in examples/README.md."""

from __future__ import annotations

import argparse
import io
import json
import os

import numpy as np

BASE_URL = "http://127.0.0.1:8000"


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser with --base-url and --model (the served model's name; "default" is whichever it is)."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=BASE_URL, help="the server, as `mstar serve` prints it")
    p.add_argument("--model", default="default", help="the served model's name (GET /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("MSTAR_API_KEY", "none"),
                   help="the server's key, if it has one (default: $MSTAR_API_KEY)")
    p.add_argument("--option", action="append", type=option, default=[], metavar="KEY=VALUE",
                   help="a model option sent with the request, e.g. num_inference_steps=4 (repeatable)")
    return p


def option(text: str) -> tuple[str, object]:
    """KEY=VALUE, the value read as JSON when it parses (numbers, lists, true), else as text."""
    key, equals, value = text.partition("=")
    if not equals or not key:
        raise argparse.ArgumentTypeError(f"want KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def sdk(args: argparse.Namespace):
    """The SDK client of `args.base_url` and `args.model`."""
    from mstar import MStarClient

    return MStarClient(args.base_url, api_key=args.api_key, model=None if args.model == "default" else args.model)


def frames(count: int = 4, height: int = 64, width: int = 64, seed: int = 0) -> np.ndarray:
    """`count` RGB frames [count, height, width, 3] uint8: a colour gradient that drifts right."""
    y, x = np.mgrid[0:height, 0:width]
    clip = [np.stack([(x * 4 + 8 * t + seed) % 256, y * 4 % 256, np.full_like(x, 128)], -1) for t in range(count)]
    return np.asarray(clip, dtype=np.uint8)


def png(height: int = 64, width: int = 64, seed: int = 0) -> bytes:
    """One sample frame as PNG bytes."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(frames(1, height, width, seed)[0]).save(buf, format="PNG")
    return buf.getvalue()


def wav(seconds: float = 1.0, rate: int = 16000) -> bytes:
    """A rising tone as 16-bit WAV bytes."""
    import soundfile as sf

    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    sf.write(buf, 0.4 * np.sin(2 * np.pi * (220 + 220 * t) * t), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def mp4(count: int = 8) -> bytes:
    """The sample frames as an H.264 MP4."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("h264", rate=8)
        stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
        for frame in frames(count):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return buf.getvalue()


def read_or(path: str | None, default: bytes) -> bytes:
    """The bytes of `path`, or `default` when no path was given."""
    if path is None:
        return default
    with open(path, "rb") as f:
        return f.read()


def save(path: str, data: bytes) -> None:
    """Write `data` to `path` and say so."""
    with open(path, "wb") as f:
        f.write(data)
    print(f"wrote {path} ({len(data)} bytes)")


if __name__ == "__main__":
    for name, data in (("input.png", png()), ("input.wav", wav()), ("input.mp4", mp4())):
        save(name, data)

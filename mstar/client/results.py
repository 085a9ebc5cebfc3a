"""What SDK calls return: audio buffers and collected /generate results."""

from __future__ import annotations

import io
import wave
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mstar.client.errors import MStarError
from mstar.server.media.decode import DecodedAudio
from mstar.server.protocol import (
    ActionChunk,
    AudioChunk,
    FinalChunk,
    ImageChunk,
    LogprobsChunk,
    OutputChunk,
    TextChunk,
    TokenLogprob,
    Usage,
    VideoChunk,
)


@dataclass(frozen=True)
class AudioBuffer(DecodedAudio):
    """Decoded audio: float32 `samples` shaped (frames, channels), values in [-1, 1] (the server's
    `DecodedAudio`, with the SDK's conversions)."""

    def to_numpy(self) -> np.ndarray:
        """float32 samples: 1-D for mono, (frames, channels) otherwise."""
        return self.samples[:, 0] if self.channels == 1 else self.samples

    def wav_bytes(self) -> bytes:
        """A 16-bit PCM WAV file."""
        pcm = (np.clip(self.samples, -1.0, 1.0) * 32767.0).round().astype("<i2")
        buf = io.BytesIO()
        with wave.open(buf, "wb") as w:
            w.setnchannels(self.channels)
            w.setsampwidth(2)
            w.setframerate(self.sample_rate)
            w.writeframes(pcm.tobytes())
        return buf.getvalue()

    def to_wav(self, path: str | Path) -> Path:
        """Write a 16-bit WAV file to `path` and return the path."""
        path = Path(path)
        path.write_bytes(self.wav_bytes())
        return path

    @classmethod
    def from_pcm16(cls, data: bytes, sample_rate: int, channels: int = 1) -> AudioBuffer:
        """From interleaved s16le PCM."""
        arr = np.frombuffer(data, "<i2").astype(np.float32) / 32768.0
        return cls(arr.reshape(-1, channels), sample_rate)

    @classmethod
    def from_file_bytes(cls, data: bytes) -> AudioBuffer:
        """From a WAV file (standard library) or any format soundfile reads, if it is installed."""
        if data[:4] == b"RIFF":
            with wave.open(io.BytesIO(data)) as w:
                if w.getsampwidth() == 2:
                    return cls.from_pcm16(w.readframes(w.getnframes()), w.getframerate(), w.getnchannels())
        try:
            import soundfile as sf
        except ImportError:
            raise MStarError(0, "decoding non-WAV audio needs soundfile: pip install soundfile") from None
        samples, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
        return cls(samples, int(rate))

    @classmethod
    def concat(cls, pieces: Iterable[AudioBuffer]) -> AudioBuffer:
        """Join pieces of one stream (same rate and channel count) in order."""
        pieces = list(pieces)
        if not pieces:
            raise ValueError("AudioBuffer.concat needs at least one piece")
        rates = {p.sample_rate for p in pieces}
        if len(rates) != 1:
            raise ValueError(f"cannot join audio of different sample rates {sorted(rates)}")
        return cls(np.concatenate([p.samples for p in pieces], axis=0), pieces[0].sample_rate)


@dataclass
class GenerateResult:
    """Everything one /generate request produced, grouped by output name, in sequence order."""

    request_id: str | None
    outputs: dict[str, list[OutputChunk]]
    finish_reason: str
    usage: Usage = field(default_factory=Usage)

    def text_of(self, output: str) -> str:
        return "".join(c.delta for c in self.outputs.get(output, []) if isinstance(c, TextChunk))

    @property
    def text(self) -> str:
        """The `text` output, else the first output that holds text ("" if none)."""
        if "text" in self.outputs:
            return self.text_of("text")
        for name, chunks in self.outputs.items():
            if any(isinstance(c, TextChunk) for c in chunks):
                return self.text_of(name)
        return ""

    def audio_of(self, output: str) -> AudioBuffer | None:
        pieces = [c for c in self.outputs.get(output, []) if isinstance(c, AudioChunk)]
        if not pieces:
            return None
        return AudioBuffer.concat(AudioBuffer(c.to_numpy(), c.sample_rate) for c in pieces)

    @property
    def audio(self) -> AudioBuffer | None:
        """The first audio output, its chunks joined."""
        for name, chunks in self.outputs.items():
            if any(isinstance(c, AudioChunk) for c in chunks):
                return self.audio_of(name)
        return None

    @property
    def images(self) -> list:
        """Every image, as PIL images (needs Pillow)."""
        return [c.to_pil() for chunks in self.outputs.values() for c in chunks if isinstance(c, ImageChunk)]

    @property
    def videos(self) -> list[bytes]:
        """Every video, as MP4 bytes."""
        return [c.mp4_bytes() for chunks in self.outputs.values() for c in chunks if isinstance(c, VideoChunk)]

    @property
    def logprobs(self) -> list[TokenLogprob]:
        """Each generated token's log-probability and alternatives (option `logprobs`, output "logprobs")."""
        return [t for chunks in self.outputs.values() for c in chunks if isinstance(c, LogprobsChunk)
                for t in c.content]

    @property
    def actions(self) -> list[np.ndarray]:
        return [c.to_numpy() for chunks in self.outputs.values() for c in chunks if isinstance(c, ActionChunk)]


def collect(chunks: Iterable[OutputChunk | FinalChunk], request_id: str | None = None) -> GenerateResult:
    """Gather a stream of chunks into a `GenerateResult`, checking each output's sequence numbers."""
    outputs: dict[str, list[OutputChunk]] = {}
    final: FinalChunk | None = None
    for chunk in chunks:
        if isinstance(chunk, FinalChunk):
            final = chunk
        else:
            outputs.setdefault(chunk.output, []).append(chunk)
    if final is None:
        raise MStarError(502, "the stream ended without a final chunk (connection cut or server bug)")
    return GenerateResult(final.request_id or request_id, _in_order(outputs), final.finish_reason, final.usage)


def _in_order(outputs: dict[str, list[OutputChunk]]) -> dict[str, list[OutputChunk]]:
    ordered = {}
    for name, chunks in outputs.items():
        chunks = sorted(chunks, key=lambda c: c.seq)
        if [c.seq for c in chunks] != list(range(len(chunks))):
            raise MStarError(502, f"output {name!r} has missing or repeated chunks: seq {[c.seq for c in chunks]}")
        ordered[name] = chunks
    return ordered

"""Media input and output for the HTTP edge: safe loading, decoding and encoding.

`sources` turns a client reference into bytes under a `MediaPolicy` (no local files, remote fetch off
by default); `decode` turns bytes into arrays; `encode` turns model outputs into container bytes.
Decoders and encoders are CPU-bound and synchronous: call them from a thread pool in async code.
"""

from mstar.server.media.decode import (
    IMAGE_FORMATS,
    DecodedAudio,
    DecodedVideo,
    decode_audio,
    decode_image,
    decode_pcm16,
    decode_video,
    resample_audio,
)
from mstar.server.media.encode import (
    AUDIO_FORMATS,
    AUDIO_MIME,
    encode_audio,
    encode_image,
    encode_video,
    pcm_s16le,
    warm_encoders,
    wav_stream_header,
)
from mstar.server.media.sources import MediaError, MediaPolicy, load_media_bytes

__all__ = [
    "AUDIO_FORMATS",
    "AUDIO_MIME",
    "IMAGE_FORMATS",
    "DecodedAudio",
    "DecodedVideo",
    "MediaError",
    "MediaPolicy",
    "decode_audio",
    "decode_image",
    "decode_pcm16",
    "decode_video",
    "encode_audio",
    "encode_image",
    "encode_video",
    "load_media_bytes",
    "pcm_s16le",
    "warm_encoders",
    "resample_audio",
    "wav_stream_header",
]

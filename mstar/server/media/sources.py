"""Turning a client-supplied media reference into bytes, safely.

Accepted sources: raw bytes, a `data:` URL, bare base64, and (only when a `MediaPolicy` allows it)
an http(s) URL. Local file paths and `file://` URLs are never read: a client must not be able to make
the server open its own files. Every failure raises `MediaError` with an HTTP status code.
"""

from __future__ import annotations

import base64
import binascii
import logging
import re
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

from mstar.config import LimitsConfig

logger = logging.getLogger(__name__)

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.\-]*):")
_DATA_URL = re.compile(r"^data:(?P<mime>[^;,]*)(?P<params>(;[^;,]*)*),(?P<payload>.*)$", re.DOTALL)
_MAX_REDIRECTS = 3
_B64 = re.compile(r"[A-Za-z0-9+/]+={0,2}")
_B64_URLSAFE = re.compile(r"[A-Za-z0-9_\-]+={0,2}")


class MediaError(Exception):
    """A media input or output could not be handled; `status_code` is the HTTP status to answer."""

    def __init__(self, status_code: int, message: str):
        super().__init__(message)
        self.status_code = status_code
        self.message = message

    def __repr__(self) -> str:
        return f"MediaError({self.status_code}, {self.message!r})"


@dataclass(frozen=True)
class MediaPolicy:
    """What the server accepts as media input.

    Remote fetching is off unless `allow_remote` is set; with it on, `allowed_hosts` (exact host
    names, or `.example.com` for a domain and its subdomains) limits the hosts, and an empty tuple
    allows any host. `max_bytes` bounds every input, inline or fetched, before decoding.
    """

    allow_remote: bool = False  # fetch http(s) URLs at all
    allowed_hosts: tuple[str, ...] = ()  # empty: any host (only when allow_remote)
    max_bytes: int = LimitsConfig.max_media_bytes  # per input, encoded size
    timeout_s: float = 10.0  # per remote fetch, connect and each read
    max_image_pixels: int = LimitsConfig.max_image_pixels  # width * height; guards against decompression bombs
    max_audio_seconds: float = LimitsConfig.max_audio_seconds  # decoded duration bound
    max_audio_samples: int = LimitsConfig.max_audio_samples  # decoded frames x channels
    max_video_pixels: int = LimitsConfig.max_video_pixels  # decoded frames x width x height

    @classmethod
    def from_limits(cls, limits: LimitsConfig) -> MediaPolicy:
        """The policy a config's `limits` section sets (remote fetching stays off)."""
        return cls(max_bytes=limits.max_media_bytes, max_image_pixels=limits.max_image_pixels,
                   max_audio_seconds=limits.max_audio_seconds, max_audio_samples=limits.max_audio_samples,
                   max_video_pixels=limits.max_video_pixels)

    def __post_init__(self) -> None:
        if self.max_bytes <= 0:
            raise ValueError(f"MediaPolicy.max_bytes must be > 0, got {self.max_bytes}")
        if self.timeout_s <= 0:
            raise ValueError(f"MediaPolicy.timeout_s must be > 0, got {self.timeout_s}")
        if isinstance(self.allowed_hosts, str):
            raise ValueError(
                f"MediaPolicy.allowed_hosts must be a tuple of host names, got the string "
                f"{self.allowed_hosts!r}; write ({self.allowed_hosts!r},)"
            )

    def host_allowed(self, host: str) -> bool:
        """True when `host` may be fetched under this policy."""
        if not self.allow_remote:
            return False
        if not self.allowed_hosts:
            return True
        host = host.lower().rstrip(".")
        for allowed in self.allowed_hosts:
            allowed = allowed.lower()
            if allowed.startswith(".") and (host == allowed[1:] or host.endswith(allowed)):
                return True
            if host == allowed:
                return True
        return False


DEFAULT_POLICY = MediaPolicy()


def load_media_bytes(source: str | bytes | bytearray | memoryview, policy: MediaPolicy | None = None) -> bytes:
    """Return the bytes behind `source` (bytes, data URL, base64 or an allowed http(s) URL).

    Raises `MediaError`: 400 for malformed input or a local path / `file://`, 403 for a remote URL
    the policy does not allow, 413 when the input exceeds `policy.max_bytes`.
    """
    policy = policy or DEFAULT_POLICY
    if isinstance(source, bytes | bytearray | memoryview):
        data = bytes(source)
        _check_size(len(data), policy)
        return data
    if not isinstance(source, str):
        raise MediaError(400, f"media must be bytes or a string, got {type(source).__name__}")
    text = source.strip()
    if not text:
        raise MediaError(400, "media input is empty")
    if text.startswith("data:"):
        return _decode_data_url(text, policy)
    scheme = _SCHEME.match(text)
    if scheme and len(scheme.group(1)) > 1:  # one letter is a Windows drive ("C:\...")
        return _load_url(text, scheme.group(1).lower(), policy)
    return _decode_base64(text, policy, what="media")


def _check_size(n: int, policy: MediaPolicy) -> None:
    if n > policy.max_bytes:
        raise MediaError(413, f"media input is {n} bytes, over the limit of {policy.max_bytes} bytes")


def _decode_data_url(url: str, policy: MediaPolicy) -> bytes:
    m = _DATA_URL.match(url)
    if m is None:
        raise MediaError(400, "malformed data URL: expected data:<mime>;base64,<payload>")
    params = [p.strip().lower() for p in m.group("params").split(";") if p.strip()]
    if "base64" not in params:
        raise MediaError(400, "data URL must be base64-encoded (data:<mime>;base64,<payload>)")
    return _decode_base64(m.group("payload"), policy, what="data URL payload")


def _decode_base64(text: str, policy: MediaPolicy, what: str) -> bytes:
    compact = "".join(text.split())
    # 4 base64 characters carry 3 bytes: refuse oversized input before decoding it.
    _check_size(len(compact) * 3 // 4, policy)
    if _B64.fullmatch(compact):
        decode = base64.b64decode
    elif _B64_URLSAFE.fullmatch(compact):
        decode = base64.urlsafe_b64decode
    else:
        raise MediaError(
            400,
            f"{what} is neither a data URL, base64, nor an http(s) URL; "
            "local file paths and file:// URLs are never read by the server",
        )
    body = compact.rstrip("=")
    try:
        data = decode(body + "=" * (-len(body) % 4))
    except (binascii.Error, ValueError):
        raise MediaError(400, f"{what} is not valid base64 (bad length)") from None
    if not data:
        raise MediaError(400, f"{what} decodes to zero bytes")
    return data


def _load_url(url: str, scheme: str, policy: MediaPolicy) -> bytes:
    if scheme == "file":
        raise MediaError(400, "file:// URLs are never read by the server; send the bytes as a data URL or base64")
    if scheme not in ("http", "https"):
        raise MediaError(400, f"unsupported URL scheme {scheme!r}; use a data URL, base64, or http(s)")
    if not policy.allow_remote:
        raise MediaError(
            403, "fetching remote media URLs is disabled on this server; send the bytes as a data URL or base64"
        )
    return _fetch_remote(url, policy)


def _fetch_remote(url: str, policy: MediaPolicy) -> bytes:
    import httpx

    try:
        with httpx.Client(timeout=policy.timeout_s, follow_redirects=False) as client:
            for _ in range(_MAX_REDIRECTS + 1):
                _check_host(url, policy)
                with client.stream("GET", url) as resp:
                    if resp.is_redirect and "location" in resp.headers:
                        url = urljoin(url, resp.headers["location"])
                        continue
                    return _read_capped(resp, url, policy)
    except httpx.TimeoutException:
        raise MediaError(400, f"fetching {url} timed out after {policy.timeout_s} s") from None
    except httpx.HTTPError as exc:
        raise MediaError(400, f"fetching {url} failed: {exc}") from None
    raise MediaError(400, f"fetching media: more than {_MAX_REDIRECTS} redirects")


def _check_host(url: str, policy: MediaPolicy) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise MediaError(400, f"unsupported media URL {url!r}")
    if not policy.host_allowed(parts.hostname):
        raise MediaError(403, f"host {parts.hostname!r} is not in the allowed media hosts")


def _read_capped(resp, url: str, policy: MediaPolicy) -> bytes:
    if resp.status_code != 200:
        raise MediaError(400, f"fetching {url} returned HTTP {resp.status_code}")
    declared = resp.headers.get("content-length")
    if declared and declared.isdigit():
        _check_size(int(declared), policy)
    buf = bytearray()
    for piece in resp.iter_bytes():
        buf.extend(piece)
        # Stop while streaming: a lying or absent Content-Length must not let a body grow unbounded.
        _check_size(len(buf), policy)
    logger.debug("fetched %d bytes from %s", len(buf), url)
    return bytes(buf)

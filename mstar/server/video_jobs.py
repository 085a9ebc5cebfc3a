"""Video generation jobs: a bounded in-memory store and the asyncio task that runs one job.

A job owns one model request. Its task reads the request's outputs: `progress` values (the
convention of `mstar/models/base.py`) move `progress`, the last `video` output is kept with the
`audio` pieces, and at the end the clip is encoded to MP4 (audio muxed in when there is some).
The store keeps at most `max_jobs` jobs; when full, the oldest finished job is evicted, and when
every kept job is still running a new one is refused with 429. At most `max_running` jobs run at
once (a share of the server's request slots), so video jobs cannot starve chat.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
from starlette.concurrency import run_in_threadpool

from mstar.server.adapters import RequestError, RequestStream
from mstar.server.media import DecodedAudio, MediaError, encode_image, encode_video
from mstar.server.protocol_openai_media import VideoJob, VideoJobError

logger = logging.getLogger(__name__)
DEFAULT_MAX_JOBS = 64
FINISHED = ("completed", "failed")


@dataclass
class VideoRecord:
    """One job: its public object, its running task and, once completed, its files."""

    job: VideoJob
    fps: float
    sample_rate: int
    task: asyncio.Task | None = None
    mp4: bytes | None = None
    thumbnail_png: bytes | None = None
    finished_at: float | None = None
    _audio: list[np.ndarray] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.job.status in FINISHED


class VideoJobStore:
    """Jobs by id, oldest first. Not thread-safe: used from the event loop only."""

    def __init__(self, max_jobs: int = DEFAULT_MAX_JOBS, max_running: int = DEFAULT_MAX_JOBS) -> None:
        if max_jobs < 1 or max_running < 1:
            raise ValueError(f"max_jobs and max_running must be >= 1, got {max_jobs} and {max_running}")
        self.max_jobs, self.max_running = max_jobs, max_running
        self._jobs: OrderedDict[str, VideoRecord] = OrderedDict()

    def __len__(self) -> int:
        return len(self._jobs)

    def make_room(self) -> None:
        """Evict the oldest finished jobs until one more fits; 429 when every kept job still runs or
        `max_running` jobs run."""
        running = sum(not rec.finished for rec in self._jobs.values())
        if running >= self.max_running:
            raise RequestError(429, f"{running} video jobs are running, the most this server runs at once; "
                                    "retry when one finishes", headers={"Retry-After": "5"})
        while len(self._jobs) >= self.max_jobs:
            oldest = next((jid for jid, rec in self._jobs.items() if rec.finished), None)
            if oldest is None:
                raise RequestError(429, f"{len(self._jobs)} video jobs are running, the most this server keeps; "
                                        "retry when one finishes")
            del self._jobs[oldest]

    def add(self, record: VideoRecord) -> None:
        self.make_room()
        self._jobs[record.job.id] = record

    def get(self, job_id: str) -> VideoRecord:
        """The job, or RequestError(404) naming the id."""
        record = self._jobs.get(job_id)
        if record is None:
            raise RequestError(404, f"no video job {job_id!r}: it never existed, was deleted, or was evicted "
                                    f"(this server keeps the last {self.max_jobs} jobs)", "video_id")
        return record

    def page(self, after: str | None, limit: int, order: str) -> tuple[list[VideoRecord], bool]:
        """Up to `limit` jobs after the job `after`, by creation time (`order` asc or desc)."""
        records = list(self._jobs.values())
        if order == "desc":
            records.reverse()
        if after is not None:
            ids = [r.job.id for r in records]
            if after not in ids:
                raise RequestError(404, f"no video job {after!r} to list after", "after")
            records = records[ids.index(after) + 1:]
        return records[:limit], len(records) > limit

    def delete(self, job_id: str) -> VideoRecord:
        """Remove the job; a running one is cancelled (its model request too)."""
        record = self.get(job_id)
        del self._jobs[job_id]
        if record.task is not None and not record.task.done():
            record.task.cancel()
        return record


async def run_job(record: VideoRecord, stream: RequestStream) -> None:
    """Drive one job's request to the end and fill in the record. Never raises, but a cancelled task
    (DELETE) re-raises CancelledError after cancelling the model request."""
    video = None
    try:
        async for item in stream:
            if record.job.status == "queued":
                record.job.status = "in_progress"
            if item.name == "progress":
                value = float(np.clip(np.asarray(item.value, dtype=np.float64).reshape(-1)[-1], 0.0, 1.0))
                record.job.progress = max(record.job.progress, min(99, int(value * 100)))
            elif item.name == "video":
                video = np.asarray(item.value)
            elif item.name == "audio":
                record._audio.append(_frames_by_channels(np.asarray(item.value, dtype=np.float32)))
        if video is None:
            raise RequestError(500, "the model produced no video for this request")
        await run_in_threadpool(_encode, record, video)
        record.job.status, record.job.progress = "completed", 100
    except RequestError as exc:
        _fail(record, "generation_failed", exc.message)
    except MediaError as exc:
        _fail(record, "encoding_failed", exc.message)
    except Exception as exc:  # the job's boundary: log it, fail the job, keep the server
        logger.exception("video job %s failed", record.job.id)
        _fail(record, "internal_error", f"{type(exc).__name__}: {exc}")
    finally:
        stream.close()
        record.finished_at = time.time()
        if record.finished:
            record.job.completed_at = int(record.finished_at)


def _frames_by_channels(samples: np.ndarray) -> np.ndarray:
    """A piece of audio as [frames, channels]: a 2-D piece is that already (stereo sound), any other is mono."""
    return samples if samples.ndim == 2 else samples.reshape(-1, 1)


def _fail(record: VideoRecord, code: str, message: str) -> None:
    record.job.status = "failed"
    record.job.error = VideoJobError(code=code, message=message)


def _encode(record: VideoRecord, video: np.ndarray) -> None:
    """MP4 (with the audio, if any) and a PNG thumbnail of the first frame."""
    if video.dtype != np.uint8 or video.ndim != 4 or video.shape[-1] != 3:
        raise MediaError(500, f"the model's video must be uint8 (T, H, W, 3), got {video.dtype} {video.shape}")
    audio = None
    if record._audio:
        samples = np.concatenate(record._audio)
        audio = DecodedAudio(samples, record.sample_rate) if samples.size else None
    record.mp4 = encode_video(video, record.fps, audio)
    record.thumbnail_png = encode_image(video[0], "png")
    record._audio = []
    height, width = video.shape[1] + video.shape[1] % 2, video.shape[2] + video.shape[2] % 2  # H.264 pads to even
    record.job.size = f"{width}x{height}"
    record.job.seconds = f"{video.shape[0] / record.fps:g}"

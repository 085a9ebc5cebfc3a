"""The `route` label of mstar_http_responses_total stays bounded: known paths, video job paths with
their id folded into `{video_id}`, everything else 'other'."""

from __future__ import annotations

import pytest

from mstar.server.middleware import _route


@pytest.mark.parametrize("path", ["/v1/images/edits", "/v1/audio/transcriptions", "/v1/videos", "/v1/videos/generations",
                                  "/generate",
                                  "/v1/chat/completions", "/v1/audio/speech", "/health"])
def test_known_paths_are_their_own_label(path):
    assert _route(path) == path


@pytest.mark.parametrize("path,label", [
    ("/v1/videos/video-abc123", "/v1/videos/{video_id}"),
    ("/v1/videos/video-abc123/content", "/v1/videos/{video_id}/content"),
    ("/v1/videos/video-abc123/other", "other"),
    ("/v1/videos//content", "other"),
    ("/v1/videos/a/content/more", "other"),
    ("/v1/imagesx", "other"),
    ("/", "other"),
])
def test_video_ids_are_folded_and_unknown_paths_are_other(path, label):
    assert _route(path) == label

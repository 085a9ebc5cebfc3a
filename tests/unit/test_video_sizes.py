"""OpenAI sizes on video models: Wan2.2 rounds each side of `size` to its multiple of 32 (OpenAI's
"720x1280" gives 704x1280, the size the video job then names); explicit `width`/`height` and the models
that refuse odd sizes (Cosmos3, BAGEL) still answer a 400 naming the nearest multiple."""

from __future__ import annotations

import pytest

from mstar.models.common.video_options import video_size
from mstar.models.wan22.processor import Wan22Defaults, resolve_options


def wan_size(options: dict) -> tuple[int, int]:
    resolved = resolve_options(options, Wan22Defaults(width=64, height=64, num_frames=5, fps=16.0))
    return resolved["width"], resolved["height"]


def test_wan22_snaps_an_openai_size_to_its_multiple():
    assert wan_size({"size": "720x1280"}) == (704, 1280)
    assert wan_size({"size": "10x40"}) == (32, 32)
    with pytest.raises(ValueError, match="width=720 must be a multiple of 32; try 704"):
        wan_size({"width": 720, "height": 1280})


def test_without_snap_an_odd_size_is_refused_with_the_nearest_multiple():
    with pytest.raises(ValueError, match="width=720 must be a multiple of 32"):
        video_size({"size": "720x1280"}, 64, 64, 32, 4096)
    assert video_size({"size": "720x1280"}, 64, 64, 16, 4096) == (720, 1280)


def test_a_clip_longer_than_the_longest_the_model_makes_is_refused():
    """Its length in seconds drives Cosmos3's sound track and positions: 5 frames at 0.001 fps are 5,000 s."""
    defaults = Wan22Defaults(width=64, height=64, num_frames=5, fps=16.0)  # at most 1025 frames at 16 fps: 64 s
    for fps in (0.001, 0.07):  # 5,000 s and 71 s
        with pytest.raises(ValueError, match="fps"):
            resolve_options({"num_frames": 5, "fps": fps}, defaults)
    assert resolve_options({"num_frames": 5, "fps": 0.1}, defaults)["num_frames"] == 5  # 50 s


def test_seconds_and_num_frames_together_are_refused_not_one_ignored():
    defaults = Wan22Defaults(width=64, height=64, num_frames=5, fps=16.0)
    with pytest.raises(ValueError, match="seconds=4 and num_frames=5"):
        resolve_options({"num_frames": 5, "seconds": 4}, defaults)
    assert resolve_options({"seconds": 1}, defaults)["num_frames"] == 17

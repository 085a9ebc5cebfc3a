"""OpenAI sizes on video models: Wan2.2 rounds each side of `size` to its multiple of 32 (OpenAI's
"720x1280" gives 704x1280, the size the video job then names); explicit `width`/`height` and the models
that refuse odd sizes (Cosmos3, BAGEL) still answer a 400 naming the nearest multiple."""

from __future__ import annotations

import pytest

from mstar.models.bagel.processor import BagelDefaults, Resize
from mstar.models.bagel.processor import resolve_options as resolve_bagel
from mstar.models.common.video_options import video_size
from mstar.models.cosmos3.options import Cosmos3Defaults
from mstar.models.cosmos3.options import resolve_generation as resolve_cosmos3
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
    defaults = Wan22Defaults(width=64, height=64, num_frames=5, fps=16.0)  # at most 121 frames at 16 fps: 7.6 s
    for fps in (0.001, 0.5):  # 5,000 s and 10 s
        with pytest.raises(ValueError, match="fps"):
            resolve_options({"num_frames": 5, "fps": fps}, defaults)
    assert resolve_options({"num_frames": 5, "fps": 1.0}, defaults)["num_frames"] == 5  # 5 s


def test_seconds_and_num_frames_together_are_refused_not_one_ignored():
    defaults = Wan22Defaults(width=64, height=64, num_frames=5, fps=16.0)
    with pytest.raises(ValueError, match="seconds=4 and num_frames=5"):
        resolve_options({"num_frames": 5, "seconds": 4}, defaults)
    assert resolve_options({"seconds": 1}, defaults)["num_frames"] == 17


WAN_FULL = Wan22Defaults(width=1280, height=704, num_frames=121, fps=24.0)
COSMOS_FULL = Cosmos3Defaults(width=1280, height=720, num_frames=189, fps=24.0, num_inference_steps=35,
                              guidance_scale=6.0)


def cosmos(options: dict) -> dict:
    return cosmos_with(COSMOS_FULL, options)


@pytest.mark.parametrize("resolve", [lambda o: resolve_options(o, WAN_FULL), cosmos], ids=["wan22", "cosmos3"])
@pytest.mark.parametrize(("options", "message"), [
    ({"size": "4096x4096"}, "size=4096x4096 has 16777216 pixels per frame, more than the"),
    ({"width": 1920, "height": 1088}, "size=1920x1088 has 2088960 pixels per frame"),
    ({"num_frames": 1025}, r"num_frames must be an integer in \[1, 1\d\d\], got 1025"),
    ({"seconds": 60}, r"num_frames must be an integer in \[1, 1\d\d\], got 1441"),
    ({"num_inference_steps": 1000}, r"num_inference_steps must be an integer in \[1, 200\], got 1000"),
])
def test_a_request_beyond_what_the_model_was_trained_for_is_refused(resolve, options, message):
    """The QA request (4096x4096, 1025 frames, 1000 steps) would hold a worker for hours: each bound is a 400
    naming the field, its limit and the value."""
    with pytest.raises(ValueError, match=message):
        resolve(options)


def test_the_trained_sizes_and_lengths_are_accepted():
    for size in ("1280x704", "704x1280", "720x1280", "1280x720"):  # Wan2.2 snaps 720 to 704
        assert resolve_options({"size": size, "num_inference_steps": 200}, WAN_FULL)["num_frames"] == 121
    for size in ("1280x720", "720x1280", "960x960", "1104x832", "1280x704"):  # Cosmos3's tiers
        assert cosmos({"size": size, "num_inference_steps": 200})["num_frames"] == 189
    assert resolve_options({"seconds": 5}, WAN_FULL)["num_frames"] == 121
    assert cosmos({"num_frames": 1, "size": "960x960"})["num_frames"] == 1


def test_bagel_steps_are_bounded():
    defaults = BagelDefaults(1024, 1024, 1024, Resize(1024, 512, 16), Resize(980, 224, 14))
    with pytest.raises(ValueError, match=r"num_inference_steps must be an integer in \[2, 200\], got 1000"):
        resolve_bagel({"modalities": ["image"], "num_inference_steps": 1000}, defaults)
    with pytest.raises(ValueError, match=r"height must be an integer in \[16, 1024\], got 2048"):
        resolve_bagel({"modalities": ["image"], "size": "1024x2048"}, defaults)
    assert resolve_bagel({"modalities": ["image"], "num_inference_steps": 200}, defaults)["width"] == 1024


def test_a_deployment_may_raise_the_bounds_in_its_serve_config():
    """model_kwargs.max_frames / max_pixels raise a bound; a default beyond the bounds fails at start, naming the key."""
    from mstar.models.wan22.model import Wan22ServeConfig
    from mstar.models.wan22.processor import defaults_for

    longer = defaults_for(Wan22ServeConfig(max_frames=241, max_pixels=1920 * 1088))
    assert resolve_options({"num_frames": 241, "size": "1920x1088"}, longer)["num_frames"] == 241
    with pytest.raises(ValueError, match=r"num_frames must be an integer in \[1, 241\], got 245"):
        resolve_options({"num_frames": 245}, longer)
    with pytest.raises(ValueError, match="default num_frames=241 is more than max_frames=121; raise model_kwargs"):
        defaults_for(Wan22ServeConfig(num_frames=241))
    with pytest.raises(ValueError, match="default size 1920x1088 has more than max_pixels=901120"):
        defaults_for(Wan22ServeConfig(width=1920, height=1088))
    with pytest.raises(ValueError, match="wan22 model_kwargs.max_frames=0 must be a positive integer"):
        Wan22ServeConfig(max_frames=0)


def test_cosmos3_reads_its_bounds_from_the_serve_config():
    from mstar.models.registry import get_model_class

    cls = get_model_class("cosmos3")
    defaults = cls(cls.make_config(tiny=True, max_frames=9)).request_defaults()
    assert cosmos_with(defaults, {"num_frames": 9})["num_frames"] == 9
    with pytest.raises(ValueError, match=r"num_frames must be an integer in \[1, 9\], got 13"):
        cosmos_with(defaults, {"num_frames": 13})
    with pytest.raises(ValueError, match="cosmos3 model_kwargs.max_pixels=-1 must be a positive integer"):
        cls.make_config(tiny=True, max_pixels=-1)


def cosmos_with(defaults, options: dict) -> dict:
    return vars(resolve_cosmos3(options, defaults, policy=False))

"""Wan2.2 through our runtime (MStar, inproc) against diffusers' pipelines with the same random tiny
weights and seed: latents after every step and decoded frames; batching, joining and cancellation."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from tests.models.wan22_testing import (
    NEGATIVE,
    PROMPTS,
    outputs_of,
    reference_pipeline,
    run_reference,
    write_pipeline_dir,
)

pytest.importorskip("diffusers")

from mstar.runtime.offline import MStar  # noqa: E402

LATENT_TOL, FRAME_TOL = 1e-4, 1e-3
DEBUG = {"negative_prompt": NEGATIVE, "width": 64, "height": 64, "num_frames": 9, "guidance_scale": 5.0,
         "debug_outputs": True}


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return write_pipeline_dir(tmp_path_factory.mktemp("wan22_pipeline"))


@pytest.fixture(scope="module")
def runtime(root):
    with MStar("wan22", tiny=True, model_path=str(root)) as m:
        yield m


def _ours(m, prompt: str, steps: int, seed: int, **extra) -> dict:
    return outputs_of(m.submit({"text": prompt, **extra}, num_inference_steps=steps, seed=seed, **DEBUG).result())


def _assert_matches(ours: dict, steps: list[torch.Tensor], frames: torch.Tensor) -> None:
    assert len(ours["steps"]) == len(steps)
    for i, (got, want) in enumerate(zip(ours["steps"], steps, strict=True)):
        torch.testing.assert_close(got, want, atol=LATENT_TOL, rtol=0, msg=f"latents after step {i}")
    assert ours["frames"].shape == frames.shape == (9, 64, 64, 3)
    torch.testing.assert_close(ours["frames"], frames, atol=FRAME_TOL, rtol=0)
    assert frames.std() > 0.01  # frames are not a flat colour


def test_text_to_video_matches_wan_pipeline(root, runtime, monkeypatch):
    steps, frames = run_reference(reference_pipeline(root, monkeypatch, False), steps=3, seed=11, prompt=PROMPTS[0])
    ours = _ours(runtime, PROMPTS[0], 3, 11)
    _assert_matches(ours, steps, frames)
    assert ours["video"].dtype == torch.uint8 and ours["video"].shape == (9, 64, 64, 3)
    assert (ours["video"].float() - frames * 255).abs().max() <= 1.0


def test_image_to_video_matches_wan_i2v_pipeline(root, runtime, monkeypatch):
    from PIL import Image

    pixels = (torch.rand(64, 64, 3, generator=torch.Generator().manual_seed(13)) * 255).to(torch.uint8).numpy()
    pipe = reference_pipeline(root, monkeypatch, True)
    steps, frames = run_reference(pipe, steps=3, seed=14, prompt=PROMPTS[1], image=Image.fromarray(pixels))
    ours = _ours(runtime, PROMPTS[1], 3, 14, media=[{"type": "image", "data": pixels}])
    _assert_matches(ours, steps, frames)
    t2v = _ours(runtime, PROMPTS[1], 3, 14)
    assert (t2v["steps"][-1] - steps[-1]).abs().max() > 1e-2  # the image really conditions the video


def test_batched_and_joining_requests_get_what_they_get_alone(runtime, monkeypatch):
    """Three prompts: one starts, two join after its first step; each equals its run alone, and the
    DiT really ran rows of several requests (and both branches) in one forward."""
    from mstar.models.wan22.components import DiTComponent

    alone = [_ours(runtime, p, 4, 20 + i) for i, p in enumerate(PROMPTS)]
    rows: list[int] = []
    original = DiTComponent.run_items
    in_second_forward, joined = threading.Event(), threading.Event()

    def run_items(self, items):
        rows.append(len(items))
        if len(rows) == 2:  # the first request's second step waits here until the others are submitted,
            in_second_forward.set()  # so they join its later steps however slow this machine is
            joined.wait(10)
        return original(self, items)

    monkeypatch.setattr(DiTComponent, "run_items", run_items)
    first = runtime.submit({"text": PROMPTS[0]}, num_inference_steps=4, seed=20, report_progress=True, **DEBUG)
    events = []
    reader = threading.Thread(target=lambda: events.extend(first))
    reader.start()
    assert in_second_forward.wait(30)
    late = [runtime.submit({"text": p}, num_inference_steps=4, seed=20 + i, **DEBUG) for i, p in enumerate(PROMPTS)
            if i > 0]
    joined.set()
    reader.join()
    together = [{"steps": [e.value for e in events if e.name == "step_latents"],
                 "frames": next(e.value for e in events if e.name == "frames")}]
    together += [outputs_of(h.result()) for h in late]
    for i, (got, want) in enumerate(zip(together, alone, strict=True)):
        for a, b in zip(got["steps"], want["steps"], strict=True):
            # batch composition changes float32 summation order: 1e-5-level noise, nothing more
            torch.testing.assert_close(a, b, atol=LATENT_TOL, rtol=0, msg=f"prompt {i}")
        torch.testing.assert_close(got["frames"], want["frames"], atol=LATENT_TOL, rtol=0)
    assert max(rows) >= 4, rows  # at least two requests x two branches in one forward
    assert (alone[0]["frames"] - alone[1]["frames"]).abs().max() > 1e-2  # prompts differ


def test_cancel_drops_per_request_state(runtime):
    handle = runtime.submit({"text": PROMPTS[0]}, num_inference_steps=200, report_progress=True, width=64, height=64)
    progress = []
    for event in handle:
        progress.append(float(event.value))
        if len(progress) == 2:
            assert handle.cancel()
    assert handle.finish.finish_reason == "cancelled" and len(progress) < 10
    worker = runtime.runtime.workers[0]
    scheduler = worker.engines["scheduler"].module
    deadline = time.monotonic() + 5
    while (scheduler.num_requests or worker.state_size()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scheduler.num_requests == 0 and worker.state_size() == 0
    assert not any(engine.has_work() for engine in worker.engines.values())
    assert progress == sorted(progress) and 0 < progress[0] < 0.01


def test_progress_reaches_one_and_image_output(runtime):
    result = runtime.generate({"text": PROMPTS[2]}, num_inference_steps=3, report_progress=True, seed=3)
    assert result.outputs["progress"] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert result.outputs["video"][0].shape == (5, 64, 64, 3)  # the tiny default: 5 frames of 64x64
    image = runtime.generate({"text": PROMPTS[2]}, num_inference_steps=3, seed=3, modalities=["image"], size="96x64")
    assert list(image.outputs) == ["image"]
    assert image.outputs["image"][0].shape == (64, 96, 3) and image.outputs["image"][0].dtype == np.uint8


@pytest.mark.parametrize(("options", "message"), [
    ({"width": 100}, "width=100 must be a multiple of 32"),  # a size "100x64" is snapped (test_video_sizes.py)
    ({"size": "big"}, "size='big' must look like 'WxH'"),
    ({"num_frames": 8}, "num_frames=8 must be 4k\\+1"),
    ({"num_inference_steps": 0}, "num_inference_steps must be an integer in \\[1, 200\\]"),
    ({"guidance_scale": -1}, "guidance_scale must be a number"),
    ({"modalities": ["image"], "num_frames": 5}, "an image output needs num_frames=1"),
])
def test_bad_options_raise_naming_the_value(runtime, options, message):
    with pytest.raises(ValueError, match=message):
        runtime.submit({"text": "x"}, **options)

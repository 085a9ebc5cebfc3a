"""Cosmos3 through our runtime (MStar, inproc) against diffusers' Cosmos3OmniPipeline with the same random
tiny weights and seed: latents after every step, decoded frames and a policy's actions; batching and
cancellation."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from tests.models.cosmos3_testing import (
    NEGATIVE,
    PROMPTS,
    SIZE,
    outputs_of,
    pixels,
    reference_pipeline,
    run_reference,
    write_pipeline_dir,
)

pytest.importorskip("diffusers")

from mstar.runtime.offline import MStar  # noqa: E402

LATENT_TOL, FRAME_TOL, ACTION_TOL = 1e-4, 1e-3, 1e-4
DEBUG = {"negative_prompt": NEGATIVE, "width": SIZE, "height": SIZE, "debug_outputs": True}

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return write_pipeline_dir(tmp_path_factory.mktemp("cosmos3_pipeline"))


@pytest.fixture(scope="module")
def pipe(root):
    return reference_pipeline(root)


@pytest.fixture(scope="module")
def runtime(root):
    with MStar("cosmos3", tiny=True, model_path=str(root)) as m:
        yield m


def _ours(m, prompt: str, steps: int, seed: int, media=(), **options) -> dict:
    request = {"text": prompt, "media": list(media)}
    return outputs_of(m.submit(request, num_inference_steps=steps, seed=seed, **{**DEBUG, **options}).result())


def _assert_matches(ours: dict, ref: dict, frames: int) -> None:
    assert len(ours["steps"]) == len(ref["steps"]) > 0
    for i, (got, want) in enumerate(zip(ours["steps"], ref["steps"], strict=True)):
        torch.testing.assert_close(got, want, atol=LATENT_TOL, rtol=0, msg=f"latents after step {i}")
    assert ours["frames"].shape == ref["frames"].shape and ref["frames"].shape[0] == frames
    torch.testing.assert_close(ours["frames"], ref["frames"], atol=FRAME_TOL, rtol=0)
    assert ref["frames"].std() > 0.01  # frames are not a flat colour


def test_text_to_image_matches_cosmos3_pipeline(runtime, pipe):
    ref = run_reference(pipe, 3, 11, prompt=PROMPTS[0], negative_prompt=NEGATIVE, num_frames=1, height=SIZE,
                        width=SIZE)
    ours = _ours(runtime, PROMPTS[0], 3, 11, modalities=["image"])
    _assert_matches(ours, ref, 1)


def test_text_to_video_matches_cosmos3_pipeline(runtime, pipe):
    ref = run_reference(pipe, 3, 12, prompt=PROMPTS[1], negative_prompt=NEGATIVE, num_frames=5, height=SIZE,
                        width=SIZE, guidance_scale=4.0, fps=16.0)
    ours = _ours(runtime, PROMPTS[1], 3, 12, num_frames=5, guidance_scale=4.0, fps=16.0)
    _assert_matches(ours, ref, 5)
    assert ours["video"].dtype == torch.uint8 and ours["video"].shape == (5, SIZE, SIZE, 3)
    assert (ours["video"].float() - ref["frames"] * 255).abs().max() <= 1.0


def test_image_to_video_matches_cosmos3_pipeline(runtime, pipe):
    from PIL import Image

    image = pixels(13, 80, 100)  # resized to cover 64x64, then centre-cropped
    ref = run_reference(pipe, 3, 14, prompt=PROMPTS[1], negative_prompt=NEGATIVE, num_frames=9, height=SIZE,
                        width=SIZE, image=Image.fromarray(image))
    ours = _ours(runtime, PROMPTS[1], 3, 14, media=[{"type": "image", "data": image}], num_frames=9)
    _assert_matches(ours, ref, 9)
    t2v = _ours(runtime, PROMPTS[1], 3, 14, num_frames=9)
    assert (t2v["steps"][-1] - ref["steps"][-1]).abs().max() > 1e-2  # the image really conditions the video


def test_video_with_sound_matches_cosmos3_pipeline(runtime, pipe):
    """enable_sound: the sound tower's latents denoise beside the video's and the AVAE decoder makes stereo."""
    ref = run_reference(pipe, 3, 15, prompt=PROMPTS[0], negative_prompt=NEGATIVE, num_frames=9, height=SIZE,
                        width=SIZE, enable_sound=True)
    ours = _ours(runtime, PROMPTS[0], 3, 15, num_frames=9, modalities=["video", "audio"])
    _assert_matches(ours, ref, 9)
    assert ours["audio"].shape == ref["audio"].shape and ref["audio"].shape[1] == 2  # [samples, stereo]
    torch.testing.assert_close(ours["audio"], ref["audio"].float(), atol=FRAME_TOL, rtol=0)
    assert ref["audio"].std() > 0.01
    silent = _ours(runtime, PROMPTS[0], 3, 15, num_frames=9)
    assert silent["audio"] is None and (silent["steps"][-1] - ref["steps"][-1]).abs().max() > 1e-3  # sound shares attention


def test_policy_actions_match_cosmos_action_condition(runtime, pipe):
    """DROID policy mode: a camera clip shrunk into the tier's canvas (bicubic) and padded; the action
    chunk, every step's latents and the predicted video match diffusers'."""
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import CosmosActionCondition
    from PIL import Image

    frames = [pixels(20 + i, 200, 300) for i in range(3)]
    action = CosmosActionCondition(mode="policy", chunk_size=8, domain_name="droid_lerobot", resolution_tier=256,
                                   video=[Image.fromarray(f) for f in frames], view_point="concat_view")
    ref = run_reference(pipe, 3, 7, prompt=PROMPTS[2], negative_prompt=NEGATIVE, action=action, guidance_scale=3.0,
                        fps=15.0)
    ours = _ours(runtime, PROMPTS[2], 3, 7, media=[{"type": "video", "data": np.stack(frames)}], guidance_scale=3.0,
                 fps=15.0, chunk_size=8, resolution_tier=256, view_point="concat_view", modalities=["actions", "video"])
    assert ours["actions"].shape == ref["actions"].shape == (8, 10)
    torch.testing.assert_close(ours["actions"], ref["actions"].float(), atol=ACTION_TOL, rtol=0)
    _assert_matches(ours, ref, 9)
    alone = runtime.submit({"text": PROMPTS[2], "media": [{"type": "image", "data": frames[0]}]},
                           num_inference_steps=3, seed=7, negative_prompt=NEGATIVE, guidance_scale=3.0, fps=15.0, chunk_size=8,
                           resolution_tier=256, view_point="concat_view", modalities=["actions"]).result()
    assert list(alone.outputs) == ["actions"]  # no video asked for: the VAE never decodes
    torch.testing.assert_close(torch.as_tensor(alone.outputs["actions"][0]), ours["actions"], atol=0, rtol=0)


def test_batched_and_joining_requests_get_what_they_get_alone(runtime, monkeypatch):
    """Three different requests (an image, a video, a policy): one starts, two join after its first step;
    each equals its run alone, and the DiT really ran rows of several requests in one forward."""
    from mstar.models.cosmos3.components import GeneratorComponent

    clip = np.stack([pixels(30, 96, 128)] * 2)
    requests = [({"text": PROMPTS[0]}, {"modalities": ["image"]}),
                ({"text": PROMPTS[1]}, {"num_frames": 5, "guidance_scale": 1.0}),
                ({"text": PROMPTS[2], "media": [{"type": "video", "data": clip}]},
                 {"modalities": ["actions", "video"], "chunk_size": 4, "resolution_tier": 256})]

    def submit(i: int, **extra):
        request, options = requests[i]
        return runtime.submit(request, num_inference_steps=4, seed=40 + i, **{**DEBUG, **options, **extra})

    alone = [outputs_of(submit(i).result()) for i in range(3)]
    rows: list[int] = []
    original = GeneratorComponent.run_items
    in_second_forward, joined = threading.Event(), threading.Event()

    def run_items(self, items):
        rows.append(sum("prompt_ids" in item.inputs for item in items))
        if len(rows) == 2:  # the first request's second step waits here until the others are submitted
            in_second_forward.set()
            joined.wait(10)
        return original(self, items)

    monkeypatch.setattr(GeneratorComponent, "run_items", run_items)
    first = submit(0)
    results = [None, None, None]
    reader = threading.Thread(target=lambda: results.__setitem__(0, outputs_of(first.result())))
    reader.start()
    assert in_second_forward.wait(30)
    late = [submit(i) for i in (1, 2)]
    joined.set()
    reader.join()
    results[1:] = [outputs_of(h.result()) for h in late]
    for i, (got, want) in enumerate(zip(results, alone, strict=True)):
        for a, b in zip(got["steps"], want["steps"], strict=True):
            torch.testing.assert_close(a, b, atol=LATENT_TOL, rtol=0, msg=f"request {i}")
        torch.testing.assert_close(got["frames"], want["frames"], atol=LATENT_TOL, rtol=0)
    torch.testing.assert_close(results[2]["actions"], alone[2]["actions"], atol=LATENT_TOL, rtol=0)
    assert max(rows) >= 4, rows  # rows of at least two requests (and branches) in one forward


def test_cancel_drops_per_request_state(runtime):
    handle = runtime.submit({"text": PROMPTS[0]}, num_inference_steps=200, report_progress=True, width=SIZE,
                            height=SIZE, num_frames=5)
    progress = []
    for event in handle:
        progress.append(float(event.value))
        if len(progress) == 2:
            assert handle.cancel()
    assert handle.finish.finish_reason == "cancelled" and len(progress) < 10
    worker = runtime.runtime.workers[0]
    scheduler, dit = worker.engines["scheduler"].module, worker.engines["dit"].module
    deadline = time.monotonic() + 5
    while (scheduler.num_requests or dit.num_prompts or worker.state_size()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scheduler.num_requests == 0 and dit.num_prompts == 0 and worker.state_size() == 0
    assert progress == sorted(progress) and 0 < progress[0] < 0.01


@pytest.mark.parametrize(("options", "message"), [
    ({"size": "100x64"}, "width=100 must be a multiple of 16"),
    ({"num_frames": 8}, "num_frames=8 must be 4k\\+1"),
    ({"num_inference_steps": 0}, "num_inference_steps must be an integer in \\[1, 200\\]"),
    ({"modalities": ["image"], "num_frames": 5}, "an image output needs num_frames=1"),
    ({"modalities": ["actions"], "embodiment": "libero"}, "embodiment 'libero' is not supported"),
    ({"modalities": ["actions"], "resolution_tier": 300}, "resolution_tier=300 must be one of"),
])
def test_bad_options_raise_naming_the_value(runtime, options, message):
    with pytest.raises(ValueError, match=message):
        runtime.submit({"text": "x"}, **options)


def test_requests_it_cannot_take_raise(runtime):
    with pytest.raises(ValueError, match="needs the camera video"):
        runtime.submit({"text": "pick"}, modalities=["actions"]).result()
    with pytest.raises(ValueError, match="an image conditions a video"):
        runtime.submit({"text": "x", "media": [{"type": "image", "data": pixels(1)}]}, modalities=["image"]).result()

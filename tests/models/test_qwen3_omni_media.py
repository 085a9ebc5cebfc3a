"""Qwen3-Omni with image, audio and video prompts through our runtime (MStar offline, walk prefill_media)
vs transformers' Qwen3OmniMoeForConditionalGeneration thinker with the same random weights (tiny, float32,
greedy): identical text tokens.

transformers' video processor needs torchvision (not installed), so the reference gets its inputs
built by hand: our features (equal to the reference processors', tests/models/test_qwen3_omni_features.py)
and placeholders expanded with the reference's own length formulas.
"""

import uuid

import numpy as np
import pytest
import torch

from mstar.conductor.conductor import Conductor
from mstar.models.qwen3_omni.encoder_components import BatchedAudioEncoder, BatchedVisionEncoder
from mstar.runtime.offline import MStar, RequestHandle
from tests.models.qwen3_omni_model_testing import SP, make_reference, outputs, runtime_config, submit_ids

pytest.importorskip("transformers")

TOKENS = 8
HEAD = [SP["im_start"], SP["user"]]
TAIL = [10, 11, SP["im_end"], SP["im_start"], SP["assistant"], 13]
IMAGE = [SP["vision_start"], SP["image"], SP["vision_end"]]
VIDEO = [SP["vision_start"], SP["video"], SP["vision_end"]]
AUDIO = [SP["audio_start"], SP["audio"], SP["audio_end"]]


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("omni_media")
    reference = make_reference(folder)
    with MStar("qwen3_omni", config=runtime_config(max_model_len=512), model_path=str(folder)) as mstar:
        yield reference, mstar


@pytest.fixture
def spies(monkeypatch):
    """Walks the conductor starts and the batch sizes each encoder ran."""
    walks, batches = [], {"audio": [], "vision": []}
    start = Conductor._start_walk
    audio_run, vision_run = BatchedAudioEncoder.run_batch, BatchedVisionEncoder.run_batch

    def start_walk(self, req, name):
        walks.append(name)
        return start(self, req, name)

    def audio(self, walk, node, inputs, options):
        batches["audio"].append(sum("audio_features" in x for x in inputs))
        return audio_run(self, walk, node, inputs, options)

    def vision(self, walk, node, inputs, options):
        batches["vision"].append(sum("pixel_values" in x for x in inputs))
        return vision_run(self, walk, node, inputs, options)

    monkeypatch.setattr(Conductor, "_start_walk", start_walk)
    monkeypatch.setattr(BatchedAudioEncoder, "run_batch", audio)
    monkeypatch.setattr(BatchedVisionEncoder, "run_batch", vision)
    return walks, batches


# Structured media (stripes, chirps): noise images and audios all look alike to tiny random encoders.
def _image(seed, h=32, w=40):
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    colour, freq = rng.uniform(0, 1, (3,)), rng.uniform(0.05, 0.5, (2,))
    return (127 + 120 * np.sin(freq[0] * y[..., None] * (1 + colour) + freq[1] * x[..., None] * (2 - colour))
            ).astype(np.uint8)


def _audio(seed, seconds=1.5, rate=16000):
    t = np.arange(int(seconds * rate)) / rate
    freq = np.random.default_rng(seed).uniform(200, 3000)
    return {"type": "audio", "data": (0.3 * np.sin(2 * np.pi * freq * t * (1 + t))).astype(np.float32),
            "sample_rate": rate}


def _video(seed):
    return {"type": "video", "data": np.stack([_image(seed + k, 32, 32) for k in range(4)]), "fps": 4.0}


def submit_media(mstar, prompt, media, **options):
    """Token ids with one placeholder per media item, through our processor's media path; (handle, inputs)."""
    runtime = mstar.runtime
    opts = runtime.model.request_options(options)
    mstar.processor.validate_options(opts)
    inputs = mstar.processor.prompt_inputs(prompt, media, opts)
    handle = RequestHandle(runtime, uuid.uuid4().hex)
    runtime.submit(handle.rid, inputs, opts, handle._events.put)
    return handle, inputs


def reference_expand(reference, prompt, inputs):
    """The placeholders repeated as the reference processor does (its own length formulas)."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    audio = iter(_get_feat_extract_output_lengths(inputs["audio_lengths"]).tolist() if "audio_lengths" in inputs
                 else [])
    grids = iter((inputs["vision_grid_thw"].prod(-1) // 4).tolist() if "vision_grid_thw" in inputs else [])
    out = []
    for t in prompt:
        n = next(audio) if t == SP["audio"] else next(grids) if t in (SP["image"], SP["video"]) else 1
        out += [t] * n
    return out


def reference_tokens(reference, prompt, inputs, video_seconds=None):
    """The reference thinker's greedy tokens for our expanded prompt and features."""
    ids = torch.tensor([reference_expand(reference, prompt, inputs)])
    assert ids[0].tolist() == inputs["prompt_ids"].tolist()  # our expansion is the reference's
    kwargs = {"attention_mask": torch.ones_like(ids)}
    if "audio_features" in inputs:
        kwargs["input_features"] = inputs["audio_features"][None]
        kwargs["feature_attention_mask"] = torch.ones(1, inputs["audio_features"].shape[1], dtype=torch.long)
    if "pixel_values" in inputs:
        key = "video" if SP["video"] in prompt else "image"
        kwargs["pixel_values" if key == "image" else "pixel_values_videos"] = inputs["pixel_values"]
        kwargs[f"{key}_grid_thw"] = inputs["vision_grid_thw"]
    if video_seconds is not None:
        kwargs["video_second_per_grid"] = torch.tensor([video_seconds])
    with torch.no_grad():
        out = reference.thinker.generate(ids, max_new_tokens=TOKENS, do_sample=False, eos_token_id=SP["im_end"],
                                         **kwargs)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("kind", ["image", "audio", "video"])
def test_media_prompt_matches_reference(setup, spies, kind):
    reference, mstar = setup
    walks, batches = spies
    prompt, media = {"image": (IMAGE, [{"type": "image", "data": _image(0)}]), "audio": (AUDIO, [_audio(1)]),
                     "video": (VIDEO, [_video(2)])}[kind]
    handle, inputs = submit_media(mstar, HEAD + prompt + TAIL, media, temperature=0, max_tokens=TOKENS)
    text, _ = outputs(handle)
    seconds = 1.0 if kind == "video" else None  # temporal patch 2 / sampling at 2 fps
    want = reference_tokens(reference, HEAD + prompt + TAIL, inputs, seconds)
    assert text == want
    assert walks[0] == "prefill_media"
    assert batches["audio" if kind == "audio" else "vision"] == [1]
    if kind != "audio":
        assert inputs["positions"].shape == (3, inputs["prompt_ids"].numel())
        assert not torch.equal(inputs["positions"][1], inputs["positions"][2])  # h and w differ in the grid
    # the media matter: another input of the same size gives other tokens
    other = {"image": [{"type": "image", "data": _image(5)}], "audio": [_audio(9)], "video": [_video(7)]}[kind]
    handle, _ = submit_media(mstar, HEAD + prompt + TAIL, other, temperature=0, max_tokens=TOKENS)
    assert outputs(handle)[0] != text


def test_mixed_prompt_and_concurrent_requests_equal_each_alone(setup, spies):
    _reference, mstar = setup
    mixed = HEAD + AUDIO + IMAGE + [12] + AUDIO + TAIL
    requests = [(mixed, [_audio(3, 0.7), {"type": "image", "data": _image(4, 24, 24)}, _audio(8, 2.3)]),
                (HEAD + AUDIO + TAIL, [_audio(9, 1.2)]),
                (HEAD + IMAGE + VIDEO + TAIL, [{"type": "image", "data": _image(10)}, _video(11)])]
    alone = [outputs(submit_media(mstar, p, m, temperature=0, max_tokens=TOKENS)[0])[0] for p, m in requests]
    handles = [submit_media(mstar, p, m, temperature=0, max_tokens=TOKENS)[0] for p, m in requests]
    assert [outputs(h)[0] for h in handles] == alone


def test_text_request_never_touches_the_encoders(setup, spies):
    _reference, mstar = setup
    walks, batches = spies
    text, _ = outputs(submit_ids(mstar, HEAD + [7, 8] + TAIL, temperature=0, max_tokens=3))
    assert len(text) == 3
    assert "prefill_media" not in walks and walks[0] == "prefill"
    assert batches == {"audio": [], "vision": []}


def test_placeholder_count_must_match_the_media(setup):
    _reference, mstar = setup
    with pytest.raises(ValueError, match="1 image placeholder.*2 image input"):
        submit_media(mstar, HEAD + IMAGE + TAIL, [{"type": "image", "data": _image(0)}] * 2)
    with pytest.raises(ValueError, match="qwen3_omni takes"):
        submit_media(mstar, HEAD + IMAGE + TAIL, [{"type": "pdf", "data": b""}])


def test_spoken_answer_to_an_image_matches_reference_text_and_audio(setup):
    # (the reference's talker cannot take audio prompts: its config lacks audio_config for the positions)
    reference, mstar = setup
    prompt = HEAD + IMAGE + TAIL
    handle, inputs = submit_media(mstar, prompt, [{"type": "image", "data": _image(0)}], temperature=0,
                                  max_tokens=6, modalities=["text", "audio"], voice="Ethan",
                                  **{"talker.temperature": 0, "talker.max_tokens": 10})
    text, audio = outputs(handle)
    ids = torch.tensor([inputs["prompt_ids"].tolist()])
    with torch.no_grad():
        sequences, want_audio = reference.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=inputs["pixel_values"],
            image_grid_thw=inputs["vision_grid_thw"], speaker="Ethan", return_audio=True, thinker_max_new_tokens=6,
            thinker_eos_token_id=SP["im_end"], thinker_do_sample=False, talker_do_sample=False,
            talker_max_new_tokens=10)
    assert text == sequences[0, ids.shape[1]:].tolist()
    torch.testing.assert_close(audio, want_audio.reshape(-1), atol=1e-4, rtol=0)


def _sounding_video(seed, sound_seed, frames=8):
    """Two seconds of frames at 4 fps with a sound track (as decode_video's media_item gives them)."""
    sound = _audio(sound_seed, seconds=frames / 4)
    return {"type": "video", "data": np.stack([_image(seed + k, 32, 32) for k in range(frames)]), "fps": 4.0,
            "audio": sound["data"], "sample_rate": sound["sample_rate"]}


def reference_heard_prompt(reference, prompt, inputs):
    """The reference processor's expansion of `prompt` with use_audio_in_video (its own code, run on one character
    per token: transformers' processor class needs torchvision, its expansion method does not)."""
    from types import SimpleNamespace

    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessor

    chars = {SP["audio"]: "A", SP["image"]: "I", SP["video"]: "V", SP["vision_start"]: "[", SP["vision_end"]: "]",
             SP["audio_start"]: "<", SP["audio_end"]: ">"}
    other = {c: chr(0x4E00 + i) for i, c in enumerate(sorted(set(prompt) - set(chars)))}
    merge = SimpleNamespace(merge_size=reference.config.thinker_config.vision_config.spatial_merge_size)
    fake = SimpleNamespace(audio_token="A", image_token="I", video_token="V", vision_bos_token="[",
                           vision_eos_token="]", audio_bos_token="<", audio_eos_token=">", image_processor=merge,
                           video_processor=merge)
    [text] = Qwen3OmniMoeProcessor.replace_multimodal_special_tokens(
        fake, ["".join(chars.get(t) or other[t] for t in prompt)],
        iter(_get_feat_extract_output_lengths(inputs["audio_lengths"]).tolist()), iter([]),
        iter(inputs["vision_grid_thw"].numpy()), iter([1.0]), True, reference.config.thinker_config.position_id_per_seconds, 2)
    back = {v: k for k, v in {**chars, **other}.items()}
    return [back[c] for c in text]


def test_a_video_is_heard_with_its_sound_as_the_reference_hears_it(setup, spies):
    reference, mstar = setup
    walks, batches = spies
    prompt = HEAD + VIDEO + TAIL
    handle, inputs = submit_media(mstar, prompt, [_sounding_video(2, 1)], temperature=0, max_tokens=TOKENS)
    text, _ = outputs(handle)
    ids = inputs["prompt_ids"]
    assert ids.tolist() == reference_heard_prompt(reference, prompt, inputs)
    kinds = inputs["mm_kinds"].tolist()
    assert 0 < kinds.index(0) < len(kinds) - kinds[::-1].index(1) - 1  # audio rows between the frames' rows
    mask = torch.ones(1, ids.numel(), dtype=torch.long)
    lengths = inputs["audio_lengths"]
    want_positions, _ = reference.thinker.get_rope_index(ids[None], None, inputs["vision_grid_thw"], mask, True,
                                                         lengths, torch.tensor([1.0]))
    torch.testing.assert_close(inputs["positions"].double(), want_positions[:, 0].double())
    kwargs = {"attention_mask": mask, "input_features": inputs["audio_features"][None],
              "feature_attention_mask": torch.ones(1, inputs["audio_features"].shape[1], dtype=torch.long),
              "pixel_values_videos": inputs["pixel_values"], "video_grid_thw": inputs["vision_grid_thw"],
              "video_second_per_grid": torch.tensor([1.0]), "use_audio_in_video": True}
    with torch.no_grad():
        out = reference.thinker.generate(ids[None], max_new_tokens=TOKENS, do_sample=False, eos_token_id=SP["im_end"],
                                         **kwargs)
    assert text == out[0, ids.numel():].tolist()
    assert walks[0] == "prefill_media" and batches == {"audio": [1], "vision": [1]}
    # the sound is heard: another track changes the answer; switched off, the video is as if silent
    other, _ = submit_media(mstar, prompt, [_sounding_video(2, 3)], temperature=0, max_tokens=TOKENS)
    assert outputs(other)[0] != text
    off, off_inputs = submit_media(mstar, prompt, [_sounding_video(2, 1)], temperature=0, max_tokens=TOKENS,
                                   use_audio_in_video=False)
    silent = {k: v for k, v in _sounding_video(2, 1).items() if k not in ("audio", "sample_rate")}
    alone, _ = submit_media(mstar, prompt, [silent], temperature=0, max_tokens=TOKENS)
    assert outputs(off)[0] == outputs(alone)[0] != text and "audio_features" not in off_inputs

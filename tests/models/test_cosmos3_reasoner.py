"""Cosmos3's reasoner chat against transformers' Cosmos3OmniForConditionalGeneration: the same tiny unified
checkpoint (the generator folder's tensors, which transformers renames and filters itself), greedy
token ids equal; the generation lanes are untouched by chat requests."""

from __future__ import annotations

import shutil

import pytest
import torch

from mstar.models.cosmos3.tiny import TINY_TRANSFORMER
from tests.models.cosmos3_testing import write_pipeline_dir

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

from mstar.runtime.offline import MStar  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

CHATS = ([{"role": "user", "content": "A robot arm picks up the red cube"}],
         [{"role": "system", "content": "You are a helpful assistant."},
          {"role": "user", "content": "Waves crash on a rocky shore at sunset"}])


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return write_pipeline_dir(tmp_path_factory.mktemp("cosmos3_pipeline"))


def _reference(root):
    """The transformers reasoner loaded from the transformer folder's safetensors (its ViT left random)."""
    from transformers import Cosmos3OmniConfig, Cosmos3OmniForConditionalGeneration

    t = TINY_TRANSFORMER
    text = {"vocab_size": t["vocab_size"], "hidden_size": t["hidden_size"], "intermediate_size": t["intermediate_size"],
            "num_hidden_layers": t["num_hidden_layers"], "num_attention_heads": t["num_attention_heads"],
            "num_key_value_heads": t["num_key_value_heads"], "head_dim": t["head_dim"], "rms_norm_eps": t["rms_norm_eps"],
            "rope_parameters": {"rope_type": "default", "rope_theta": t["rope_theta"], "mrope_section": t["rope_axes_dim"],
                                "mrope_interleaved": True},
            "tie_word_embeddings": False, "max_position_embeddings": 2048}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": t["hidden_size"],
              "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 64,
              "deepstack_visual_indexes": [0]}
    folder = root / "reasoner_reference"
    folder.mkdir(exist_ok=True)
    Cosmos3OmniConfig(text_config=text, vision_config=vision).save_pretrained(folder)
    shutil.copy(root / "transformer" / "diffusion_pytorch_model.safetensors", folder / "model.safetensors")
    return Cosmos3OmniForConditionalGeneration.from_pretrained(folder).eval()


def test_greedy_chat_matches_transformers(root):
    from transformers import AutoTokenizer

    reference = _reference(root)
    tokenizer = AutoTokenizer.from_pretrained(root / "text_tokenizer")
    wants = []
    for messages in CHATS:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)
        with torch.no_grad():
            wants.append(reference.generate(**prompt, max_new_tokens=12, do_sample=False)[0, prompt["input_ids"].shape[1]:])
    with MStar("cosmos3", tiny=True, model_path=str(root)) as m:
        handles = [m.submit({"messages": messages}, modalities=["text"], temperature=0.0, max_tokens=12)
                   for messages in CHATS]  # in flight together: one batch of the reasoner
        for handle, want in zip(handles, wants, strict=True):
            got = torch.cat([t.reshape(-1) for t in handle.result().outputs["text"]])
            assert got.tolist() == want.tolist()
            assert len(set(got.tolist())) > 2  # a varied answer, not one repeated token
        decoded = m.generate({"messages": CHATS[0]}, modalities=["text"], temperature=0.0, max_tokens=12)
        assert "".join(decoded.outputs["text"]) == tokenizer.decode(wants[0], skip_special_tokens=True)
        worker = m.runtime.workers[0]
        assert worker.engines["scheduler"].module.num_requests == 0  # chat never opened a generation state

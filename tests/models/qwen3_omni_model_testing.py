"""Helpers for the served Qwen3-Omni tests: a tiny reference model saved in the Hub layout, our runtime
on it, and spies on what the runtime ran."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from mstar.models.qwen3_omni.tiny import special_token_ids, tiny_omni_hf_config

SP = special_token_ids()
# system turn, user turn, then the generation prompt ("13" plays the newline after "assistant")
PROMPT = [SP["im_start"], SP["system"], 7, 8, SP["im_end"], SP["im_start"], SP["user"], 10, 11, 12, 40,
          SP["im_end"], SP["im_start"], SP["assistant"], 13]


def make_reference(folder: Path):
    """A random tiny `Qwen3OmniMoeForConditionalGeneration` saved to `folder` (weights, config.json and the
    tiny tokenizer, which only makes the processor loadable: tests feed token ids)."""
    from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as C
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as M

    from mstar.models.llama.tiny import tiny_tokenizer_folder
    from tests.models.qwen3_omni_codec_testing import randomize as randomize_codec
    from tests.models.qwen3_omni_testing import randomize

    cfg = tiny_omni_hf_config()
    model = M.Qwen3OmniMoeForConditionalGeneration(C.Qwen3OmniMoeConfig(**cfg)).eval()
    randomize(model.thinker, seed=0)
    randomize(model.talker, seed=1)
    randomize_codec(model.code2wav, seed=2, matrix_std=0.1, vector_std=0.1)
    model.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps(cfg))  # the Hub file's form, as our parser reads it
    for file in tiny_tokenizer_folder().iterdir():
        shutil.copy(file, folder / file.name)
    return model


def runtime_config(**model_kwargs) -> dict:
    """An MStar config dict for the tiny reference checkpoint (all components on worker 0)."""
    kwargs = {"tokenizer_path": None, "max_model_len": 256, "talker_max_model_len": 256,
              "code2wav_chunk": 4, "code2wav_left_context": 39, **model_kwargs}  # 39: the tiny exact context
    return {"model": "qwen3_omni", "kv_cache": {"max_num_pages": 64, "page_size": 16}, "model_kwargs": kwargs,
            "engines": {"thinker": {"max_batch_tokens": 64}, "talker": {"max_batch_tokens": 64}}}


def reference_generate(model, prompt: list[int], thinker_tokens: int, talker_tokens: int, speaker: str = "Ethan"):
    """(text ids, codes [G, T], audio) of the reference's greedy generate with return_audio."""
    seen: list[torch.Tensor] = []
    hook = model.code2wav.register_forward_pre_hook(lambda _m, args: seen.append(args[0][0].clone()))
    try:
        ids = torch.tensor([prompt])
        sequences, audio = model.generate(
            input_ids=ids, speaker=speaker, return_audio=True, thinker_max_new_tokens=thinker_tokens,
            thinker_eos_token_id=SP["im_end"], thinker_do_sample=False, talker_do_sample=False,
            talker_max_new_tokens=talker_tokens)
    finally:
        hook.remove()
    return sequences[0, len(prompt):].tolist(), torch.cat(seen, dim=-1), audio.reshape(-1)


def submit_ids(mstar, prompt: list[int], **options):
    """Submit token ids directly (the tiny reference has no real tokenizer); a RequestHandle."""
    import uuid

    from mstar.runtime.offline import RequestHandle

    runtime = mstar.runtime
    opts = runtime.model.request_options(options)
    mstar.processor.validate_options(opts)
    ids = torch.tensor(prompt)
    inputs = {"prompt_ids": ids}
    opts.setdefault("thinker.max_tokens", 32)
    if "audio" in opts.get("modalities", ()):
        inputs["talker_positions"] = mstar.processor.talker_positions(ids)
    handle = RequestHandle(runtime, uuid.uuid4().hex)
    runtime.submit(handle.rid, inputs, opts, handle._events.put)
    return handle


def outputs(handle) -> tuple[list[int], torch.Tensor]:
    """(text token ids, audio samples) of a finished handle."""
    result = handle.result()
    text = [int(t) for value in result.outputs.get("text", []) for t in torch.as_tensor(value).reshape(-1)]
    audio = [torch.as_tensor(a).reshape(-1) for a in result.outputs.get("audio", [])]
    return text, torch.cat(audio) if audio else torch.zeros(0)

"""The diffusers side of benchmarks/wan_bench.py: a WanPipeline built from configs, with dummy weights.

Components (no download): WanTransformer3DModel and AutoencoderKLWan with the Wan2.2-TI2V-5B configs,
UMT5EncoderModel with the umt5-xxl config, UniPCMultistepScheduler with the TI2V scheduler config, and
the tiny offline tokenizer of mstar.models.wan22.tiny (token ids do not change the speed: prompts are
padded to the same length). `expand_timesteps=True`, as the TI2V-5B pipeline is configured.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from mstar.models.common.loading import fill_dummy_weights

# diffusers transformer/config.json of Wan-AI/Wan2.2-TI2V-5B-Diffusers
WAN22_TRANSFORMER: dict[str, Any] = {
    "_class_name": "WanTransformer3DModel", "patch_size": [1, 2, 2], "num_attention_heads": 24,
    "attention_head_dim": 128, "in_channels": 48, "out_channels": 48, "text_dim": 4096, "freq_dim": 256,
    "ffn_dim": 14336, "num_layers": 30, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6, "image_dim": None, "added_kv_proj_dim": None, "rope_max_seq_len": 1024,
}
# transformers config.json of google/umt5-xxl's encoder as Wan ships it (text_encoder/)
UMT5_XXL: dict[str, Any] = {
    "architectures": ["UMT5EncoderModel"], "model_type": "umt5", "vocab_size": 256384, "d_model": 4096,
    "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64, "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128, "feed_forward_proj": "gated-gelu", "layer_norm_epsilon": 1e-6,
    "is_encoder_decoder": False, "pad_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
}


def _hf_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if not k.startswith("_")}


def dummy_module(factory, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """`factory()` constructed directly on `device` in `dtype` (no host copy at full size), seeded random weights."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            module = factory()
    finally:
        torch.set_default_dtype(previous)
    fill_dummy_weights(module, seed=0)
    return module.eval()


def _keep_fp32(module: torch.nn.Module) -> None:
    """What diffusers' from_pretrained does for a bf16 load: `_keep_in_fp32_modules` stay float32."""
    keep = set(getattr(module, "_keep_in_fp32_modules", None) or ())
    with torch.no_grad():
        for name, param in module.named_parameters():
            if keep.intersection(name.split(".")):
                param.data = param.data.float()


def build_pipeline(transformer: dict, text_encoder: dict, vae: dict, scheduler: dict, tokenizer_dir: str,
                   dtype: torch.dtype, vae_dtype: torch.dtype, device: torch.device):
    """A diffusers WanPipeline of random weights: DiT and text encoder in `dtype`, VAE in `vae_dtype`."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

    dit = dummy_module(lambda: WanTransformer3DModel(**_hf_kwargs(transformer)), dtype, device)
    _keep_fp32(dit)
    encoder = dummy_module(lambda: UMT5EncoderModel(UMT5Config(**text_encoder)), dtype, device)
    autoencoder = dummy_module(lambda: AutoencoderKLWan(**_hf_kwargs(vae)), vae_dtype, device)
    with torch.no_grad():  # the VAE's RMS norm scales are named gamma; give them unit scale
        for name, param in autoencoder.named_parameters():
            if name.endswith(".gamma"):
                param.fill_(1.0)
    pipe = WanPipeline(tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir), text_encoder=encoder,
                       vae=autoencoder, scheduler=UniPCMultistepScheduler.from_config(_hf_kwargs(scheduler)),
                       transformer=dit, expand_timesteps=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_pipeline(pipe, prompts: list[str], shape: dict, steps: int, guidance: float, text_length: int,
                 device: torch.device) -> dict:
    """One pipeline call for all `prompts` (a batch); host timestamps after each step (device synced)."""
    marks: list[float] = []

    def on_step(_pipe, _i, _t, values):
        _sync(device)  # the step's kernels are done: the timestamp is the step's end
        marks.append(time.perf_counter())
        return {}

    _sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        pipe(prompt=prompts, negative_prompt=[""] * len(prompts), height=shape["height"], width=shape["width"],
             num_frames=shape["num_frames"], num_inference_steps=steps, guidance_scale=guidance,
             generator=[torch.Generator().manual_seed(i) for i in range(len(prompts))], output_type="pt",
             max_sequence_length=text_length, callback_on_step_end=on_step)
    _sync(device)
    end = time.perf_counter()
    return {"start": start, "steps": marks, "end": end}

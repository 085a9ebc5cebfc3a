"""The deployments one `benchmarks/bagel_bench.py` run compares (each `--configs` entry under each `--quantization`)
and how a later deployment's images are compared to the first's."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mstar.config import MStarConfig, load_config


@dataclass(frozen=True)
class Setting:
    """One deployment of a run: its name in the results (`settings.<name>`), the `--configs` entry it comes
    from, its config (with the quantization applied) and the quantization alone."""

    name: str
    source: str
    config: MStarConfig
    quantization: str


def settings(configs: list[str], quantizations: list[str], cpu: bool) -> list[Setting]:
    """Every config (a shipped name or a YAML path, model `bagel`) under every quantization, configs outermost;
    named by the config's file stem, the quantization, or `<stem>_<quantization>` when both vary. ValueError
    with the offending value for a bad combination; ConfigError for a bad file. `cpu` puts every worker on the
    host (a CUDA machine would otherwise take the tiny model too)."""
    stems = [Path(c).stem for c in configs]
    if len(set(stems)) < len(stems):
        raise ValueError(f"--configs {' '.join(configs)}: each config once (by file name)")
    if len(set(quantizations)) < len(quantizations):
        raise ValueError(f"--quantization {' '.join(quantizations)}: each setting once")
    out = []
    for path, stem in zip(configs, stems, strict=True):
        own = load_config(path)
        if own.model != "bagel":
            raise ValueError(f"--configs {path}: a config of model {own.model!r}; this benchmark serves bagel")
        if own.quantization:  # one place says what is quantized, so a setting's name cannot lie about it
            raise ValueError(f"--configs {path} sets quantization: {own.quantization}; leave it out and pass "
                             f"--quantization, which sets it per setting")
        for quantization in quantizations:
            config = load_config(path, quantization={} if quantization == "none" else {"llm": quantization},
                                 device="cpu" if cpu else None)
            if len(configs) > 1 and len(quantizations) > 1:
                name = f"{stem}_{quantization}"
            else:
                name = stem if len(configs) > 1 else quantization
            out.append(Setting(name, path, config, quantization))
    return out


def image_psnr(picture: np.ndarray, reference: np.ndarray) -> float:
    """PSNR in dB of uint8 `picture` against `reference` (inf for identical images)."""
    mse = float(((picture.astype(np.float64) - reference.astype(np.float64)) ** 2).mean())
    return float("inf") if mse == 0 else round(10 * float(np.log10(255.0**2 / mse)), 2)


def compare_image(case: dict[str, Any], reference: dict[str, tuple[np.ndarray, torch.Tensor | None]], name: str,
                  picture: np.ndarray, latents: torch.Tensor | None, first: str) -> None:
    """Record image case `name` against the first setting's (`reference`, which the first setting fills): PSNR,
    the largest pixel difference and, where both runs gave final latents, their largest absolute difference,
    all keyed `..._vs_<first>`; `latents_max_abs` (the final latents' scale) wherever latents were taken."""
    if latents is not None:
        case["latents_max_abs"] = round(float(latents.abs().max()), 4)
    if name not in reference:
        reference[name] = (picture, latents)
        return
    want, want_latents = reference[name]
    case[f"psnr_db_vs_{first}"] = image_psnr(picture, want)
    case[f"max_pixel_diff_vs_{first}"] = int(np.abs(picture.astype(np.int16) - want.astype(np.int16)).max())
    if latents is not None and want_latents is not None:
        case[f"latents_max_abs_diff_vs_{first}"] = float(f"{float((latents - want_latents).abs().max()):.3g}")


def seconds_ratios(doc: dict[str, Any], first: str) -> None:
    """Each later setting's image cases: their seconds over the first setting's (`seconds_vs_<first>`)."""
    for setting in doc.get("settings", {}).values():
        for name in ("generation", "editing"):
            if name in setting and name in doc:
                setting[name][f"seconds_vs_{first}"] = round(setting[name]["seconds"] / doc[name]["seconds"], 3)

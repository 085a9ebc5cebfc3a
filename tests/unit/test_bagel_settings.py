"""benchmarks/bagel_settings.py: the deployments a bagel_bench run compares, their names, and the combinations it
refuses (read from the configs alone; nothing is built)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.bagel_bench import parse_args
from benchmarks.bagel_settings import compare_image, settings


def test_every_config_under_every_quantization():
    both = settings(["bagel", "bagel_cfg_parallel"], ["none", "fp8"], cpu=True)
    assert [s.name for s in both] == ["bagel_none", "bagel_fp8", "bagel_cfg_parallel_none", "bagel_cfg_parallel_fp8"]
    assert [s.config.quantization for s in both] == [{}, {"llm": "fp8"}] * 2
    assert [s.config.num_workers for s in both] == [1, 1, 3, 3] and {s.config.device for s in both} == {"cpu"}
    assert [s.name for s in settings(["bagel", "bagel_cfg_parallel"], ["none"], cpu=False)] == [
        "bagel", "bagel_cfg_parallel"]
    assert [s.name for s in settings(["bagel"], ["none", "fp8"], cpu=False)] == ["none", "fp8"]


def test_refused_combinations(tmp_path):
    with pytest.raises(ValueError, match="each config once"):
        settings(["bagel", "mstar/configs/bagel.yaml"], ["none"], cpu=True)
    with pytest.raises(ValueError, match="model 'toy'"):
        settings(["toy"], ["none"], cpu=True)
    quantized = tmp_path / "bagel_fp8.yaml"
    quantized.write_text("model: bagel\nquantization: {llm: fp8}\n")
    with pytest.raises(ValueError, match="pass --quantization"):
        settings([str(quantized)], ["none"], cpu=True)


def test_mode_follows_the_workers_and_profile_needs_inproc(capsys):
    assert parse_args(["--quick"]).mode == "inproc"
    assert parse_args(["--quick", "--configs", "bagel", "bagel_cfg_parallel"]).mode == "multiproc"
    assert parse_args(["--quick", "--configs", "bagel_cfg_parallel", "--mode", "inproc", "--profile"]).profile
    with pytest.raises(SystemExit):
        parse_args(["--quick", "--configs", "bagel", "bagel_cfg_parallel", "--profile"])
    assert "pass --mode inproc" in capsys.readouterr().err


def test_later_images_are_compared_to_the_first():
    reference: dict = {}
    picture, latents = np.zeros((4, 4, 3), np.uint8), torch.ones(1, 4, 8)
    first: dict = {}
    compare_image(first, reference, "generation", picture, latents, "bagel")
    assert first == {"latents_max_abs": 1.0}
    later: dict = {}
    moved = picture.copy()
    moved[0, 0, 0] = 3
    compare_image(later, reference, "generation", moved, latents * 1.5, "bagel")
    assert later["max_pixel_diff_vs_bagel"] == 3 and later["latents_max_abs_diff_vs_bagel"] == 0.5
    assert 50 < later["psnr_db_vs_bagel"] < 70

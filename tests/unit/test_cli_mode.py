"""`mstar serve --mode`: auto (the default) is resolved by the runtime: one process per worker on CUDA
machines, threads otherwise."""

from __future__ import annotations

import torch

from mstar.cli.main import build_parser
from mstar.config import config_from_dict
from mstar.runtime.launcher import Runtime


def test_mode_defaults_to_auto_which_is_threads_without_cuda(monkeypatch):
    assert build_parser().parse_args(["serve", "toy"]).mode == "auto"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    runtime = Runtime(config_from_dict({"model": "toy", "device": "cpu"}), mode="auto")
    try:
        assert runtime.mode == "inproc"
    finally:
        runtime.shutdown()

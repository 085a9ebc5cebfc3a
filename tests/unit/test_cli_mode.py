"""`mstar serve --mode`: auto picks one process per worker on CUDA machines, threads otherwise."""

from __future__ import annotations

import torch

from mstar.cli.main import build_parser, resolve_mode


def test_mode_defaults_to_auto_and_resolves_by_device(monkeypatch):
    args = build_parser().parse_args(["serve", "toy"])
    assert args.mode == "auto"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_mode("auto") == "inproc"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_mode("auto") == "multiproc"
    assert resolve_mode("inproc") == "inproc" and resolve_mode("multiproc") == "multiproc"

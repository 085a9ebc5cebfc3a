"""Autoregressive engine: scheduler (policy), runner (execution), engine (the Engine protocol)."""

from mstar.engines.autoregressive.engine import AutoregressiveEngine

__all__ = ["AutoregressiveEngine"]

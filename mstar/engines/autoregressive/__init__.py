"""Autoregressive engine: batch scheduler (policy), runner (execution), engine (the Engine protocol)."""

from mstar.engines.autoregressive.build import build_autoregressive_engine
from mstar.engines.autoregressive.engine import CONTEXT_PORT, AutoregressiveEngine

__all__ = ["CONTEXT_PORT", "AutoregressiveEngine", "build_autoregressive_engine"]

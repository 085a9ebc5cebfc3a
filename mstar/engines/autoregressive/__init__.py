"""Autoregressive engine: scheduler (policy), runner (execution), engine (the Engine protocol)."""

from mstar.engines.autoregressive.build import ResumingEngine, build_autoregressive_engine
from mstar.engines.autoregressive.engine import AutoregressiveEngine

__all__ = ["AutoregressiveEngine", "ResumingEngine", "build_autoregressive_engine"]

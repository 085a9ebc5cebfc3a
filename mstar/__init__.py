"""mstar: a serving system for composite multimodal models.

A model is a graph of components; a request is a walk over that graph. See docs/structure.md.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    """`from mstar import MStarClient` without importing the SDK (or torch) up front."""
    if name in ("MStarClient", "AsyncMStarClient", "MStarError"):
        import mstar.client

        return getattr(mstar.client, name)
    raise AttributeError(f"module 'mstar' has no attribute {name!r}")

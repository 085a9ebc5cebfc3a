"""mstar: a serving system for composite multimodal models.

A model is a graph of components; a request is a walk over that graph. See docs/structure.md.
"""

__version__ = "0.1.0"

"""Triton / CUDA kernels. Every module here imports triton at import time, so import them lazily
(inside the function that needs them), never from package `__init__` files."""

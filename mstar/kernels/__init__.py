"""Triton kernels: paged attention (kv_store, decode_attention, prefill_attention), the fused
elementwise ops of the decoder layers (fused_ops) and the decode GEMV (skinny_gemm). Every module
here imports triton at import time, so import them lazily (inside the function that needs them),
never from package `__init__` files; they run on CUDA, or on CPU tensors under TRITON_INTERPRET=1
(tests)."""

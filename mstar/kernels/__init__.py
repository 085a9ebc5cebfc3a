"""Triton kernels: paged attention (kv_store, decode_attention, prefill_attention), the fused
elementwise ops of the decoder layers (fused_ops), the decode GEMV (gemv, for <= 4 rows) and the
skinny GEMM that dispatches to it (skinny_gemm), the sparse-MoE experts for a few
(token, expert) slots (moe_small). These modules import triton at import time, so
import them lazily (inside the function that needs them), never from package `__init__` files; they
run on CUDA, or on CPU tensors under TRITON_INTERPRET=1 (tests). `pdl` decides whether the
decode-step kernels launch with Programmatic Dependent Launch (sm_90+) and states the contract they
keep for it. `timing` (graph-based GPU timing of weight-reading calls) imports only torch."""

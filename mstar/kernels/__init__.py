"""Triton kernels that layers and engines share; a kernel that one model alone uses lives in that model's folder.

Paged attention (kv_store, decode_attention, prefill_attention), the fused elementwise ops of the decoder
layers (fused_ops), the decode GEMV (gemv, for <= 4 rows) and the skinny GEMM that dispatches to it
(skinny_gemm), the sparse-MoE experts and router (moe_small, moe_tiled, moe_route), sampling's kernels
(nucleus, fused_sampling), the windowed output head (window_head), Snake activations (snake) and
pinned-host copies inside CUDA graphs (host_copy). These modules import triton at import time, so
import them lazily (inside the function that needs them), never from package `__init__` files; they
run on CUDA, or on CPU tensors under TRITON_INTERPRET=1 (tests). `pdl` decides whether the
decode-step kernels launch with Programmatic Dependent Launch (sm_90+) and states the contract they
keep for it. `timing` (graph-based GPU timing of weight-reading calls) imports only torch; `guard`
(`KernelGuard`) and `scratch` (whose split-K workspaces a launch uses) import no triton either."""

"""GPU kernels (Triton). Import the submodules only where triton is available (CUDA workers, or CPU
tests with TRITON_INTERPRET=1)."""

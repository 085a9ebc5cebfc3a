#!/usr/bin/env bash
# Prepare a bare GPU machine (no internet; torch, triton and transformers preinstalled) for the GPU suite.
#
# On the machine with internet, once (both folders are git-ignored; carry them with the run):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl fastapi==0.115.12 starlette==0.46.2 pydantic pydantic_core \
#       annotated_types typing_inspection msgspec pyzmq uvicorn python_multipart soundfile cffi pycparser \
#       diffusers==0.42.1 flashinfer-python==0.6.0 "apache-tvm-ffi>=0.1.6,<0.2" \
#       openpi-client==0.1.2 websockets msgpack cc-vjepa2==0.0.3 xgrammar==0.2.9 \
#       jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
#       pytest-xdist==3.8.0 execnet==2.1.2
#   (flashinfer 0.6.0: 7.5 MB, JIT-compiles its kernels with the machine's nvcc and ninja; newer
#   releases are over the 64 MiB carry limit or need cutlass-dsl/cuda-tile wheels; its other imports,
#   pynvml, einops, tabulate, requests, jinja2, are in the machine's image)
#   (fastapi 0.115 with its starlette: newer fastapi imports opentelemetry, absent there)
#   (jsonschema and its three: a dependency of mstar (chat tools) that the image lacks; attrs is there)
#   (pytest-xdist: pyproject's addopts pass -n, which pytest refuses without it; GPU runs say -n 0)
#   (PyAV, which `mstar serve` checks at start, is not in the image either and its wheel is 36 MB: download
#   it to .devscratch/avwhl (`pip download --no-deps --only-binary=:all: --python-version 3.12 -d
#   .devscratch/avwhl av`) and carry it once; it is installed below when present, and /tmp/site keeps it
#   for the later calls of a machine that stays warm, which then carry tokenizer folders instead)
#   python3 -c "from mstar.models.common.tokenizer_build import cached_tokenizer_folder as f; f('llama3')"
#   python3 -c "from mstar.models.common.tokenizer_build import omni_tokenizer_folder as f; f()"
#   mkdir -p .devscratch && cp -r /tmp/mstar_tokenizers .devscratch/
# On the GPU machine, from the repo root:
#   source benchmarks/device_setup.sh && OUT=$OUT TAR=1 bash benchmarks/gpu_suite.sh decode
set -u
# A machine that stays warm keeps /tmp: later calls may carry tokenizer folders instead of .whl
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
if [ -d .devscratch/avwhl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .devscratch/avwhl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
mkdir -p /tmp/mstar_tokenizers
if [ -d .devscratch/mstar_tokenizers ]; then cp -r .devscratch/mstar_tokenizers/* /tmp/mstar_tokenizers/; fi
# the folders xz-compressed (`tar cJf .devscratch/tok.tar.xz -C .devscratch mstar_tokenizers`: 5.2 MB for
# the three 18 MB folders), so a call can carry them beside .whl and PyAV's wheel
for t in .devscratch/*tok.tar.xz; do if [ -f "$t" ]; then tar xJf "$t" -C /tmp; fi; done

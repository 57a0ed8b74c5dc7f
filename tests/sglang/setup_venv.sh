#!/usr/bin/env bash
# Build the SEPARATE test venv in which SGLang 0.5.10.post1's Python registries import on CPU.
#
# SGLang pins torch 2.9.1 and CUDA kernels (sgl-kernel) that cannot load here; we install it with
# --no-deps beside torch 2.14.1 + torchvision 0.29.1 (the pair that loads together on this machine)
# plus the light pure-Python deps its registries (quantization, server_args, modelopt_quant,
# hook_manager, linear, parameter) need to import. FusedMoE / the scheduler / the Engine still do
# not import (they need sgl_kernel): tests that need them are GPU tests.
#
# Usage: bash tests/sglang/setup_venv.sh [VENV]   (default .venv-sglang; idempotent; ~2 min here)
set -euo pipefail
VENV="${1:-.venv-sglang}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.sglang-installed"
[ -f "$STAMP" ] && { echo "$VENV ready ($STAMP)"; exit 0; }
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
"${PIP[@]}" "torch==2.14.1" "torchvision==0.29.1"
"${PIP[@]}" --no-deps "sglang==0.5.10.post1"
# Found by importing sglang.srt.layers.quantization / server_args / managers until nothing was missing.
"${PIP[@]}" pybase64 requests IPython aiohttp orjson starlette pyzmq openai partial_json_parser dill \
    sentencepiece compressed-tensors gguf einops msgspec uvloop setproctitle
# Our own test deps (megatron_trace is used from the source tree: PYTHONPATH / rootdir conftest).
"${PIP[@]}" pytest pytest-timeout safetensors "transformers>=5.24,<6" numpy
touch "$STAMP"
echo "$VENV ready"

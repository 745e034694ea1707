#!/usr/bin/env bash
# One command: set everything up, then run kvserve's main job (an offline batch) on the default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/kvserve generate --chat --max-tokens 48 \
  "What is the capital of France?" \
  "Write a haiku about memory." \
  "Explain what a KV cache is in one sentence." \
  "List three primary colors." "$@"

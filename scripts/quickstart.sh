#!/usr/bin/env bash
# One command: set everything up, then run kvserve's main job (an offline batch) on the default model.
# Sampling as SmolLM2's model card has it (temperature 0.2, top_p 0.9) with a mild repetition
# penalty: greedy decoding makes this 135M model repeat itself (the haiku loops). The fixed seed
# makes the run reproducible; any option given to this script overrides these.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/kvserve generate --chat --max-tokens 64 \
  --temperature 0.2 --top-p 0.9 --repetition-penalty 1.1 --sample-seed 1 \
  "What is the capital of France?" \
  "Write a haiku about memory." \
  "Explain what a KV cache is in one sentence." \
  "List three primary colors." "$@"

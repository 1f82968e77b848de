#!/usr/bin/env bash
# Sets up, builds (Release) and runs moe-run. Usage: tools/run.sh [MODEL.gguf] [moe-run flags...]
# With no model (or when the first argument is a flag) it makes a small demo qwen3moe model with
# moe-synth (models/demo-q4_k_m.gguf) and runs on it.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
tools/build.sh >/dev/null
if [ $# -ge 1 ] && [[ "$1" != -* ]]; then
  model=$1; shift
else
  model=models/demo-q4_k_m.gguf
  if [ ! -f "$model" ]; then
    mkdir -p models
    build/bin/moe-synth -o "$model" --preset tiny --vocab tests/data/ggml-vocab-qwen2.gguf --type q4_k_m
  fi
  # The demo without a prompt flag gets a default prompt (`tools/run.sh`, `tools/run.sh -n 8 --json`).
  has_prompt=0
  for a in "$@"; do
    case "$a" in -p|--prompt|--prompt=*|-i|--input|--input=*|--prompt-tokens|--prompt-tokens=*|--inspect|--help|-h|--version) has_prompt=1 ;; esac
  done
  [ $has_prompt = 0 ] && set -- "$@" --prompt "Tell me about the sea."
fi
exec build/bin/moe-run "$model" "$@"

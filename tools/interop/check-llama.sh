#!/usr/bin/env bash
# llama.cpp interoperability of moe-synth files: writes models of several geometries and types,
# runs each through llama.cpp (libllama, greedy; CPU, 2 threads, n_ctx 512, flash attention off, no
# weight repacking — the settings of tests/data/FIXTURES.md) and through moe-run --cpu, and compares
# the greedy tokens and the logits of every position.
#   tools/interop/check-llama.sh LLAMA_SRC [BUILD_DIR]
# LLAMA_SRC: a llama.cpp checkout built with cmake (libllama in LLAMA_SRC/build/bin).
set -euo pipefail
LLAMA=${1:?usage: check-llama.sh LLAMA_SRC [BUILD_DIR]}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN=${2:-$ROOT/build}/bin
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
g++ -O2 -std=c++17 -I"$LLAMA/include" -I"$LLAMA/ggml/include" "$ROOT/tools/interop/llama_dump_logits.cpp" \
  -L"$LLAMA/build/bin" -lllama -lggml -lggml-base -Wl,-rpath,"$LLAMA/build/bin" -o "$WORK/dump"
models=(
  "tiny-q4_k_m|--type q4_k_m" "tiny-q5_k_m|--type q5_k_m" "tiny-q6_k|--type q6_k" "tiny-q8_0|--type q8_0"
  "tiny-bf16|--type bf16" "tiny-f16|--type f16" "tiny-f32|--type f32" "tied-q4_k_m|--tied --layers 3"
  "odd-q4_k_m|--layers 3 --embd 320 --heads 5 --kv-heads 1 --head-dim 64 --experts 6 --experts-used 3 --expert-ffn 192 --seed 9"
  "synthvocab-q8_0|--vocab synthetic --type q8_0"
)
status=0
for m in "${models[@]}"; do
  name=${m%%|*}; args=${m#*|}
  # shellcheck disable=SC2086
  "$BIN/moe-synth" -o "$WORK/$name.gguf" $args 2>/dev/null
  ids=39,301,385,1879,11,220,17,18
  [[ $name == synthvocab* ]] && ids=72,101,108,108,111,32,119,111
  ll=$("$WORK/dump" "$WORK/$name.gguf" $ids 16 "$WORK/$name.f32" 2>/dev/null)
  ours=$("$BIN/moe-run" "$WORK/$name.gguf" --prompt-tokens $ids -n 16 --cpu --threads 2 -q --json \
         --dump-logits "$WORK/$name.npy" | python3 -c "import json,sys; print('gen: '+' '.join(map(str,json.load(sys.stdin)['tokens'])))")
  if [[ "$ll" == "$ours" ]]; then same="greedy tokens identical"; else same="GREEDY TOKENS DIFFER"; status=1; fi
  echo "$name: $same; $(python3 "$ROOT/tools/interop/compare_logits.py" "$WORK/$name.npy" "$WORK/$name.f32")"
done
exit $status

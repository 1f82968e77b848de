#!/usr/bin/env bash
# Benchmark harness: tools/bench.sh MODEL [--llama-bench PATH] [--threads N] [--reps N] [--depth N] ...
# moe-run on the CPU (and the GPU where the build has CUDA and a GPU is present), optionally
# llama-bench on the same file; prints one table and one JSON document. See tools/bench.py --help.
exec python3 "$(dirname "$0")/bench.py" "$@"

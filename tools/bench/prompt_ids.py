#!/usr/bin/env python3
# The token ids of the CLI measurements' prompts in docs/PERFORMANCE.md (version 25 on), for
# `moe-run MODEL --prompt-tokens $(tools/bench/prompt_ids.py N) ...`: N ids, comma-separated, the same on
# every machine and in every session, inside the first 150,010 ids of the Qwen2/Qwen3 vocabulary (so for
# models with that vocabulary, as moe-synth's --vocab tests/data/ggml-vocab-qwen2.gguf files; a smaller
# vocabulary rejects them). tools/bench.py draws its own prompts from a model's ordinary tokens per
# repetition (its prompt_ids); this fixed list is what the recorded CLI rows were measured on.
#   80 and 512: (i * 7919 + offset) % 150000 + 10 (offset 0 for 80 ids, 13 otherwise); other N: a
#   stride of 104729 with offset 7 (the 3,000-token prompt).
# Usage: tools/bench/prompt_ids.py N
import sys

if len(sys.argv) != 2 or not sys.argv[1].isdigit() or int(sys.argv[1]) < 1:
    sys.exit('usage: prompt_ids.py N   (N >= 1 token ids)')
n = int(sys.argv[1])
stride, offset = (7919, 0) if n == 80 else (7919, 13) if n == 512 else (104729, 7)
print(','.join(str((i * stride + offset) % 150000 + 10) for i in range(n)))

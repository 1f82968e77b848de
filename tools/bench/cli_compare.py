#!/usr/bin/env python3
# One line per `moe-run ... --json` output: the backend that ran, decode and prefill tok/s, the F2 guard's
# minimum cosine and time, the token count, VRAM, and whether the tokens are those of the first file
# (`same`, or the first index where they differ): an A/B of two builds or switches on the same prompt.
# Usage: tools/bench/cli_compare.py A.json [B.json ...]
import json, sys

if len(sys.argv) < 2:
    sys.exit('usage: cli_compare.py A.json [B.json ...]')
first = None
for path in sys.argv[1:]:
    try:
        with open(path) as f:
            j = json.load(f)
        t, g, toks = j['timings'], j.get('guard') or {}, j['tokens']
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f'{path}: unreadable ({e})')
        continue
    if first is None:
        first, same = toks, 'first'
    elif toks == first:
        same = 'same'
    else:
        diff = next((i for i, (a, b) in enumerate(zip(toks, first)) if a != b), min(len(toks), len(first)))
        same = f'differ at {diff}'
    print(f"{path}: ran {j['backend']['ran']}, decode {t['decode_tok_s']:.1f} tok/s, prefill {t['prefill_tok_s']:.0f}, "
          f"guard {g.get('min_cosine')} in {g.get('ms')} ms, {len(toks)} tokens ({same}), VRAM {j['memory']['vram_mib']} MiB")

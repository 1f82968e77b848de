#!/usr/bin/env python3
# The time between two decode tokens in a trace of bench_cuda BM_DecodeTrace (a -DMOE_TRACE build): from the
# LM head's last block done to the next token's first Q/K/V block past its wait (the argmax, the copy of the
# token to the host, the next graph's launch, its embedding and RoPE-table kernels and the Q/K/V release),
# against the Q/K/V release inside a token (layers 1..n-1).
# Usage: tools/bench/gap_report.py trace.csv
import os, sys, statistics as st
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trace_instances import read_rows, instances, name_of

inst = [(name_of(k, len(rs)), rs) for k, rs in instances(read_rows(sys.argv[1]))]
gaps, inner, prev = [], [], None
for name, rs in inst:
    wk = [r for r in rs if r[4]]
    if name == 'qkv' and prev is not None and wk:
        (gaps if prev[0] == 'lm_head' else inner).append((min(r[4] for r in wk) - prev[1]) / 1000)
    prev = (name, max(r[10] for r in rs))
print('token gaps (LM head done -> next Q/K/V past its wait, us):', ' '.join(f'{g:.2f}' for g in gaps))
if inner:
    print(f'Q/K/V release inside a token: mean {st.mean(inner):.2f} median {st.median(inner):.2f} us over {len(inner)}')

#!/usr/bin/env python3
# The expert down kernel's phases by layer type from a BM_DecodeTrace CSV (bench_cuda built with -DMOE_TRACE):
# Q4_K_M gives ffn_down_exps Q6_K in the layers where llama.cpp's use_more_bits holds and Q4_K elsewhere. Per
# instance, µs after the first block's mark 1 (past its wait, act's loads issued): act staged (mark 3), rows in
# shared memory (mark 5), MMAs done (mark 4), the blocks' median and last end; means over the instances.
# Usage: tools/bench/down_layers.py trace.csv [n_layers (48)]
import csv, sys, statistics as st
rows = [tuple(int(v) for v in r.values()) for r in csv.DictReader(open(sys.argv[1]))]
nl = int(sys.argv[2]) if len(sys.argv) > 2 else 48
def more_bits(i, n): return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2
down = sorted((r for r in rows if r[0] == 3), key=lambda r: r[3])
inst, cur, seen = [], [], set()
for r in down:
    if r[1] in seen: inst.append(cur); cur, seen = [], set()
    cur.append(r); seen.add(r[1])
if cur: inst.append(cur)
agg = {True: [], False: []}
for i, rs in enumerate(inst):
    q6 = more_bits(i % nl, nl)
    w = min((r[4] for r in rs if r[4]), default=0)
    if not w: continue
    def med(m):
        v = [r[3 + m] - w for r in rs if r[3 + m]]
        return st.median(v) / 1000 if v else float('nan')
    agg[q6].append((med(3), med(5), med(4), st.median(r[10] - w for r in rs) / 1000, max(r[10] - w for r in rs) / 1000))
for q6 in (True, False):
    a = agg[q6]
    if not a: continue
    m = [sum(x[j] for x in a) / len(a) for j in range(5)]
    print(f"{'Q6 layers' if q6 else 'Q4 layers'} ({len(a)} instances): staged {m[0]:.2f}  rows in {m[1]:.2f}  MMAs done {m[2]:.2f}"
          f"  median end {m[3]:.2f}  last end {m[4]:.2f} us after the first wait")

#!/usr/bin/env python3
# Summarises the CSV that bench_cuda BM_DecodeTrace writes (build with -DMOE_TRACE, see kernels/trace.cuh):
# per decode kernel the gap since the previous kernel ended, the spread of block starts, block times,
# the span, and the median time between consecutive marks of the working blocks.
# Usage: tools/bench/trace_report.py trace.csv
import csv, sys, statistics as st
rows = [tuple(int(v) for v in r.values()) for r in csv.DictReader(open(sys.argv[1]))]
rows.sort(key=lambda r: r[3])
inst = []
for r in rows:
    if inst and inst[-1][0] == r[0] and r[3] <= inst[-1][2] + 500:
        inst[-1][1].append(r); inst[-1][2] = max(inst[-1][2], r[10])
    else:
        inst.append([r[0], [r], r[10]])
names = {1: 'gemv', 2: 'gate_up', 3: 'down', 4: 'attn', 5: 'route', 9: 'P-attn', 10: 'P-gate_up', 11: 'P-qkv',
         12: 'P-o_proj', 13: 'P-route', 14: 'P-down'}  # P-: phases of the persistent kernel
agg = {}
prev_end = None
tok_start = inst[0][1][0][3]
for k, rs, e1 in inst:
    n = len(rs)
    s0 = min(r[3] for r in rs); s1 = max(r[3] for r in rs)
    name = names[k]
    if name == 'gemv':
        name = 'lm_head' if n > 1000 or n == 792 else 'qkv' if n >= 300 else 'o_proj' if n >= 100 else 'gemv%d' % n
    gap = (s0 - prev_end) if prev_end else 0
    prev_end = e1
    used = [m for m in range(1, 7) if sum(1 for r in rs if r[3 + m]) * 2 >= 1] if rs else []
    wk = [r for r in rs if all(r[3 + m] for m in used)] or rs
    pts = [0] + used + [7]
    ph = [st.median(r[3 + b] - r[3 + a] for r in wk) for a, b in zip(pts, pts[1:])]
    a = agg.setdefault((name, n), [])
    a.append((gap, s1 - s0, st.median(r[10] - r[3] for r in rs), max(r[10] - r[3] for r in rs), e1 - s0, len(wk), ph))
tot = prev_end - tok_start
print(f"{len(inst)} kernel instances over {tot/1000:.1f} us (2 tokens); phases: medians over working blocks between marks")
print(f"{'kernel':8s} {'blocks':>6s} {'n':>4s} {'gap':>6s} {'ramp':>6s} {'blk_med':>7s} {'blk_max':>7s} {'span':>6s} {'work':>5s}  phases (us)")
for (name, n), a in sorted(agg.items(), key=lambda kv: -sum(x[4] for x in kv[1])):
    m = [sum(x[j] for x in a) / len(a) / 1000 for j in range(5)]
    nph = min(len(x[6]) for x in a)
    ph = [sum(x[6][j] for x in a) / len(a) / 1000 for j in range(nph)]
    wk = sum(x[5] for x in a) / len(a)
    print(f"{name:8s} {n:6d} {len(a):4d} " + " ".join(f"{v:6.2f}" for v in m[:2]) + f" {m[2]:7.2f} {m[3]:7.2f} {m[4]:6.2f} {wk:5.0f}  " + " ".join(f"{v:5.2f}" for v in ph))

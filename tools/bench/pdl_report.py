#!/usr/bin/env python3
# Where the time between decode kernels goes with programmatic dependent launch on: reads the CSV of
# bench_cuda BM_DecodeTrace (a -DMOE_TRACE build, kernels/trace.cuh), in which every traced decode kernel
# sets mark 1 right after its wait for the previous kernel. Per kernel (means over its instances):
#   release  first block past its wait - last block of the previous kernel done (the dependency's latency)
#   crit     last block done - first block past its wait (the kernel's own critical path)
#   tail     last block done - median block done
#   pre      median over the working blocks of mark 1 - block start (the time a block waited: small when
#            its blocks could only start once the previous kernel's left the SMs)
#   phases   medians over the working blocks of mark k - that block's mark 1
# Usage: tools/bench/pdl_report.py trace.csv
import os, sys, statistics as st
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trace_instances import read_rows, instances, name_of
rows = read_rows(sys.argv[1])
inst = instances(rows)
agg, prev_end = {}, None
t_first = min(r[3] for r in rows)
for kind, rs in inst:
    name = name_of(kind, len(rs))
    wk = [r for r in rs if r[4]]
    end = max(r[10] for r in rs)
    if not wk:
        prev_end = end; continue
    w0 = min(r[4] for r in wk)
    ends = sorted(r[10] for r in rs)
    ph = [st.median(r[3 + m] - r[4] for r in wk if r[3 + m]) if any(r[3 + m] for r in wk) else 0 for m in (2, 3, 4, 5, 6)]
    ph.append(st.median(r[10] - r[4] for r in wk))
    a = agg.setdefault(name, [])
    pre = st.median(r[4] - r[3] for r in wk)
    a.append(((w0 - prev_end) if prev_end else 0, end - w0, end - ends[len(ends) // 2], len(wk), ph, pre))
    prev_end = end
print(f"{len(inst)} kernel instances over {(prev_end - t_first) / 1000:.1f} us")
print(f"{'kernel':8s} {'n':>4s} {'release':>7s} {'crit':>6s} {'tail':>6s} {'pre':>5s} {'work':>5s}  mark2..6,end after mark1 (us)")
tot = [0.0, 0.0]
for name, a in sorted(agg.items(), key=lambda kv: -sum(x[1] for x in kv[1])):
    m = [sum(x[j] for x in a) / len(a) / 1000 for j in range(3)]
    tot[0] += sum(x[0] for x in a) / 1000; tot[1] += sum(x[1] for x in a) / 1000
    ph = [sum(x[4][j] for x in a) / len(a) / 1000 for j in range(6)]
    pre = sum(x[5] for x in a) / len(a) / 1000
    print(f"{name:8s} {len(a):4d} {m[0]:7.2f} {m[1]:6.2f} {m[2]:6.2f} {pre:5.2f} {sum(x[3] for x in a) / len(a):5.0f}  " +
          " ".join(f"{v:5.2f}" for v in ph))
print(f"sum release {tot[0]:.1f} us, sum crit {tot[1]:.1f} us")

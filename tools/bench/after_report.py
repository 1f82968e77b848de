#!/usr/bin/env python3
# When a decode kernel's blocks start, wait and reach their marks, measured from the end of the kernel
# before it (its last block done), with the blocks grouped by their start: reads the CSV of bench_cuda
# BM_DecodeTrace (a -DMOE_TRACE build, kernels/trace.cuh). A mark that stays at the same time after the
# previous kernel's end however early its blocks started waits on something global (that kernel's end,
# a shared resource), not on the block's own work. Means over the kernel's instances of the medians of
# each start bucket (0.5 us wide).
# Usage: tools/bench/after_report.py trace.csv KERNEL   (KERNEL as pdl_report.py names it, e.g. qkv)
import os, sys, statistics as st
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trace_instances import read_rows, instances, name_of

if len(sys.argv) != 3:
    sys.exit('usage: after_report.py trace.csv KERNEL')
rows = read_rows(sys.argv[1])
want = sys.argv[2]
buckets, n_inst, prev = {}, 0, None
for kind, rs in instances(rows):
    name = name_of(kind, len(rs))
    if name == want and prev is not None:
        end = max(r[10] for r in prev[1])
        for r in rs:
            b = round((r[3] - end) / 500) * 0.5
            # marks 1..6 (0 when not reached) and the block's end, after the previous kernel's end
            buckets.setdefault(b, []).append([(r[4 + m] - end) if r[4 + m] else None for m in range(6)] + [r[10] - end])
        n_inst += 1
    prev = (name, rs)
if not n_inst:
    sys.exit('no instance of %s after another kernel' % want)
print(f"{want}: {n_inst} instances; times in us after the previous kernel's last block ended")
print(f"{'start':>6s} {'blocks':>6s} " + " ".join(f"{'mark%d' % (m + 1):>6s}" for m in range(6)) + f" {'end':>6s}")
for b in sorted(buckets):
    v = buckets[b]
    cols = []
    for j in range(7):
        xs = [x[j] for x in v if x[j] is not None]
        cols.append(f"{st.median(xs) / 1000:6.2f}" if xs else f"{'-':>6s}")
    print(f"{b:6.1f} {len(v) / n_inst:6.1f} " + " ".join(cols))

#!/usr/bin/env python3
# Per-SM view of a decode trace (bench_cuda BM_DecodeTrace in a -DMOE_TRACE build, kernels/trace.cuh): for
# the Q/K/V, O, gate/up and down kernels, how many SMs ran their blocks, how many blocks each SM took, when
# the SMs with 1, 2 or 3 blocks were done (after the kernel's first wait) and when blocks entered.
# Usage: tools/bench/sm_report.py trace.csv
import collections, os, sys, statistics as st
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trace_instances import read_rows, instances, name_of
inst = instances(read_rows(sys.argv[1]))
res = collections.defaultdict(list)
for kind, rs in inst:
    name = name_of(kind, len(rs))
    if name not in ('qkv', 'gate_up', 'down', 'o_proj'): continue
    w0 = min(r[4] for r in rs if r[4])
    per = collections.defaultdict(list)
    for r in rs: per[r[2]].append(r)
    hist = collections.Counter(len(v) for v in per.values())
    sm_done = {sm: max(r[10] for r in v) - w0 for sm, v in per.items()}
    bycount = collections.defaultdict(list)
    for sm, v in per.items(): bycount[len(v)].append(sm_done[sm])
    last_sm = max(sm_done, key=sm_done.get)
    starts = sorted(r[3] - w0 for r in rs)
    res[name].append((hist, {c: st.mean(v) for c, v in bycount.items()}, len(per[last_sm]), len(per), starts[0], starts[len(starts)//2], starts[-1]))
for name, a in res.items():
    H = collections.Counter()
    for x in a: H.update(x[0])
    D = collections.defaultdict(list)
    for x in a:
        for c, v in x[1].items(): D[c].append(v)
    lastc = collections.Counter(x[2] for x in a)
    print(f"{name}: {len(a)} inst, SMs used {st.mean(x[3] for x in a):.1f}; blocks/SM (mean SMs) {dict(sorted((k, round(v / len(a), 1)) for k, v in H.items()))}; "
          f"SM done (us after first wait) by blocks/SM {{{', '.join(f'{c}: {st.mean(v)/1000:.2f}' for c, v in sorted(D.items()))}}}; "
          f"last SM had {dict(lastc)} blocks; block entry rel first wait min/med/max {st.mean(x[4] for x in a)/1000:.2f}/{st.mean(x[5] for x in a)/1000:.2f}/{st.mean(x[6] for x in a)/1000:.2f}")

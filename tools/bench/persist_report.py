#!/usr/bin/env python3
"""Summarises MOE_PERSIST_PROFILE output (src/cuda/forward_decode.cpp): per phase of the persistent decode
kernel, the work time of the slowest block (its arrive minus its leave of the previous barrier), the
barrier time (first leave minus last arrive) and the skew of the leaves, averaged over the layers; and
the SM clock (clock64 against %globaltimer).
Usage: persist_report.py profile.csv"""
import csv
import sys
from collections import defaultdict

PHASES = ["A qkv", "B attention", "C o-proj", "D router", "E gate/up", "F down"]
rows = defaultdict(dict)
clk = defaultdict(dict)
for r in csv.DictReader(open(sys.argv[1])):
    rows[int(r["barrier"])][int(r["block"])] = (int(r["arrive"]), int(r["leave"]))
    clk[int(r["barrier"])][int(r["block"])] = int(r["clock"])
nbar = max(rows) + 1
work = defaultdict(list)
bar = defaultdict(list)
skew = defaultdict(list)
for k in range(1, nbar):
    prev, cur = rows[k - 1], rows[k]
    w = [cur[b][0] - prev[b][1] for b in cur]
    last_arrive = max(v[0] for v in cur.values())
    leaves = [v[1] for v in cur.values()]
    p = k % len(PHASES)
    work[p].append(max(w) / 1000.0)
    bar[p].append((min(leaves) - last_arrive) / 1000.0)
    skew[p].append((max(leaves) - min(leaves)) / 1000.0)
total = (max(v[1] for v in rows[nbar - 1].values()) - min(v[1] for v in rows[0].values())) / 1000.0
print(f"{nbar} barriers, {len(rows[0])} blocks, first to last leave {total:.1f} us")
print(f"{'phase':14s} {'max work us':>12s} {'barrier us':>11s} {'leave skew us':>14s}")
s = 0.0
for p in range(len(PHASES)):
    if not work[p]:
        continue
    a = sum(work[p]) / len(work[p]); b = sum(bar[p]) / len(bar[p]); c = sum(skew[p]) / len(skew[p])
    s += a + b + c
    print(f"{PHASES[p]:14s} {a:12.2f} {b:11.2f} {c:14.2f}")
print(f"per layer (sum) {s:.1f} us")
b0 = min(rows[0])
cycles = clk[nbar - 1][b0] - clk[0][b0]
ns = rows[nbar - 1][b0][0] - rows[0][b0][0]
print(f"SM clock of block {b0}: {cycles / ns * 1000:.0f} MHz (clock64 over %globaltimer between the first and last arrive)")

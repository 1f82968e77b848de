# The kernel instances of a decode trace (bench_cuda BM_DecodeTrace, kernels/trace.cuh), shared by
# pdl_report.py and sm_report.py: rows as int tuples (kind, block, sm, pad, t0..t7); an instance is a
# run of one kind's records until a block index repeats; names by kind and, for the GEMVs, by grid size.
import csv

NAMES = {1: 'gemv', 2: 'gate_up', 3: 'down', 4: 'attn', 5: 'route'}


def read_rows(path):
    return [tuple(int(v) for v in r.values()) for r in csv.DictReader(open(path))]


def instances(rows):
    inst = []
    for kind in sorted({r[0] for r in rows}):
        cur, seen = [], set()
        for r in sorted((r for r in rows if r[0] == kind), key=lambda r: r[3]):
            if r[1] in seen:
                inst.append((kind, cur))
                cur, seen = [], set()
            cur.append(r)
            seen.add(r[1])
        if cur:
            inst.append((kind, cur))
    inst.sort(key=lambda x: min(r[3] for r in x[1]))
    return inst


def name_of(kind, n):
    name = NAMES.get(kind, str(kind))
    if name == 'gemv':
        name = 'lm_head' if n > 1000 or n in (792, 264) else 'qkv' if n >= 300 else 'o_proj' if n >= 100 else 'gemv%d' % n
    return name

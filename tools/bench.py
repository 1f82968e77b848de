#!/usr/bin/env python3
"""Benchmark harness (issue 6): one model file, moe-run on the CPU and (CUDA build + GPU present) on
the GPU, optionally llama.cpp's llama-bench on the same file, one table and one JSON document.

Figures per backend, each the median of --reps runs with min and max:
  load_ms, prefill_tok_s (a --prompt-token prompt), decode_tok_s (--gen tokens) at depth 0,
  prefill_tok_s and decode_tok_s at depth --depth, ttft_ms (includes the guard), guard_ms,
  peak_rss_mib, vram_mib.
How moe-run's figures are obtained (through its --json output, docs/CLI.md):
  depth 0      : --prompt-tokens <P ids> -n G                      -> prefill of P, decode of G
  depth D      : --prompt-tokens <D ids> -n G                      -> decode of G after D tokens
                 --prompt-tokens <D+P ids> -n 0                    -> prefill of the last P tokens at
                 depth D = P / (prefill_ms(D+P) - prefill_ms(D))
llama-bench runs -p P -n G -d 0,D -r reps (-ngl 0 on the CPU; -ngl 99 -fa 1 on the GPU) with the same
threads; its pp/tg samples give the same median/min/max, and the ratio column is moe-run / llama.cpp.
Only the Python standard library is used.
"""
import argparse
import json
import os
import random
import shutil
import statistics
import struct
import subprocess
import sys

# ---- GGUF metadata (just enough to pick prompt ids and check the context length) ----------------
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_gguf_meta(path, wanted):
    """Returns {key: value} for the keys in `wanted` (arrays as lists); other values are skipped."""
    out = {}
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise SystemExit(f"error: {path}: not a GGUF file")
        _version, _n_tensors, n_kv = struct.unpack("<IQQ", f.read(20))

        def rstr():
            (n,) = struct.unpack("<Q", f.read(8))
            return f.read(n)

        def rval(t, keep):
            if t in _SCALAR:
                fmt = _SCALAR[t]
                return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
            if t == 8:
                s = rstr()
                return s.decode("utf-8", "replace") if keep else None
            if t == 9:
                et, n = struct.unpack("<IQ", f.read(12))
                if et in _SCALAR and not keep:
                    f.seek(n * struct.calcsize(_SCALAR[et]), 1)
                    return None
                if et in _SCALAR:
                    fmt = _SCALAR[et]
                    size = struct.calcsize(fmt)
                    data = f.read(n * size)
                    return list(struct.unpack("<%d%s" % (n, fmt[1]), data))
                return [rval(et, keep) for _ in range(n)]
            raise SystemExit(f"error: {path}: unknown metadata type {t}")

        for _ in range(n_kv):
            key = rstr().decode("utf-8", "replace")
            (t,) = struct.unpack("<I", f.read(4))
            keep = key in wanted
            v = rval(t, keep)
            if keep:
                out[key] = v
    return out


def prompt_ids(meta, n, seed):
    """n ordinary token ids, deterministic."""
    types = meta.get("tokenizer.ggml.token_type")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    n_vocab = len(tokens) if tokens else 1000
    ordinary = None
    if types:
        ordinary = [i for i, t in enumerate(types[:n_vocab]) if t == 1]
    if not ordinary:
        ordinary = list(range(n_vocab))
    rng = random.Random(seed)
    return [rng.choice(ordinary) for _ in range(n)]


# ---- statistics -------------------------------------------------------------------------------------
def summary(samples):
    vals = [v for v in samples if v is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


# ---- moe-run ------------------------------------------------------------------------------------------
class RunFailed(Exception):
    pass


def moe_run(args, backend, ids, n_gen, ctx):
    cmd = [args.moe_run, args.model, "--prompt-tokens", ",".join(map(str, ids)), "-n", str(n_gen),
           "--ctx-size", str(ctx), "--json", "--threads", str(args.threads)]
    cmd += ["--cpu"] if backend == "cpu" else ["--gpu"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        raise RunFailed(f"timed out after {args.timeout} s")
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        raise RunFailed(f"exit {p.returncode}: {last}")
    try:
        return json.loads(p.stdout)
    except json.JSONDecodeError as e:
        raise RunFailed(f"--json output is not JSON: {e}")


def bench_moe(args, backend, meta, context_length):
    P, G, D = args.prompt, args.gen, args.depth
    samples = {k: [] for k in ("load_ms", "prefill_tok_s", "decode_tok_s", "ttft_ms", "guard_ms", "peak_rss_mib",
                               "vram_mib", "prefill_tok_s@depth", "decode_tok_s@depth")}
    notes = []
    do_depth = D > 0
    if do_depth and context_length and D + P + G > context_length:
        notes.append(f"depth {D} skipped: the model's context_length is {context_length}")
        do_depth = False
    for rep in range(args.reps):
        ids = prompt_ids(meta, P, seed=rep)
        j = moe_run(args, backend, ids, G, P + G)
        t, m = j.get("timings", {}), j.get("memory", {})
        if backend == "gpu" and j.get("backend", {}).get("ran") != "cuda":
            raise RunFailed("the run did not stay on the GPU")
        for k in ("load_ms", "prefill_tok_s", "decode_tok_s", "ttft_ms", "guard_ms"):
            samples[k].append(t.get(k))
        samples["peak_rss_mib"].append(m.get("peak_rss_mib"))
        samples["vram_mib"].append(m.get("vram_mib") if backend == "gpu" else None)
        if do_depth:
            deep = prompt_ids(meta, D + P, seed=1000 + rep)
            a = moe_run(args, backend, deep[:D], G, D + G)
            b = moe_run(args, backend, deep, 0, D + P)
            samples["decode_tok_s@depth"].append(a["timings"].get("decode_tok_s"))
            dt = b["timings"]["prefill_ms"] - a["timings"]["prefill_ms"]
            samples["prefill_tok_s@depth"].append(P / (dt / 1000.0) if dt > 0 else None)
            samples["peak_rss_mib"][-1] = max(samples["peak_rss_mib"][-1] or 0, a["memory"].get("peak_rss_mib") or 0,
                                              b["memory"].get("peak_rss_mib") or 0)
    return {k: summary(v) for k, v in samples.items()}, notes


# ---- llama-bench ----------------------------------------------------------------------------------------
def llama_bench(args, backend):
    cmd = [args.llama_bench, "-m", args.model, "-t", str(args.threads), "-p", str(args.prompt), "-n", str(args.gen),
           "-r", str(args.reps), "-o", "json"]
    cmd += ["-d", f"0,{args.depth}" if args.depth > 0 else "0"]
    cmd += ["-ngl", "0"] if backend == "cpu" else ["-ngl", "99", "-fa", "1"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout * 4)
    except subprocess.TimeoutExpired:
        return None, f"llama-bench timed out ({' '.join(cmd)})"
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        return None, f"llama-bench exit {p.returncode}: {last}"
    recs = json.loads(p.stdout)
    if backend == "gpu" and not any("CUDA" in str(r.get("backends", "")) for r in recs):
        return None, "llama-bench has no CUDA backend"
    out = {"command": " ".join(cmd), "build_commit": recs[0].get("build_commit") if recs else None}
    for r in recs:
        depth = r.get("n_depth", 0)
        suffix = "" if depth == 0 else "@depth"
        if r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0:
            out["prefill_tok_s" + suffix] = summary(r.get("samples_ts", []))
        elif r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0:
            out["decode_tok_s" + suffix] = summary(r.get("samples_ts", []))
    return out, None


# ---- report -------------------------------------------------------------------------------------------
ROWS = [("load_ms", "load (ms)"), ("prefill_tok_s", "prefill {P} (tok/s)"), ("decode_tok_s", "decode {G} (tok/s)"),
        ("prefill_tok_s@depth", "prefill {P} @ {D} (tok/s)"), ("decode_tok_s@depth", "decode {G} @ {D} (tok/s)"),
        ("ttft_ms", "TTFT incl. guard (ms)"), ("guard_ms", "guard (ms)"), ("peak_rss_mib", "peak RSS (MiB)"),
        ("vram_mib", "VRAM (MiB)")]


def fmt_stat(s):
    if not s:
        return "-"
    v = s["median"]
    p = 1 if v >= 100 else 2
    return f"{v:.{p}f} [{s['min']:.{p}f}-{s['max']:.{p}f}]"


def print_table(args, results):
    cols = []
    for be, r in results["backends"].items():
        cols.append((f"moe-run {be}", be, "moe"))
        if r.get("llama_bench"):
            cols.append(("llama.cpp", be, "llama"))
            cols.append(("ratio", be, "ratio"))
    header = ["metric (median [min-max])"] + [c[0] for c in cols]
    lines = []
    for key, label in ROWS:
        row = [label.format(P=args.prompt, G=args.gen, D=args.depth)]
        for _, be, kind in cols:
            r = results["backends"][be]
            if kind == "moe":
                row.append(fmt_stat(r["moe_run"].get(key)))
            elif kind == "llama":
                row.append(fmt_stat(r["llama_bench"].get(key)))
            else:
                ratio = r.get("ratio", {}).get(key)
                row.append(f"{ratio:.2f}x" if ratio else "-")
        lines.append(row)
    widths = [max(len(str(x[i])) for x in [header] + lines) for i in range(len(header))]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for row in lines:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    for be, r in results["backends"].items():
        for n in r.get("notes", []):
            print(f"note ({be}): {n}")


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--llama-bench", help="path of llama.cpp's llama-bench, to run on the same file")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
    ap.add_argument("--gen", type=int, default=128, help="generated tokens (default 128)")
    ap.add_argument("--depth", type=int, default=4096, help="context depth of the second set (0 = skip)")
    ap.add_argument("--backends", default="auto", help="auto | cpu | gpu | cpu,gpu")
    ap.add_argument("--moe-run", default=os.environ.get("MOE_RUN") or os.path.join(here, "..", "build", "bin", "moe-run"))
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per moe-run invocation")
    ap.add_argument("--json-out", help="also write the JSON document to this file")
    args = ap.parse_args()
    if not os.path.isfile(args.model):
        sys.exit(f"error: {args.model}: no such file")
    if not os.access(args.moe_run, os.X_OK):
        sys.exit(f"error: {args.moe_run}: moe-run not found (build it, or pass --moe-run / MOE_RUN)")

    meta = read_gguf_meta(args.model, {"general.architecture", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                                       "qwen3moe.context_length"})
    context_length = meta.get("qwen3moe.context_length")
    if args.backends == "auto":
        backends = ["cpu"] + (["gpu"] if shutil.which("nvidia-smi") else [])
    else:
        backends = [b.strip() for b in args.backends.split(",") if b.strip()]

    results = {"model": os.path.abspath(args.model), "file_bytes": os.path.getsize(args.model), "threads": args.threads,
               "reps": args.reps, "prompt": args.prompt, "gen": args.gen, "depth": args.depth, "backends": {}}
    for be in backends:
        print(f"bench: moe-run {be} ...", file=sys.stderr)
        entry = {}
        try:
            entry["moe_run"], entry["notes"] = bench_moe(args, be, meta, context_length)
        except RunFailed as e:
            if be == "gpu" and str(e).startswith("exit 9"):
                print("bench: this moe-run has no CUDA; GPU column skipped", file=sys.stderr)
                continue
            entry = {"moe_run": {}, "notes": [f"moe-run failed: {e}"]}
        if args.llama_bench:
            print(f"bench: llama-bench {be} ...", file=sys.stderr)
            lb, err = llama_bench(args, be)
            if err:
                entry["notes"].append(err)
            else:
                entry["llama_bench"] = lb
                entry["ratio"] = {}
                for k, v in lb.items():
                    ours = entry["moe_run"].get(k) if isinstance(v, dict) else None
                    if ours and v and v["median"]:
                        entry["ratio"][k] = ours["median"] / v["median"]
        results["backends"][be] = entry

    print_table(args, results)
    doc = json.dumps(results, indent=2)
    print(doc)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(doc + "\n")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Writes seed corpora for the fuzz targets into DIR/<target>/ (standard library only).

gguf:      a minimal valid qwen3moe GGUF (1 layer, F32 weights, 16-token vocab) and variants
tokenizer: the llama.cpp tokenizer test strings of tests/data (mode byte + text), raw bytes, ids
chat:      template NUL user NUL system
cli:       NUL-separated argument vectors
"""
import os
import random
import struct
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def gguf_string(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def kv(key, vtype, payload):
    return gguf_string(key) + struct.pack("<I", vtype) + payload


def u32(key, v):
    return kv(key, 4, struct.pack("<I", v))


def f32(key, v):
    return kv(key, 6, struct.pack("<f", v))


def string(key, v):
    return kv(key, 8, gguf_string(v))


def str_array(key, items):
    return kv(key, 9, struct.pack("<IQ", 8, len(items)) + b"".join(gguf_string(s) for s in items))


def i32_array(key, items):
    return kv(key, 9, struct.pack("<IQ", 5, len(items)) + b"".join(struct.pack("<i", v) for v in items))


def mini_model(rng):
    E, H, KVH, HD, X, U, F, V = 32, 2, 1, 16, 4, 2, 32, 16
    arch = "qwen3moe"
    toks = [chr(ord("a") + i) for i in range(V - 2)] + ["<|im_start|>", "<|im_end|>"]
    kvs = [
        string("general.architecture", arch),
        u32(f"{arch}.context_length", 64), u32(f"{arch}.embedding_length", E), u32(f"{arch}.block_count", 1),
        u32(f"{arch}.attention.head_count", H), u32(f"{arch}.attention.head_count_kv", KVH),
        u32(f"{arch}.attention.key_length", HD), u32(f"{arch}.attention.value_length", HD),
        f32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6), f32(f"{arch}.rope.freq_base", 1e6),
        u32(f"{arch}.expert_count", X), u32(f"{arch}.expert_used_count", U),
        u32(f"{arch}.expert_feed_forward_length", F),
        string("tokenizer.ggml.model", "gpt2"), string("tokenizer.ggml.pre", "qwen2"),
        str_array("tokenizer.ggml.tokens", toks), i32_array("tokenizer.ggml.token_type", [1] * (V - 2) + [3, 3]),
        str_array("tokenizer.ggml.merges", ["a b", "c d"]), u32("tokenizer.ggml.eos_token_id", V - 1),
    ]
    tensors = [("token_embd.weight", [E, V]), ("output_norm.weight", [E]), ("output.weight", [E, V]),
               ("blk.0.attn_norm.weight", [E]), ("blk.0.attn_q.weight", [E, H * HD]),
               ("blk.0.attn_k.weight", [E, KVH * HD]), ("blk.0.attn_v.weight", [E, KVH * HD]),
               ("blk.0.attn_output.weight", [H * HD, E]), ("blk.0.attn_q_norm.weight", [HD]),
               ("blk.0.attn_k_norm.weight", [HD]), ("blk.0.ffn_norm.weight", [E]),
               ("blk.0.ffn_gate_inp.weight", [E, X]), ("blk.0.ffn_gate_exps.weight", [E, F, X]),
               ("blk.0.ffn_up_exps.weight", [E, F, X]), ("blk.0.ffn_down_exps.weight", [F, E, X])]
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs)
    infos, data, off = b"", b"", 0
    for name, ne in tensors:
        n = 1
        for d in ne:
            n *= d
        infos += gguf_string(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<q", d) for d in ne)
        infos += struct.pack("<IQ", 0, off)
        blob = b"".join(struct.pack("<f", rng.gauss(0, 0.2) + (1.0 if "norm" in name else 0.0)) for _ in range(n))
        blob += b"\0" * ((-len(blob)) % 32)
        data += blob
        off += len(blob)
    out = head + infos
    out += b"\0" * ((-len(out)) % 32)
    return out + data


def write(d, name, content):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(content if isinstance(content, bytes) else content.encode())


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "seeds"
    rng = random.Random(7)
    model = mini_model(rng)
    write(f"{out}/gguf", "mini.gguf", model)
    write(f"{out}/gguf", "mini-v2.gguf", model[:4] + struct.pack("<I", 2) + model[8:])
    with open(os.path.join(ROOT, "tests/data/ggml-vocab-qwen2.gguf"), "rb") as f:
        write(f"{out}/gguf", "vocab-head.gguf", f.read(4096))
    with open(os.path.join(ROOT, "tests/data/ggml-vocab-qwen2.gguf.inp"), encoding="utf-8") as f:
        cases = f.read().split("\n__ggml_vocab_test__\n")
    # tokenizer: first byte = mode (0 encode with specials, 1 without, 2 raw bytes into the stream
    # decoder, 3 little-endian int32 ids), then the payload.
    special = "<|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>\n\n"
    for i, c in enumerate(cases + [special]):
        write(f"{out}/tokenizer", f"case{i:03d}", b"\x00" + c.encode())
        write(f"{out}/tokenizer", f"nospecial{i:03d}", b"\x01" + c.encode())
    write(f"{out}/tokenizer", "bytes", b"\x02" + "héllo wörld 🙂 \u4e2d\u6587".encode() + b"\xe2\x82\xff\xc3")
    write(f"{out}/tokenizer", "ids", b"\x03" + struct.pack("<8i", 0, 1, 151643, 151644, 151645, 9707, 220, 7))
    # chat: template NUL user NUL system (user alone = no template, --chat on a GGUF without one)
    chatml = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
              "'<|im_end|>' + '\\n' }}{%- endfor %}")
    for i, c in enumerate(cases[:16]):
        write(f"{out}/chat", f"user{i:03d}", c)
        write(f"{out}/chat", f"chatml{i:03d}", "\0".join([chatml, c, "be brief"]))
    write(f"{out}/chat", "thinking", "\0".join([chatml + "{%- if enable_thinking %}{%- endif %}", "hi"]))
    write(f"{out}/chat", "not-chatml", "\0".join(["{{ messages[0].content }}", "hi", "sys"]))
    # cli: NUL-separated argument vectors (argv[0] is added by the target)
    for i, line in enumerate(["m.gguf hi -n 8 --temperature 0.7 --top-k 20",
                              "m.gguf -p hi --top-p 0.95 --min-p 0.05 --seed 1 --json",
                              "m.gguf hi --threads 2 --ctx-size 128 --repeat-penalty 1.1 --repeat-last-n 32",
                              "m.gguf --prompt-tokens 1,2,3 --device 0 -n 0 --stream",
                              "m.gguf hi --top-p 1.5", "m.gguf hi --threads 0", "m.gguf --inspect -f json",
                              "m.gguf hi --chat --system sys --thinking on --stop x --stop y --cpu-mode exact",
                              "m.gguf hi --temperature 1e309", "m.gguf hi --seed 4294967296 -q",
                              "m.gguf --tokenize hi --raw --dump-logits out.npy", "--help", "--version"]):
        write(f"{out}/cli", f"args{i}", "\0".join(line.split(" ")))

if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Regenerates fuzz/seeds/ from the repository's small models (headers only) and hand-made
frames and strings. Run from fuzz/: python3 make_seeds.py. The output is committed; CI does not
run this."""
import json, os, struct

SZ = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def rd(b, p, f):
    return struct.unpack_from("<" + f, b, p)[0], p + struct.calcsize(f)


def rstr(b, p):
    n, p = rd(b, p, "Q")
    return b[p:p + n], p + n


def skip_value(b, p, t):
    if t in SZ:
        return p + SZ[t]
    if t == 8:
        return rstr(b, p)[1]
    if t == 9:
        et, p = rd(b, p, "I")
        n, p = rd(b, p, "Q")
        for _ in range(n):
            p = skip_value(b, p, et)
        return p
    raise ValueError(t)


def metadata(path):
    """[(key, type, raw value bytes)] of a GGUF file."""
    b = open(path, "rb").read()
    p = 8
    _nt, p = rd(b, p, "Q")
    nkv, p = rd(b, p, "Q")
    out = []
    for _ in range(nkv):
        k, p = rstr(b, p)
        t, p = rd(b, p, "I")
        s = p
        p = skip_value(b, p, t)
        out.append((k, t, b[s:p]))
    return out


def trim_array(raw, keep):
    """An array value cut to its first `keep` elements."""
    et, p = rd(raw, 0, "I")
    n, p = rd(raw, p, "Q")
    q = p
    for _ in range(min(n, keep)):
        q = skip_value(raw, q, et)
    return struct.pack("<IQ", et, min(n, keep)) + raw[p:q]


def gguf(kvs, tensors=(), data=b""):
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs))
    for k, t, raw in kvs:
        out += struct.pack("<Q", len(k)) + k + struct.pack("<I", t) + raw
    for name, shape, ty, off in tensors:
        out += struct.pack("<Q", len(name)) + name + struct.pack("<I", len(shape))
        out += b"".join(struct.pack("<Q", d) for d in shape) + struct.pack("<IQ", ty, off)
    out += b"\0" * (-len(out) % 32)
    return out + data


def write(d, name, data):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


models = {
    "stories260K": "../models/stories260K.gguf",
    "tiny-qwen3": "../models/test/tiny-qwen3-Q8_0.gguf",
    "tiny-qwen3moe": "../models/test/tiny-qwen3moe-Q4_0.gguf",
}
for name, path in models.items():
    kvs = metadata(path)
    write("seeds/gguf", f"{name}-meta", gguf(kvs))
    small = [(k, t, trim_array(raw, 8) if t == 9 else raw) for k, t, raw in kvs]
    write("seeds/gguf", f"{name}-meta-small", gguf(small))
    write("seeds/gguf", f"{name}-head4k", open(path, "rb").read()[:4096])
write("seeds/gguf", "empty-v3", gguf([]))
one = [(b"general.architecture", 8, struct.pack("<Q", 5) + b"llama"),
       (b"general.alignment", 4, struct.pack("<I", 32))]
write("seeds/gguf", "one-tensor",
      gguf(one, [(b"token_embd.weight", [4, 2], 0, 0)], struct.pack("<8f", *range(8))))


def frame(kind, payload):
    return struct.pack(">BBHI", 0x54, 1, kind, len(payload)) + payload


write("seeds/frame", "hello", bytes([0x10, 3]) + frame(1, b"hello"))
write("seeds/frame", "two-frames", bytes([0xFF, 0]) + frame(2, struct.pack("<3f", 1, 2, 3))
      + frame(0xFF01, json.dumps({"nonce": 7}).encode()))
write("seeds/frame", "empty-payload", bytes([0, 7]) + frame(5, b""))
write("seeds/frame", "truncated", bytes([1, 1]) + frame(9, b"abcdefgh")[:11])
write("seeds/frame", "too-large", bytes([0, 31]) + frame(3, b"x" * 100))
write("seeds/frame", "bad-magic", bytes([4, 2]) + b"GET / HTTP/1.1\r\n")
write("seeds/frame", "other-version", bytes([4, 2]) + b"\x54\x02\x00\x01\x00\x00\x00\x00")

texts = [
    b"Once upon a time, there was a little girl named Lily.",
    b"  leading spaces\n\nand\ttabs  ",
    "caf\u00e9 na\u00efve \u65e5\u672c\u8a9e \U0001F600 \u2705".encode(),
    b"<s>hello</s> <|endoftext|><|im_start|>user",
    b"12345 1,000,000 3.14159 x=y+z; don't we'll",
    b"\xff\xfe\x80 invalid utf8 \xc3\x28",
]
for i, t in enumerate(texts):
    for sel in (0, 3, 5, 7, 9):
        write("seeds/tokenizer", f"text{i}-sel{sel}", bytes([sel]) + t)


# Whole synthetic models, tiny enough to be seeds: every tensor each architecture needs, with
# the shapes its hyperparameters imply (as ModelConfig::expected_tensors lists them), F32 zeros.
def kv_u32(k, v):
    return (k.encode(), 4, struct.pack("<I", v))


def kv_str(k, v):
    return (k.encode(), 8, struct.pack("<Q", len(v.encode())) + v.encode())


def kv_strs(k, vs):
    raw = struct.pack("<IQ", 8, len(vs)) + b"".join(
        struct.pack("<Q", len(v.encode())) + v.encode() for v in vs)
    return (k.encode(), 9, raw)


def tiny_model(arch, n_expert=0):
    e, f, v, h = 8, 8, 8, 2
    d = e // h
    tok = ["<unk>", "<s>", "</s>", "\u2581a", "\u2581b", "a", "b", "<0x0A>"]
    kvs = [kv_str("general.architecture", arch), kv_str("general.name", "fuzz-" + arch),
           kv_u32(f"{arch}.block_count", 1), kv_u32(f"{arch}.embedding_length", e),
           kv_u32(f"{arch}.attention.head_count", h), kv_u32(f"{arch}.attention.head_count_kv", 1),
           kv_u32(f"{arch}.feed_forward_length", f), kv_u32(f"{arch}.context_length", 64),
           kv_str("tokenizer.ggml.model", "llama"), kv_strs("tokenizer.ggml.tokens", tok)]
    if n_expert:
        kvs += [kv_u32(f"{arch}.expert_count", n_expert), kv_u32(f"{arch}.expert_used_count", 1),
                kv_u32(f"{arch}.expert_feed_forward_length", f)]
    shapes = [("token_embd.weight", [e, v]), ("output_norm.weight", [e])]
    L = "blk.0."
    shapes += [(L + "attn_norm.weight", [e]), (L + "attn_q.weight", [e, h * d]),
               (L + "attn_k.weight", [e, d]), (L + "attn_v.weight", [e, d]),
               (L + "attn_output.weight", [h * d, e])]
    if arch == "qwen2":
        shapes += [(L + "attn_q.bias", [h * d]), (L + "attn_k.bias", [d]), (L + "attn_v.bias", [d])]
    if arch in ("qwen3", "qwen3moe"):
        shapes += [(L + "attn_q_norm.weight", [d]), (L + "attn_k_norm.weight", [d])]
    shapes += [(L + "ffn_norm.weight", [e])]
    if n_expert:
        shapes += [(L + "ffn_gate_inp.weight", [e, n_expert]),
                   (L + "ffn_gate_exps.weight", [e, f, n_expert]),
                   (L + "ffn_up_exps.weight", [e, f, n_expert]),
                   (L + "ffn_down_exps.weight", [f, e, n_expert])]
    else:
        shapes += [(L + "ffn_gate.weight", [e, f]), (L + "ffn_up.weight", [e, f]),
                   (L + "ffn_down.weight", [f, e])]
    tensors, off = [], 0
    for name, shape in shapes:
        tensors.append((name.encode(), shape, 0, off))
        n = 4
        for x in shape:
            n *= x
        off += n + (-n % 32)
    return gguf(kvs, tensors, b"\0" * off)


for arch, n_expert in [("llama", 0), ("qwen2", 0), ("qwen3", 0), ("qwen3moe", 2)]:
    write("seeds/gguf", f"synthetic-{arch}", tiny_model(arch, n_expert))

#!/usr/bin/env python3
"""Record llama.cpp's greedy continuation and top-5 log-probs for a model into reference/.

Runs llama-server (built by `tools/llama-cpp.sh build`) the way reference/README.md describes:
CPU, 2 threads, F32 KV cache, flash attention off, greedy (temperature 0, top_k 1), ignore_eos,
32 tokens per prompt, the three prompts of the other synthetic references. Writes
reference/<model stem>-public.json in the same format as the existing files.

    python3 tools/record_reference.py models/test/tiny-gpt-oss-MXFP4.gguf [...]
    python3 tools/record_reference.py --long 8300 models/test/tiny-llama4-Q8_0.gguf

With `--long N`, one prompt of N seeded pseudo-random token ids (BOS first; numpy-free LCG, so
the test can rebuild it) and 8 greedy tokens, recorded in reference/long/<stem>-<N>.json (same
format; a subdirectory, so reference.rs's sweep over reference/*.json does not pay for it).

LLAMA_CPP_BIN picks another build's bin/ (e.g. `ISA=avx2 tools/llama-cpp.sh build`'s build-avx2);
the build folder's name is written into the `engine` field.

Only the standard library is used.
"""
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.environ.get("LLAMA_CPP_BIN",
                       "/tmp/llama.cpp-build/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin")
PROMPTS = ["Once upon a time", "Lily wanted to", "The little dog"]
N_PREDICT = 32


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def wait_ready(port, proc):
    for _ in range(600):
        if proc.poll() is not None:
            sys.exit(f"llama-server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    sys.exit("llama-server did not become ready")


def version():
    out = subprocess.run([f"{BUILD}/llama-server", "--version"], capture_output=True, text=True)
    line = (out.stdout + out.stderr).strip().splitlines()
    return line[0] if line else "unknown"


def long_prompt(n, vocab=512):
    """BOS, then n - 1 ids in 3..vocab from a 64-bit LCG seeded with 0 (Knuth's MMIX
    constants, the high bits taken)."""
    x, out = 0, [1]
    while len(out) < n:
        x = (x * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        out.append(3 + (x >> 33) % (vocab - 3))
    return out


def record(model, long_n=None):
    port = free_port()
    ctx = str(long_n + 64) if long_n else "512"
    cmd = [f"{BUILD}/llama-server", "-m", model, "-t", "2", "-tb", "2", "--port", str(port),
           "--host", "127.0.0.1", "-ctk", "f32", "-ctv", "f32", "-fa", "off", "-c", ctx,
           "-np", "1", "--no-warmup"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(port, proc)
        results = []
        for prompt in ([f"{long_n} pseudo-random tokens"] if long_n else PROMPTS):
            if long_n:
                toks = long_prompt(long_n)
            else:
                toks = post(port, "/tokenize", {"content": prompt, "add_special": True})["tokens"]
            r = post(port, "/completion", {
                "prompt": toks, "n_predict": 8 if long_n else N_PREDICT, "temperature": 0, "top_k": 1,
                "ignore_eos": True, "n_probs": 5, "cache_prompt": False, "return_tokens": True,
                "samplers": ["top_k"],
            })
            probs = r["completion_probabilities"]
            top5 = []
            for i, p in enumerate(probs):
                t5 = [{"id": x["id"], "logprob": round(x["logprob"], 6)} for x in p["top_logprobs"][:5]]
                top5.append({"pos": i, "chosen_id": p["id"], "top5": t5,
                             "margin": round(t5[0]["logprob"] - t5[1]["logprob"], 6)})
            results.append({"prompt": prompt, "prompt_token_ids": toks,
                            "generated_token_ids": r["tokens"], "generated_text": r["content"],
                            "top5": top5})
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    with open(model, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    doc = {"model": os.path.basename(model), "model_sha256": sha,
           "engine": f"llama.cpp llama-server {version()} ({os.path.basename(os.path.dirname(BUILD))}), "
                     "CPU, 2 threads, F32 KV cache, flash attention off",
           "sampling": {"temperature": 0, "top_k": 1, "n_predict": 8 if long_n else N_PREDICT,
                        "ignore_eos": True},
           "results": results}
    stem = os.path.splitext(os.path.basename(model))[0]
    out = os.path.join(ROOT, "reference", f"{stem}-public.json")
    if long_n:
        os.makedirs(os.path.join(ROOT, "reference", "long"), exist_ok=True)
        out = os.path.join(ROOT, "reference", "long", f"{stem}-{long_n}.json")
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    args = sys.argv[1:]
    long_n = None
    if args[:1] == ["--long"]:
        long_n, args = int(args[1]), args[2:]
    if not args:
        sys.exit(__doc__)
    for m in args:
        record(m, long_n)

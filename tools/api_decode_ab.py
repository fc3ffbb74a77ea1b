#!/usr/bin/env python3
"""Decode speed through the API, A against B: alternates two `tessera` binaries (say, release
builds of two commits), starts `up` (a 2-node cluster) or `serve` with each, streams greedy chat
completions and reports the mean decode tok/s of each (content chunks after the first / time
from the first to the last) and their ratio. A benchmark, not a test.

    tools/api_decode_ab.py BEFORE_BIN AFTER_BIN MODEL.gguf up|serve [ROUNDS] [TOKENS]

A model that decodes faster than the server flushes SSE chunks measures nothing (chunks arrive
coalesced): use one whose tokens take milliseconds (bench-qwen3-dense-q4_0), or, for a model as
fast as stories260K (where the coordinator's own path per token shows most), `TIMING=request`:
unstreamed requests, the answer's completion tokens over the request's whole time."""
import json, os, signal, subprocess, sys, time, urllib.request, tempfile, statistics

if len(sys.argv) < 5 or sys.argv[4] not in ("up", "serve"):
    sys.exit(__doc__)
BINS = {"before": sys.argv[1], "after": sys.argv[2]}
MODEL = sys.argv[3]
MODE = sys.argv[4]
ROUNDS = int(sys.argv[5]) if len(sys.argv) > 5 else 3
TOKENS = int(sys.argv[6]) if len(sys.argv) > 6 else 48
PORT = 18777

def req(path, body=None, timeout=600):
    data = json.dumps(body).encode() if body is not None else None
    r = urllib.request.Request(f"http://127.0.0.1:{PORT}{path}", data=data,
                               headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(r, timeout=timeout)

MODEL_ID = ["m"]

def request_decode():
    body = {"model": MODEL_ID[0], "messages": [{"role": "user", "content": "Tell me a long story about a dragon."}],
            "max_tokens": TOKENS, "temperature": 0}
    t0 = time.perf_counter()
    with req("/v1/chat/completions", body) as r:
        usage = json.load(r)["usage"]
    n = usage["completion_tokens"]
    if n < 8:
        raise RuntimeError(f"only {n} completion tokens")
    return n / (time.perf_counter() - t0)

def stream_decode():
    if os.environ.get("TIMING") == "request":
        return request_decode()
    body = {"model": MODEL_ID[0], "messages": [{"role": "user", "content": "Tell me a long story about a dragon."}],
            "max_tokens": TOKENS, "temperature": 0, "stream": True}
    times = []
    with req("/v1/chat/completions", body) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            ch = ev.get("choices") or []
            if ch and ch[0].get("delta", {}).get("content"):
                times.append(time.perf_counter())
    if len(times) < 8:
        raise RuntimeError(f"only {len(times)} content chunks")
    return (len(times) - 1) / (times[-1] - times[0])

def run(name):
    d = tempfile.mkdtemp(prefix="bench-api-")
    if MODE == "up":
        cmd = [BINS[name], "up", "-m", MODEL, "--nodes", "2", "--threads", "1", "--listen",
               f"127.0.0.1:{PORT}", "--no-sample", "--ctx", "256", "--run-dir", d]
    else:
        cmd = [BINS[name], "serve", "-m", MODEL, "--threads", "2", "--listen",
               f"127.0.0.1:{PORT}", "--ctx", "256"]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    try:
        t0 = time.time()
        while True:
            try:
                with req("/v1/models", timeout=5) as r:
                    models = json.load(r)
                MODEL_ID[0] = models["data"][0]["id"]
                # the cluster answers /v1/models before its epoch is ready: warm up with a request
                stream_decode()
                break
            except Exception:
                if p.poll() is not None or time.time() - t0 > 600:
                    raise RuntimeError(f"{name} did not come up")
                time.sleep(1)
        return [stream_decode() for _ in range(int(os.environ.get("PER_ROUND", "2")))]
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)

res = {"before": [], "after": []}
for i in range(ROUNDS):
    for name in (["before", "after"] if i % 2 == 0 else ["after", "before"]):
        r = run(name)
        res[name] += r
        print(f"round {i} {name}: " + " ".join(f"{x:.1f}" for x in r), flush=True)
for name, xs in res.items():
    print(f"{MODE} {os.path.basename(MODEL)} {name}: mean {statistics.mean(xs):.2f} tok/s "
          f"(n={len(xs)}, min {min(xs):.1f}, max {max(xs):.1f})")
print(f"after/before: {statistics.mean(res['after'])/statistics.mean(res['before']):.3f}")

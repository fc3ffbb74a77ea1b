#!/usr/bin/env python3
"""Throughput of `tessera up` (coordinator + gateway + N local node processes) at 1, 4 and 8
concurrent streams, batched (all at once) against one at a time, and the time to first token
the gateway adds over the ring alone.

Not a test: a measurement for notes. Standard library only.

    cargo build --release -p tessera
    python3 crates/tessera/bench/up_throughput.py \
        --bin target/release/tessera --model /work/benchmodels/bench-qwen3-dense-q4_0.gguf

What is measured, per concurrency c:
  * batched: c streamed /v1/completions started together (temperature 0, distinct prompts,
    max_tokens tokens each); wall time from the first send to the last [DONE]; aggregate
    generated tokens/s; TTFT of each stream (first content chunk), median.
  * one at a time: the same c requests sent one after another; total wall time.
  * ratio: one-at-a-time wall / batched wall (how much batching over the ring buys).
TTFT added by the gateway: the median HTTP TTFT of a lone request, minus the ring's own TTFT
for the same prompt as the coordinator measures it (`tessera run --json`: from starting the
first stage to the first token), on the same cluster.
"""

import argparse
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time


MODEL = ""


def stream_completion(addr, prompt, max_tokens):
    """(ttft_s, tokens, total_s) of one streamed completion."""
    host, port = addr.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    body = json.dumps({
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0, "stream": True,
    })
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"{r.status}: {r.read()[:300]!r}")
    ttft = None
    tokens = 0
    buf = b""
    while True:
        chunk = r.read1(65536) if hasattr(r, "read1") else r.read(1)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            for line in ev.split(b"\n"):
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    continue
                v = json.loads(data)
                text = v["choices"][0].get("text") or ""
                if text or v["choices"][0].get("finish_reason") is None:
                    tokens += 1
                    if ttft is None:
                        ttft = time.perf_counter() - t0
    total = time.perf_counter() - t0
    conn.close()
    return ttft or total, tokens, total


def model_name(addr):
    host, port = addr.split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=30)
    c.request("GET", "/v1/models")
    return json.loads(c.getresponse().read())["data"][0]["id"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/tessera")
    ap.add_argument("--model", default="/work/benchmodels/bench-qwen3-dense-q4_0.gguf")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="compute threads per node")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", default="1,4,8")
    args = ap.parse_args()

    run_dir = tempfile.mkdtemp(prefix="tessera-bench-up-")
    cmd = [args.bin, "up", "--model", args.model, "--nodes", str(args.nodes),
           "--threads", str(args.threads), "--listen", "127.0.0.1:0", "--no-sample",
           "--run-dir", run_dir]
    env = dict(os.environ, TESSERA_LOG="warn")
    up = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                          env=env)
    addr = join = None
    t_start = time.perf_counter()
    for line in up.stdout:
        m = re.match(r"  join       (\S+)", line)
        if m:
            join = m.group(1)
        m = re.match(r"listening on http://(\S+)", line)
        if m:
            addr = m.group(1)
            break
    if addr is None:
        sys.exit("tessera up did not start")
    threading.Thread(target=lambda: [None for _ in up.stdout], daemon=True).start()
    print(f"cluster ready in {time.perf_counter() - t_start:.1f}s at http://{addr}  "
          f"({args.nodes} nodes x {args.threads} thread(s), {os.cpu_count()} CPUs here)")
    global MODEL
    MODEL = model_name(addr)
    try:
        # Warm-up (page cache, first allocations).
        stream_completion(addr, "Warm up", 8)
        prompts = [f"Request {i}: once upon a time in a land far away" for i in range(16)]
        rows = []
        for c in [int(x) for x in args.concurrency.split(",")]:
            ps = prompts[:c]
            results = [None] * c

            def one(i):
                results[i] = stream_completion(addr, ps[i], args.max_tokens)

            t0 = time.perf_counter()
            ths = [threading.Thread(target=one, args=(i,)) for i in range(c)]
            for t in ths:
                t.start()
            for t in ths:
                t.join()
            batched = time.perf_counter() - t0
            toks = sum(r[1] for r in results)
            ttft = statistics.median(r[0] for r in results)
            t0 = time.perf_counter()
            seq_toks = 0
            for p in ps:
                seq_toks += stream_completion(addr, p, args.max_tokens)[1]
            alone = time.perf_counter() - t0
            rows.append((c, toks, batched, toks / batched, ttft, alone, seq_toks / alone,
                         alone / batched))
        print()
        print(f"{'streams':>7} {'tokens':>6} {'batched s':>9} {'tok/s':>7} {'TTFT p50':>9} "
              f"{'1-at-a-time s':>13} {'tok/s':>7} {'ratio':>6}")
        for c, toks, b, bt, ttft, a, at, ratio in rows:
            print(f"{c:>7} {toks:>6} {b:>9.2f} {bt:>7.1f} {ttft * 1e3:>7.0f}ms {a:>13.2f} "
                  f"{at:>7.1f} {ratio:>5.2f}x")
        base = rows[0][3]
        print("aggregate tok/s relative to 1 stream: " +
              ", ".join(f"{r[0]}: {r[3] / base:.2f}x" for r in rows))

        # TTFT: gateway path against the ring alone, same prompt, lone requests.
        prompt = "The history of the city begins"
        http_ttft = statistics.median(stream_completion(addr, prompt, 4)[0] for _ in range(5))
        ring = []
        if join:
            for _ in range(5):
                out = subprocess.run(
                    [args.bin, "run", "--coordinator", join, "--data-dir",
                     os.path.join(run_dir, "client"), "--prompt", prompt, "-n", "4",
                     "--temperature", "0", "--json"],
                    capture_output=True, text=True, timeout=300)
                for line in out.stdout.splitlines():
                    try:
                        v = json.loads(line)
                    except ValueError:
                        continue
                    if v.get("type") == "done":
                        ring.append(v["time_to_first_token_ms"] / 1e3)
        print()
        print(f"TTFT over HTTP (gateway + coordinator + ring), median of 5: "
              f"{http_ttft * 1e3:.1f} ms")
        if ring:
            r = statistics.median(ring)
            print(f"TTFT of the ring alone (coordinator's Start -> first token), median of "
                  f"{len(ring)}: {r * 1e3:.1f} ms")
            print(f"added by the gateway path (HTTP, tokenize, admission, opening the "
                  f"sequence on every stage, relay): {(http_ttft - r) * 1e3:.1f} ms")
    finally:
        up.send_signal(2)
        try:
            up.wait(timeout=30)
        except subprocess.TimeoutExpired:
            up.kill()
        subprocess.run(["rm", "-rf", run_dir])


if __name__ == "__main__":
    main()

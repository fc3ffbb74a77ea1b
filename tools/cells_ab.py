#!/usr/bin/env python3
"""Aggregate throughput of N cells against one, through the API: alternates `tessera up` with one
node holding the model (one cell) and with N nodes each holding it (`--split 0..L,0..L,...`,
N cells), sends STREAMS concurrent greedy chat completions of TOKENS tokens to each, and reports
the mean aggregate completion tokens/s of each configuration (over ROUNDS alternated rounds), the
ratio, and whether every text is identical across configurations. A benchmark, not a test.

    tools/cells_ab.py TESSERA_BIN MODEL.gguf N_LAYER CELLS [ROUNDS] [TOKENS] [STREAMS] [THREADS]
                      [ONE_CELL_THREADS]

THREADS is each node's thread count (default 1); ONE_CELL_THREADS the single cell's (default
THREADS). Give the one cell CELLS x THREADS threads to compare on the same cores. On a machine
with fewer cores than CELLS x THREADS the cells share cores and the ratio shows that, not the
cells' independence."""
import json, os, signal, subprocess, sys, time, urllib.request, tempfile, statistics
from concurrent.futures import ThreadPoolExecutor

if len(sys.argv) < 5:
    sys.exit(__doc__)
BIN, MODEL, N_LAYER, CELLS = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
ROUNDS = int(sys.argv[5]) if len(sys.argv) > 5 else 3
TOKENS = int(sys.argv[6]) if len(sys.argv) > 6 else 64
STREAMS = int(sys.argv[7]) if len(sys.argv) > 7 else 8
THREADS = sys.argv[8] if len(sys.argv) > 8 else "1"
ONE_THREADS = sys.argv[9] if len(sys.argv) > 9 else THREADS
PORT = 18787
PROMPTS = ["Tell me a story about a dragon.", "Once upon a time", "The cat sat on the mat",
           "Lily and Ben went to the park", "A dog found a ball", "The sun was hot",
           "Tom had a red boat", "Sara liked to sing"]

def req(path, body=None, timeout=900):
    data = json.dumps(body).encode() if body is not None else None
    r = urllib.request.Request(f"http://127.0.0.1:{PORT}{path}", data=data,
                               headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(r, timeout=timeout)

MODEL_ID = ["m"]

def complete(i):
    body = {"model": MODEL_ID[0], "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "max_tokens": TOKENS, "temperature": 0}
    with req("/v1/chat/completions", body) as r:
        out = json.load(r)
    return out["choices"][0]["message"]["content"], out["usage"]["completion_tokens"]

def run(cells):
    d = tempfile.mkdtemp(prefix="bench-cells-")
    split = ",".join([f"0..{N_LAYER}"] * cells)
    threads = ONE_THREADS if cells == 1 else THREADS
    cmd = [BIN, "up", "-m", MODEL, "--nodes", str(cells), "--split", split, "--threads", threads,
           "--max-batch", str(STREAMS), "--listen", f"127.0.0.1:{PORT}", "--no-sample",
           "--ctx", "512", "--run-dir", d]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    try:
        t0 = time.time()
        while True:
            try:
                with req("/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except Exception:
                pass
            if time.time() - t0 > 600 or p.poll() is not None:
                raise RuntimeError(f"{cells} cell(s): not serving")
            time.sleep(0.5)
        with req("/v1/models") as r:
            MODEL_ID[0] = json.load(r)["data"][0]["id"]
        complete(0)  # warm every page in
        start = time.perf_counter()
        with ThreadPoolExecutor(STREAMS) as ex:
            results = list(ex.map(complete, range(STREAMS)))
        wall = time.perf_counter() - start
        return sum(n for _, n in results) / wall, [t for t, _ in results]
    finally:
        os.killpg(p.pid, signal.SIGINT)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)

rates = {1: [], CELLS: []}
texts = {}
for r in range(ROUNDS):
    for cells in (1, CELLS):
        rate, t = run(cells)
        rates[cells].append(rate)
        texts.setdefault(cells, t)
        print(f"round {r + 1}: {cells} cell(s): {rate:.1f} tok/s aggregate over {STREAMS} streams",
              flush=True)
one, many = statistics.mean(rates[1]), statistics.mean(rates[CELLS])
print(f"mean: 1 cell {one:.1f} tok/s, {CELLS} cells {many:.1f} tok/s, ratio {many / one:.2f}x "
      f"({ROUNDS} alternated rounds, {STREAMS} streams of {TOKENS} tokens, {ONE_THREADS} thread(s) "
      f"for the one cell, {THREADS} a node for the {CELLS})")
print("texts identical across configurations:", texts[1] == texts[CELLS])

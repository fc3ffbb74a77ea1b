#!/usr/bin/env python3
"""The cost of verifying sealed jobs: starts a coordinator with CELLS single-node cells and their
nodes, then submits JOBS sealed jobs one after another (`tessera client submit --jobs`) with
verification off (`--verify-per-mille 0`) and on every answer (1000), alternating the two for
ROUNDS rounds on fresh clusters, and reports the mean seconds per job of each, their ratio, and
whether the texts agree. A benchmark, not a test.

    tools/sealed_verify_cost.py TESSERA_BIN MODEL.gguf N_LAYER [CELLS] [ROUNDS] [JOBS] [TOKENS]
"""
import json, os, subprocess, sys, tempfile, time, statistics, threading, queue

if len(sys.argv) < 4:
    sys.exit(__doc__)
BIN, MODEL, N_LAYER = sys.argv[1], sys.argv[2], int(sys.argv[3])
CELLS = int(sys.argv[4]) if len(sys.argv) > 4 else 2
ROUNDS = int(sys.argv[5]) if len(sys.argv) > 5 else 3
JOBS = int(sys.argv[6]) if len(sys.argv) > 6 else 20
TOKENS = sys.argv[7] if len(sys.argv) > 7 else "32"
ENV = dict(os.environ, TESSERA_LOG_FORMAT="json")


class Proc:
    """A child whose stdout and stderr JSON lines are collected."""

    def __init__(self, args):
        self.p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  env=ENV, text=True)
        self.lines = queue.Queue()
        self.seen = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            self.lines.put(line)

    def wait_for(self, pred, n=1, timeout=300):
        deadline = time.time() + timeout
        while True:
            hits = [e for e in self.seen if pred(e)]
            if len(hits) >= n:
                return hits[n - 1]
            line = self.lines.get(timeout=max(0.1, deadline - time.time()))
            try:
                self.seen.append(json.loads(line))
            except ValueError:
                pass

    def stop(self):
        self.p.kill()
        self.p.wait()


def cluster(verify):
    d = tempfile.mkdtemp(prefix="bench-sealed-")
    split = ",".join([f"0..{N_LAYER}"] * CELLS)
    coord = Proc([BIN, "coordinator", "-m", MODEL, "--listen", "127.0.0.1:0", "--data-dir",
                  f"{d}/coord", "--split", split, "--verify-per-mille", str(verify)])
    join = coord.wait_for(lambda e: e.get("event") == "join_token")["token"]
    operator = coord.wait_for(lambda e: e.get("event") == "operator_token")["token"]
    nodes = [Proc([BIN, "node", "--data-dir", f"{d}/n{i}", "--name", f"n{i}", "--listen",
                   "127.0.0.1:0", "--threads", "1", "--quick-probe", "--join", join])
             for i in range(CELLS)]
    coord.wait_for(lambda e: e.get("event") == "claims" and e.get("models") == 1, n=CELLS)
    return d, coord, nodes, operator


def submit(d, operator):
    t0 = time.time()
    out = subprocess.run([BIN, "client", "submit", "--coordinator", operator, "--data-dir",
                          f"{d}/client", "-m", MODEL, "-p", "Once upon a time", "-n", TOKENS,
                          "--temperature", "0", "--jobs", str(JOBS), "--workers", str(CELLS),
                          "--json"], capture_output=True, text=True, env=ENV, check=True)
    dt = time.time() - t0
    msgs = [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]
    answers = [m for m in msgs if m.get("type") == "answer"]
    assert len(answers) == JOBS, out.stdout[-2000:]
    return dt / JOBS, [a["text"] for a in answers], sum(a["verified"] for a in answers)


times = {0: [], 1000: []}
texts = set()
for r in range(ROUNDS):
    for verify in ([0, 1000] if r % 2 == 0 else [1000, 0]):
        d, coord, nodes, operator = cluster(verify)
        try:
            per_job, ts, verified = submit(d, operator)
        finally:
            for p in nodes + [coord]:
                p.stop()
        times[verify].append(per_job)
        texts.update(ts)
        print(f"round {r} verify {verify:4}: {per_job * 1000:7.1f} ms a job "
              f"({verified}/{JOBS} verified)", flush=True)
off, on = statistics.mean(times[0]), statistics.mean(times[1000])
print(f"mean ms a job: unverified {off * 1000:.1f}, every answer verified {on * 1000:.1f}, "
      f"ratio {on / off:.2f}x; texts identical: {len(texts) == 1}")

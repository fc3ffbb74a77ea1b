#!/usr/bin/env python3
"""Prompt-prefix reuse through the API: a two-turn chat whose second turn re-sends a long
history (~2,000 tokens by default). Starts `tessera serve` (one process) or `tessera up` (a
2-node ring) with reuse on, streams both turns greedily and measures each turn's time to first
token (request sent -> first content chunk); then starts `tessera serve --prefix-cache 0` and
runs the same conversation, whose second answer must equal the reusing server's (reuse changes
no bit). Each round uses a history of its own, so nothing is reused across rounds. A benchmark,
not a test: on a shared machine, say the load.

    tools/prefix_reuse_ttft.py TESSERA_BIN MODEL.gguf serve|up [ROUNDS] [HISTORY_TOKENS] [ANSWER]

The second turn's new tail is the first answer as the template re-sends it plus a short
question. The synthetic bench models answer with padding tokens whose text re-tokenizes to ~10
tokens each (stories260K's vocabulary), so a short ANSWER (default 24 tokens; 4 keeps the tail
near a real chat's) keeps the tail what a real model's would be.

Reports, per round, the prompt and cached tokens of each turn and both TTFTs, then the mean
ratio second/first (the issue's bar: <= 0.15) and whether every second answer matched."""
import json, os, signal, subprocess, sys, tempfile, time, urllib.request, statistics

if len(sys.argv) < 4 or sys.argv[3] not in ("serve", "up"):
    sys.exit(__doc__)
BIN, MODEL, MODE = sys.argv[1], sys.argv[2], sys.argv[3]
ROUNDS = int(sys.argv[4]) if len(sys.argv) > 4 else 3
HISTORY = int(sys.argv[5]) if len(sys.argv) > 5 else 2000
ANSWER = int(sys.argv[6]) if len(sys.argv) > 6 else 24
PORT = 18779
MODEL_ID = ["m"]


def req(path, body=None, timeout=900):
    data = json.dumps(body).encode() if body is not None else None
    r = urllib.request.Request(f"http://127.0.0.1:{PORT}{path}", data=data,
                               headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(r, timeout=timeout)


def chat(messages):
    """Streams a greedy chat completion: (text, ttft seconds, usage)."""
    body = {"model": MODEL_ID[0], "messages": messages, "max_tokens": ANSWER, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, text, usage = None, [], {}
    with req("/v1/chat/completions", body) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev.get("choices") or []:
                c = ch.get("delta", {}).get("content")
                if c:
                    first = first or time.perf_counter()
                    text.append(c)
    return "".join(text), (first or time.perf_counter()) - t0, usage


def history_text(round_no):
    # Short sentences the tokenizer splits finely (stories260K's 512-token vocabulary: about
    # 2.7 characters a token); a round number first, so rounds share no prefix.
    words = ["Lily", "Tom", "the cat", "a red ball", "the park", "Mom", "a big tree", "the dog"]
    out, i = [f"Story {round_no}. "], 0
    while sum(len(s) for s in out) < HISTORY * 2.7:
        out.append(f"{words[i % 8]} saw {words[(i * 3 + round_no) % 8]} near {words[(i + 5) % 8]}. ")
        i += 1
    return "".join(out)


def conversation(round_no):
    h = history_text(round_no)
    first = [{"role": "user", "content": h}]
    a1, t1, u1 = chat(first)
    second = first + [{"role": "assistant", "content": a1},
                      {"role": "user", "content": "What happened next?"}]
    a2, t2, u2 = chat(second)
    return {"first": (a1, t1, u1), "second": (a2, t2, u2)}


def start(reuse):
    d = tempfile.mkdtemp(prefix="bench-prefix-")
    # The history is about HISTORY tokens; room for the answers, the question and the template.
    ctx = str((int(HISTORY * 1.25) + 12 * ANSWER + 512 + 255) // 256 * 256)
    if MODE == "up" and reuse:
        cmd = [BIN, "up", "-m", MODEL, "--nodes", "2", "--threads", "1", "--listen",
               f"127.0.0.1:{PORT}", "--no-sample", "--ctx", ctx, "--run-dir", d]
    else:
        cmd = [BIN, "serve", "-m", MODEL, "--threads", "2", "--listen", f"127.0.0.1:{PORT}",
               "--ctx", ctx] + ([] if reuse else ["--prefix-cache", "0"])
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    t0 = time.time()
    while True:
        try:
            with req("/v1/models", timeout=5) as r:
                MODEL_ID[0] = json.load(r)["data"][0]["id"]
            # A cluster lists its model before its epoch is ready: warm up with a request.
            chat([{"role": "user", "content": "Hello."}])
            return p
        except Exception:
            if p.poll() is not None or time.time() - t0 > 900:
                stop(p)
                raise RuntimeError("the server did not come up")
            time.sleep(1)


def stop(p):
    os.killpg(p.pid, signal.SIGTERM)
    try:
        p.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)


def main():
    print(f"{MODE}, {MODEL}, {ROUNDS} rounds, ~{HISTORY}-token history, load {os.getloadavg()}")
    ratios, same = [], True
    for r in range(ROUNDS):
        p = start(True)
        try:
            got = conversation(r)
        finally:
            stop(p)
        p = start(False)
        try:
            plain = conversation(r)
        finally:
            stop(p)
        (a1, t1, u1), (a2, t2, u2) = got["first"], got["second"]
        match = plain["first"][0] == a1 and plain["second"][0] == a2
        same &= match
        cached = (u2.get("prompt_tokens_details") or {}).get("cached_tokens")
        ratio = t2 / t1
        ratios.append(ratio)
        print(f"round {r}: turn 1 {u1.get('prompt_tokens')} prompt tokens, TTFT {t1 * 1000:.0f} ms; "
              f"turn 2 {u2.get('prompt_tokens')} prompt tokens ({cached} cached), TTFT "
              f"{t2 * 1000:.0f} ms = {ratio:.3f} of turn 1; without reuse turn 2 TTFT "
              f"{plain['second'][1] * 1000:.0f} ms; answers equal: {match}")
    print(f"mean TTFT ratio (turn 2 / turn 1): {statistics.mean(ratios):.3f} "
          f"(range {min(ratios):.3f}-{max(ratios):.3f}); every answer equal without reuse: {same}; "
          f"load {os.getloadavg()}")
    sys.exit(0 if same else 1)


main()

#!/usr/bin/env python3
"""Summarizes a streamed decode's timeline (`tessera bench --expert-budget B --timeline FILE`).

    tools/timeline-summary.py FILE

Prints, a decode step each: its mean time and the time between steps (the head, the sampler,
the next token's embedding); the experts read (by why: demand, run-ahead, prefetch, fill);
the time the computing thread waited for reads and ran ahead meanwhile; how long the disk
idled, and how much of that fell between one step's last read and the next step's first.

Then a lower bound on the step for a reader that cannot know a token's experts before the
token exists: each step's first demand read starts where it did, every expert that step read
follows back to back at the disk's measured time per expert, nothing is computed after the
last, and a step that read nothing takes the median of those steps. Its ratio to the measured
step is the most any such scheme could gain.
"""
import json
import statistics
import sys


def main(path):
    events = json.load(open(path))["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    by = lambda cat: sorted((e for e in spans if e["cat"] == cat), key=lambda e: e["ts"])
    steps, reads = by("step"), by("read")
    if len(steps) < 2:
        sys.exit("fewer than two steps in the timeline")
    end = lambda e: e["ts"] + e["dur"]
    n = len(steps)
    t0, t1 = steps[0]["ts"], end(steps[-1])
    gaps = [b["ts"] - end(a) for a, b in zip(steps, steps[1:])]
    # The disk is busy while any read runs (the emulated disk serves one after another).
    busy, idle_between, last = [], 0.0, None
    for r in reads:
        s, e = max(r["ts"], t0), min(end(r), t1)
        if e <= s:
            continue
        if busy and s <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], e)
        else:
            busy.append([s, e])
    busy_us = sum(e - s for s, e in busy)
    for (s0, e0), (s1, _) in zip(busy, busy[1:]):
        if any(e0 <= st["ts"] <= s1 for st in steps):
            idle_between += s1 - e0
    experts = {}
    for r in reads:
        if t0 <= r["ts"] <= t1:
            a = r["args"]
            experts.setdefault((a["layer"], a["expert"], a["why"]), r)
    kinds = {}
    for (_, _, why) in experts:
        kinds[why] = kinds.get(why, 0) + 1
    per_expert = busy_us / max(len(experts), 1)
    waits = sum(e["dur"] for e in by("wait"))
    ahead = sum(e["dur"] for e in by("run_ahead"))
    clean = []
    bound = []
    for st in steps:
        inside = [r for r in reads if st["ts"] <= r["ts"] <= end(st)]
        if not inside:
            clean.append(st["dur"])
    c = statistics.median(clean) if clean else statistics.median(s["dur"] for s in steps)
    for st in steps:
        inside = [r for r in reads if st["ts"] <= r["ts"] <= end(st)]
        demand = [r["ts"] for r in inside if r["args"]["why"] == "demand"]
        n_exp = len({(r["args"]["layer"], r["args"]["expert"]) for r in inside})
        first = (min(demand) - st["ts"]) if demand else None
        bound.append(c if first is None else max(c, first + n_exp * per_expert))
    ms = lambda us: us / 1000
    step, gap = statistics.mean(s["dur"] for s in steps), statistics.mean(gaps)
    print(f"{n} steps: {ms(step):.2f} ms a step, {ms(gap):.2f} ms between steps "
          f"({ms(step + gap):.2f} ms a token)")
    print("experts read a step: " + ", ".join(f"{k} {v / n:.2f}" for k, v in sorted(kinds.items()))
          + f"; the disk took {ms(per_expert):.2f} ms an expert")
    print(f"computing thread a step: waiting {ms(waits / n):.2f} ms, running ahead {ms(ahead / n):.2f} ms")
    span = t1 - t0
    print(f"disk busy {100 * busy_us / span:.0f}% of the decode; idle {ms((span - busy_us) / n):.2f} ms"
          f" a step, {ms(idle_between / n):.2f} of it between a step's last read and the next's first")
    lb = statistics.mean(bound) + gap
    print(f"lower bound without knowing a token's experts before it: {ms(lb):.2f} ms a token, "
          f"{100 * lb / (step + gap):.0f}% of the measured {ms(step + gap):.2f}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])

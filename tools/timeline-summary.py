#!/usr/bin/env python3
"""Summarizes a streamed decode's timeline (`tessera bench --expert-budget B --timeline FILE`).

    tools/timeline-summary.py FILE

Prints, a decode step each: its mean time and the time between steps (the head, the sampler,
the next token's embedding); the experts read (by why: demand, run-ahead, prefetch, fill);
the time the computing thread waited for reads and ran ahead meanwhile; how long the disk
idled, and how much of that fell between one step's last read and the next step's first.

Then the best a step could do where nothing can know a token's experts before the token
exists: its first demand read starts where it did, the disk then serves the step's reads back
to back for as long as they took it, and nothing is computed after the last; or the step's own
compute (its time less its waits and running ahead), if that is longer. Its ratio to the measured step is the most any such
scheme could gain.
"""
import json
import statistics
import sys


def busy_within(reads, lo, hi):
    """The intervals in which at least one of `reads` ran, clipped to [lo, hi]."""
    out = []
    for r in sorted(reads, key=lambda r: r["ts"]):
        s, e = max(r["ts"], lo), min(r["ts"] + r["dur"], hi)
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


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
    busy, idle_between = busy_within(reads, t0, t1), 0.0
    busy_us = sum(e - s for s, e in busy)
    for (s0, e0), (s1, _) in zip(busy, busy[1:]):
        if any(e0 <= st["ts"] <= s1 for st in steps):
            idle_between += s1 - e0
    # An expert's read is its three matrices' (gate, up, down): count the gates.
    gates = [r for r in reads if t0 <= r["ts"] <= t1 and r["args"]["matrix"] == 0]
    kinds = {}
    for r in gates:
        kinds[r["args"]["why"]] = kinds.get(r["args"]["why"], 0) + 1
    per_expert = busy_us / max(len(gates), 1)
    waits = sum(e["dur"] for e in by("wait"))
    ahead = sum(e["dur"] for e in by("run_ahead"))
    wait_spans, ahead_spans = by("wait"), by("run_ahead")
    bound = []
    for st in steps:
        lo, hi = st["ts"], end(st)
        inside = [r for r in reads if lo <= r["ts"] <= hi]
        demand = [r["ts"] for r in inside if r["args"]["why"] == "demand"]
        # The step's own compute: its time less its waits and its running ahead.
        idle = sum(e["dur"] for e in wait_spans + ahead_spans if lo <= e["ts"] <= hi)
        compute = st["dur"] - idle
        if not demand:
            bound.append(compute)
            continue
        # The disk time the step's reads took, as they ran (overlaps counted once).
        busy_step = sum(e - s for s, e in busy_within(inside, lo, hi))
        bound.append(max(compute, min(demand) - lo + busy_step))
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
    print(f"best without knowing a token's experts before it: {ms(lb):.2f} ms a token, "
          f"{100 * lb / (step + gap):.0f}% of the measured {ms(step + gap):.2f}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])

#!/usr/bin/env bash
# Issue 31's streaming table: bench-qwen3moe-q4_0 (648 MiB of experts) decoding with its experts
# streamed through budgets of 1.2, 2, 3, 5, 10 and 20 times less than the experts, on one lab host
# whose disk reads are capped at a profile's rates (`tessera lab exec --disk`), each between two
# decodes with every expert in RAM (its compute bound). Prints one JSON report per line, then the
# table (with JSON=0 only the table): each budget's decode against min(disk bound, compute bound),
# where the disk bound is the cap's rate over the missed expert bytes per token (the bench's own
# short disk probe reads above the cap, so its `disk_bound_tok_s` is not used), and the experts a
# step read on demand and ahead (with the share of those read ahead that were used). A budget's
# compute bound is the mean of the two decodes with every expert in RAM on the same lab host (the
# model read through its disk at load) just before and just after its own: the decodes alternate,
# one in RAM between any two budgets' (this VM's speed drifts by ±20% from minute to minute, and
# one short run made the same budget's share 67% and 89% of a compute bound measured minutes
# away). Each store is filled before its decode (`tessera bench` waits for it): the table measures
# the budget, not a cold cache.
#
#   tools/lab-stream-table.sh [DISK]      # DISK: emmc (default), sd, usb, sata-ssd; root
#   MODEL=bench-models/bench-qwen3moe-walk-q4_0.gguf tools/lab-stream-table.sh   # the lab
#       scenarios' MoE (the same geometry and budgets: 648 MiB of experts)
#   N=96 tools/lab-stream-table.sh   # decode N tokens (default 32): the store re-learns each
#       layer's share of the budget from the routing every 16 tokens, so a longer decode
#       measures more of the shares it settles on
#   D=64 tools/lab-stream-table.sh   # decode after D tokens of context (default 0, llama-bench's
#       tg test): a chat's decode always follows a template and a prompt, and this random
#       model's first positions route to experts its later ones seldom use (the README, #31)
#   ROUNDS=3 tools/lab-stream-table.sh   # the budgets R times (default 1), every other round in
#       reverse order: each row is the mean of its budget's runs, its share of min(disk,
#       compute) the mean of the runs' own shares (each against its own compute bound) with
#       their range after it (this VM drifts by ±20% from minute to minute; one pass measures
#       one minute)
#
# Needs tessera (TESSERA=..., default target/release/tessera) and the model
# (tools/make-bench-models.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
T=${TESSERA:-target/release/tessera}
M=${MODEL:-bench-models/bench-qwen3moe-q4_0.gguf}
DISK=${1:-emmc}
N=${N:-32}
D=${D:-0}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
echo "start $(date -u +%H:%M:%S) UTC, $(uptime | sed 's/.*load/load/'), disk $DISK, $M, $N tokens after $D of context" >&2
# One decode on the lab host, its JSON report appended; arguments go to `tessera bench`.
decode() {
  "$T" lab exec --disk "$DISK" -- "$T" bench -t 2 -p 8 -d "$D" -n "$N" -r 1 --json -m "$M" "$@" \
      2>/dev/null >>"$out"
}
budgets=(540 324 216 130 65 32)
decode
for ((round = 0; round < ${ROUNDS:-1}; round++)); do
  for i in "${!budgets[@]}"; do
    # Every other round from the smallest budget up, so no budget always runs first.
    b=${budgets[$(( round % 2 ? ${#budgets[@]} - 1 - i : i ))]}
    decode --expert-budget "${b}MiB"
    decode
  done
done
echo "end $(date -u +%H:%M:%S) UTC, $(uptime | sed 's/.*load/load/')" >&2
[ "${JSON:-1}" = 0 ] || cat "$out"
python3 - "$out" "$DISK" <<'PY'
import json, sys
from statistics import mean
caps = {"emmc": 300e6, "sd": 90e6, "usb": 400e6, "sata-ssd": 550e6}
lines = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
cap = caps.get(sys.argv[2])
# The decodes with every expert in RAM report no streaming; they alternate with the others,
# which group by budget, each run with its compute bound: the mean of the two beside it.
rams = [r for r in lines if not r.get("streaming")]
runs = {}
for i, r in enumerate(lines):
    if r.get("streaming"):
        beside = [n["decode_tok_s"] for n in (lines[i - 1], lines[i + 1]) if not n.get("streaming")]
        runs.setdefault(r["streaming"]["budget_bytes"], []).append((r, mean(beside)))
experts = 648 * 2**20
disk_bound = lambda missed: cap / missed if cap and missed > 0 else float("inf")
print("all experts in RAM (the compute bounds): "
      + ", ".join(f"{r['decode_tok_s']:.1f}" for r in rams)
      + f" tok/s, in turn with the budgets' decodes; disk {sys.argv[2]}"
      + (f" capped at {cap/1e6:.0f} MB/s" if cap else ""))
print("| budget | over budget | runs | tok/s | compute bound tok/s | hit rate | missed MiB/token"
      " | reads / step (ahead, used) | read wait / step, ms | building / step, ms"
      " | disk bound tok/s | of min(disk, compute) |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for budget in sorted(runs, reverse=True):
    pairs = runs[budget]
    rs = [r for r, _ in pairs]
    m = lambda k: mean(r["streaming"].get(k, 0) for r in rs)
    tok = mean(r["decode_tok_s"] for r in rs)
    compute = mean(c for _, c in pairs)
    missed = m("missed_bytes_per_token")
    disk = disk_bound(missed)
    each = [100 * r["decode_tok_s"]
            / min(disk_bound(r["streaming"]["missed_bytes_per_token"]), c) for r, c in pairs]
    share = f"{mean(each):.0f}%"
    if len(rs) > 1:
        share += f" ({min(each):.0f}–{max(each):.0f}%)"
    print(f"| {budget/2**20:.0f} MiB | {experts/budget:.1f}x | {len(rs)} | {tok:.1f} | {compute:.1f}"
          f" | {100*m('hit_rate'):.1f}% | {missed/2**20:.2f}"
          f" | {m('misses_per_step'):.1f} ({m('prefetches_per_step'):.1f},"
          f" {100*m('prefetch_useful'):.0f}%)"
          f" | {m('read_wait_ms_per_step'):.1f} of {m('step_ms'):.1f}"
          f" | {m('build_ms_per_step'):.1f} | {disk:.1f} | {share} |")
PY

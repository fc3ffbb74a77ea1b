#!/usr/bin/env bash
# Issue 31's streaming table: bench-qwen3moe-q4_0 (648 MiB of experts) decoding with its experts
# streamed through budgets of 1.2, 2, 3, 5, 10 and 20 times less than the experts, on one lab host
# whose disk reads are capped at a profile's rates (`tessera lab exec --disk`), after one decode
# with every expert in RAM (the compute bound). Prints one JSON report per line.
#
#   tools/lab-stream-table.sh [DISK]      # DISK: emmc (default), sd, usb, sata-ssd; root
#
# Needs tessera (TESSERA=..., default target/release/tessera) and the model
# (tools/make-bench-models.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
T=${TESSERA:-target/release/tessera}
M=bench-models/bench-qwen3moe-q4_0.gguf
DISK=${1:-emmc}
echo "start $(date -u +%H:%M:%S) UTC, $(uptime | sed 's/.*load/load/'), disk $DISK" >&2
"$T" bench -t 2 -p 8 -n 32 -r 1 --json -m "$M" 2>/dev/null
for b in 540 324 216 130 65 32; do
  "$T" lab exec --disk "$DISK" -- "$T" bench -t 2 -p 8 -n 32 -r 1 --json \
      --expert-budget "${b}MiB" -m "$M" 2>/dev/null
done
echo "end $(date -u +%H:%M:%S) UTC, $(uptime | sed 's/.*load/load/')" >&2

#!/usr/bin/env bash
# Issue 32's speedup table: a speculating scenario (`[workload] speculate = k`) run with its links'
# round trip set to each of 0.3, 5 and 40 ms, the ring forced with SPLIT, each run's table printed
# (the speculating lines give the speedup, the drafts accepted, the planner's calibrated price and
# the text against one process's).
#
#   tools/lab-speculate.sh SCENARIO MODEL SPLIT [RTT_MS...]     # root
#   PREDICT=1 tools/lab-speculate.sh ...   # draft from one process's text (the ceiling)
#
# Needs tessera (TESSERA=..., default target/release/tessera).
set -euo pipefail
cd "$(dirname "$0")/.."
T=${TESSERA:-target/release/tessera}
SCENARIO=$1 MODEL=$2 SPLIT=$3
shift 3
RTTS=("${@:-0.3 5 40}")
# A copy beside the scenario, so that its relative paths still hold.
TMP="$(dirname "$SCENARIO")/.lab-speculate-$$.toml"
trap 'rm -f "$TMP"' EXIT
for rtt in ${RTTS[@]}; do
  sed -E "s/^rtt_ms = .*/rtt_ms = $rtt/" "$SCENARIO" > "$TMP"
  if [ "${PREDICT:-0}" = 1 ]; then
    sed -i -E 's/^(speculate = .*)$/\1\npredict = true/' "$TMP"
  fi
  echo "== rtt $rtt ms, start $(date -u +%H:%M:%S) UTC, $(uptime | sed 's/.*load/load/')"
  "$T" lab run --split "$SPLIT" --model "$MODEL" "$TMP" 2>/dev/null
done
echo "== end $(date -u +%H:%M:%S) UTC, $(uptime | sed 's/.*load/load/')"

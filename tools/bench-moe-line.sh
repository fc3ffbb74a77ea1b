#!/usr/bin/env bash
# Issue 18's speed line: `tessera bench` beside `llama-bench`, 2 threads, a 64-token prompt and
# 64 decoded tokens, 3 timed runs each, on the benchmark-size gpt-oss (MXFP4) and deepseek2
# (Q4_K_M, IQ2_XXS) models, the two programs alternating (which one goes first swaps every
# round). Prints each side's mean tok/s over the rounds and tessera / llama.cpp.
#
#   tools/bench-moe-line.sh [ROUNDS]      # default 2 rounds; about 6 minutes on the 2-core VM
#
# Needs target/release/tessera (CARGO_INCREMENTAL=0 cargo build --release -p tessera), llama.cpp's
# llama-bench (tools/llama-cpp.sh build; or set LLAMA_BENCH) and the models
# (tools/make-bench-models.sh). Run it on a quiet machine: llama.cpp's threads wait by spinning,
# which other load punishes more than it punishes tessera.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-2}
LB=${LLAMA_BENCH:-/tmp/llama.cpp-build/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-bench}
TS=target/release/tessera
MODELS=(bench-gpt-oss-mxfp4 bench-deepseek2-q4_k_m bench-deepseek2-iq2_xxs)
[ -x "$TS" ] || { echo "build tessera first: CARGO_INCREMENTAL=0 cargo build --release -p tessera" >&2; exit 1; }
[ -x "$LB" ] || { echo "no llama-bench at $LB: tools/llama-cpp.sh build, or set LLAMA_BENCH" >&2; exit 1; }
for m in "${MODELS[@]}"; do
    [ -f "bench-models/$m.gguf" ] || { echo "missing bench-models/$m.gguf: tools/make-bench-models.sh" >&2; exit 1; }
done
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

tessera() { "$TS" bench -t 2 -p 64 -n 64 -r 3 --json -m "bench-models/$1.gguf" 2>/dev/null >>"$out/$1.tessera"; }
llama() { "$LB" -m "bench-models/$1.gguf" -t 2 -p 64 -n 64 -r 3 -o jsonl 2>/dev/null >>"$out/$1.llama"; }

echo "start $(date -u +%H:%M:%S) UTC, $(uptime | sed 's/.*load/load/')"
for r in $(seq 1 "$ROUNDS"); do
    for m in "${MODELS[@]}"; do
        if [ $((r % 2)) = 1 ]; then tessera "$m"; llama "$m"; else llama "$m"; tessera "$m"; fi
        echo "round $r $m done $(date -u +%H:%M:%S) UTC, $(uptime | sed 's/.*load/load/')"
    done
done

python3 - "$out" "${MODELS[@]}" <<'EOF'
import json, sys
out, models = sys.argv[1], sys.argv[2:]
def lines(path):
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip().startswith("{")]
mean = lambda xs: sum(xs) / len(xs)
print(f"{'model':24} {'test':5} {'tessera':>8} {'llama.cpp':>9} {'ratio':>6}  tessera rounds / llama.cpp rounds")
for m in models:
    ts, lc = lines(f"{out}/{m}.tessera"), lines(f"{out}/{m}.llama")
    for test, tkey, lsel in [("pp64", "prefill_tok_s", lambda x: x["n_prompt"] == 64 and x["n_gen"] == 0),
                             ("tg64", "decode_tok_s", lambda x: x["n_gen"] == 64 and x["n_prompt"] == 0)]:
        a = [x[tkey] for x in ts]
        b = [x["avg_ts"] for x in lc if lsel(x)]
        if not a or not b:
            print(f"{m:24} {test:5} missing results (tessera {len(a)}, llama.cpp {len(b)})")
            continue
        rounds = " ".join(f"{v:.1f}" for v in a) + " / " + " ".join(f"{v:.1f}" for v in b)
        print(f"{m:24} {test:5} {mean(a):8.1f} {mean(b):9.1f} {mean(a) / mean(b):5.2f}x  {rounds}")
EOF
echo "end $(date -u +%H:%M:%S) UTC, $(uptime | sed 's/.*load/load/')"

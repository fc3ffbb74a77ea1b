#!/usr/bin/env bash
# Builds llama.cpp's CPU tools (llama-bench, llama-server, llama-eval-callback, llama-quantize,
# llama-imatrix) for side-by-side comparisons and for quantizing the synthetic fixtures, from the llama.cpp source vendored in the llama-cpp-python sdist on PyPI (the only
# registry this project's machines reach). Not used by the tests.
#
#   tools/llama-cpp.sh build [DIR]            # default DIR: /tmp/llama.cpp-build
#   tools/llama-cpp.sh bench MODEL.gguf...    # llama-bench and `tessera bench`, alternately
#   tools/llama-cpp.sh matrix MODEL.gguf...   # prefill 512 and decode 64, both sides with 2
#                                             # threads, alternately, ROUNDS=N times (default
#                                             # 3); prints each side's mean and the ratio per
#                                             # model and test.
#   tools/llama-cpp.sh long MODEL.gguf...     # long context: prefill of 2,048 and 8,192 tokens
#                                             # and decode of 32 at depth 4,096, both sides with
#                                             # 2 threads and an F16 cache (llama.cpp -fa 1),
#                                             # alternately; prints each side's mean and the
#                                             # ratio per test. ROUNDS=N (default 1) repeats
#                                             # each model's tests N times, alternating again.
#                                             # PROMPTS=512,2048 and DEPTH=1024 change the
#                                             # lengths (a quick check of the setup).
#
# ISA=avx2 (for build, bench, long and matrix) uses a second llama.cpp build made with
# -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF and runs tessera with TESSERA_MAX_ISA=avx2:
# the fair comparison for the laptops and desktops that have no AVX-512. Without it both sides
# use everything the CPU has.
#
# LLAMA_BENCH=PATH (for bench, long and matrix) runs another llama-bench in llama.cpp's place:
# ik_llama.cpp's, the CPU-tuned fork (build only its llama-bench target).
#
# llama-cpp-python 0.3.36 vendors ggml 0.25.3, the version reference/ was made with.
set -euo pipefail
VERSION=0.3.36
DIR=${2:-/tmp/llama.cpp-build}
SRC=$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp
case "${ISA:-native}" in
    native) BUILD=build; ISA_FLAGS=(-DGGML_NATIVE=ON) ;;
    avx2) BUILD=build-avx2; ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON
        -DGGML_F16C=ON -DGGML_AVX512=OFF); export TESSERA_MAX_ISA=avx2 ;;
    *) echo "ISA must be native or avx2" >&2; exit 2 ;;
esac

build() {
    mkdir -p "$DIR"
    if [ ! -d "$SRC" ]; then
        # The project-wide JSON lists every release (the per-version one is not always served);
        # its file URLs may be relative to the JSON's own address.
        local index=https://pypi.org/pypi/llama-cpp-python/json
        url=$(curl -s --max-time 60 "$index" | python3 -c '
import json, sys, urllib.parse
files = json.load(sys.stdin)["releases"][sys.argv[2]]
print(urllib.parse.urljoin(sys.argv[1], [f["url"] for f in files if f["filename"].endswith(".tar.gz")][0]))
' "$index" "$VERSION")
        curl -s --max-time 600 -o "$DIR/src.tar.gz" "$url"
        tar xzf "$DIR/src.tar.gz" -C "$DIR"
    fi
    command -v cmake >/dev/null || python3 -m pip install -q cmake
    cmake -S "$SRC" -B "$SRC/$BUILD" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF "${ISA_FLAGS[@]}" >/dev/null
    # TARGETS=llama-bench builds only what `bench`, `long` and `matrix` need.
    # shellcheck disable=SC2086
    cmake --build "$SRC/$BUILD" -j"$(nproc)" --target \
        ${TARGETS:-llama-bench llama-server llama-eval-callback llama-quantize llama-imatrix}
    echo "built: $SRC/$BUILD/bin"
}

bench() {
    local lb=${LLAMA_BENCH:-$SRC/$BUILD/bin/llama-bench}
    [ -x "$lb" ] || { echo "run '$0 build' first" >&2; exit 1; }
    cargo build --release -q -p tessera
    for m in "$@"; do
        echo "== $m ($(uptime | sed 's/.*load/load/'))"
        "$lb" -m "$m" -t 2 -p 64 -n 64 -r 3 | grep -E "pp64|tg64"
        target/release/tessera bench -t 2 -m "$m" | grep -E "prefill|decode"
    done
}

# One run per prefill length (-r 1; the 8,192-token prefill takes a minute or two per side on two
# cores), three per decode (32 tokens each; the depth is filled once, untimed, on both sides).
# llama-bench's warmup would prefill each prompt once more untimed (minutes at 8,192), so it is
# skipped and a 64-token test run first warms its weights instead (not reported). Both sides
# start each prefill with an empty cache and fill it as they go.
long() {
    local lb=${LLAMA_BENCH:-$SRC/$BUILD/bin/llama-bench}
    [ -x "$lb" ] || { echo "run '$0 build' first" >&2; exit 1; }
    cargo build --release -q -p tessera
    local out; out=$(mktemp -d)
    local rounds=${ROUNDS:-1} prompts=${PROMPTS:-2048,8192} depth=${DEPTH:-4096}
    echo "raw results (JSON lines, one per test and side): $out/runs"
    for m in "$@"; do
        for r in $(seq "$rounds"); do
            echo "== $(date -u +%H:%M:%S) $m round $r ($(uptime | sed 's/.*load/load/'))"
            target/release/tessera bench -t 2 -m "$m" -p "$prompts" -n 0 -r 1 --json \
                | sed "s|^|$m\ttessera\t|" >>"$out/runs"
            "$lb" -m "$m" -t 2 -fa 1 -ctk f16 -ctv f16 -p "64,$prompts" -n 0 -r 1 --no-warmup \
                -o jsonl | sed "s|^|$m\tllama.cpp\t|" >>"$out/runs"
            "$lb" -m "$m" -t 2 -fa 1 -ctk f16 -ctv f16 -p 0 -n 32 -d "$depth" -r 3 -o jsonl \
                | sed "s|^|$m\tllama.cpp\t|" >>"$out/runs"
            target/release/tessera bench -t 2 -m "$m" -p 0 -n 32 -d "$depth" -r 3 --json \
                | sed "s|^|$m\ttessera\t|" >>"$out/runs"
        done
    done
    echo "== $(date -u +%H:%M:%S) done ($(uptime | sed 's/.*load/load/'))"
    summarize "$out/runs"
    rm -r "$out"
}

# Prefill 512 and decode 64 tokens on both sides, alternating which goes first each round, so
# that the VM's minute-to-minute drift falls on both alike. Each side reports a mean of 3 runs per
# round; the summary is the mean over rounds.
matrix() {
    local lb=${LLAMA_BENCH:-$SRC/$BUILD/bin/llama-bench}
    [ -x "$lb" ] || { echo "run 'ISA=${ISA:-native} $0 build' first" >&2; exit 1; }
    cargo build --release -q -p tessera
    local out; out=$(mktemp -d)
    local rounds=${ROUNDS:-3}
    echo "ISA=${ISA:-native} (tessera: TESSERA_MAX_ISA=${TESSERA_MAX_ISA:-unset}; llama.cpp: $BUILD)"
    for r in $(seq "$rounds"); do
        for m in "$@"; do
            echo "== $(date -u +%H:%M:%S) $m round $r ($(uptime | sed 's/.*load/load/'))"
            run_tessera() {
                target/release/tessera bench -t 2 -m "$m" -p 512 -n 64 -r 3 --json \
                    | sed "s|^|$m\ttessera\t|" >>"$out/runs"
            }
            run_llama() {
                # JSON, one record a line: ik_llama.cpp's llama-bench has no jsonl.
                "$lb" -m "$m" -t 2 -p 512 -n 64 -r 3 -o json | json_lines \
                    | sed "s|^|$m\tllama.cpp\t|" >>"$out/runs"
            }
            if [ $((r % 2)) = 1 ]; then run_tessera; run_llama; else run_llama; run_tessera; fi
        done
    done
    summarize "$out/runs"
    echo "raw results (JSON lines, one per test and side): $out/runs"
}

# A JSON array on stdin as one record a line.
json_lines() {
    python3 -c 'import json, sys; [print(json.dumps(r)) for r in json.load(sys.stdin)]'
}

# Reads JSON lines tagged "model<TAB>side<TAB>" and prints each side's mean per model and test.
summarize() {
    python3 - "$1" <<'PY'
import collections, json, os, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    model, side, rec = line.rstrip("\n").split("\t", 2)
    r = json.loads(rec)
    if side == "tessera":
        # One record holds a run's prefill and decode figures; either may be absent (0).
        tests = []
        if r["n_prompt"]:
            tests.append((f"pp{r['n_prompt']}", r["prefill_tok_s"]))
        if r["n_gen"]:
            d = r["depth"]
            tests.append((f"tg{r['n_gen']}" + (f" @ d{d}" if d else ""), r["decode_tok_s"]))
    else:
        p, n, d, ts = r["n_prompt"], r["n_gen"], r.get("n_depth", 0), r["avg_ts"]
        if p == 64:
            continue  # the long test's warm-up
        tests = [(f"pp{p}" if p else (f"tg{n} @ d{d}" if d else f"tg{n}"), ts)]
    for test, ts in tests:
        runs[(os.path.basename(model), test, side)].append(ts)
print(f"{'model':34} {'test':14} {'tessera tok/s':>14} {'llama.cpp tok/s':>16} {'ratio':>7}")
for model, test in dict.fromkeys((m, t) for m, t, _ in runs):
    a, b = runs[(model, test, "tessera")], runs[(model, test, "llama.cpp")]
    if a and b:
        ma, mb = sum(a) / len(a), sum(b) / len(b)
        print(f"{model:34} {test:14} {ma:14.1f} {mb:16.1f} {ma / mb:6.2f}x")
PY
}

case "${1:-}" in
    build) build ;;
    bench) shift; DIR=/tmp/llama.cpp-build; SRC=$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp; bench "$@" ;;
    long) shift; DIR=/tmp/llama.cpp-build; SRC=$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp; long "$@" ;;
    matrix) shift; DIR=/tmp/llama.cpp-build; SRC=$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp; matrix "$@" ;;
    *) sed -n '2,28p' "$0"; exit 2 ;;
esac

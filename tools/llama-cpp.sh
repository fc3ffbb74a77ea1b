#!/usr/bin/env bash
# Builds llama.cpp's CPU tools (llama-bench, llama-server, llama-eval-callback, llama-quantize,
# llama-imatrix) for side-by-side comparisons and for quantizing the synthetic fixtures, from the llama.cpp source vendored in the llama-cpp-python sdist on PyPI (the only
# registry this project's machines reach). Not used by the tests.
#
#   tools/llama-cpp.sh build [DIR]            # default DIR: /tmp/llama.cpp-build
#   tools/llama-cpp.sh bench MODEL.gguf...    # llama-bench and `tessera bench`, alternately
#
# llama-cpp-python 0.3.36 vendors ggml 0.25.3, the version reference/ was made with.
set -euo pipefail
VERSION=0.3.36
DIR=${2:-/tmp/llama.cpp-build}
SRC=$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp

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
    cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DGGML_NATIVE=ON >/dev/null
    cmake --build "$SRC/build" -j"$(nproc)" --target llama-bench llama-server llama-eval-callback \
        llama-quantize llama-imatrix
    echo "built: $SRC/build/bin"
}

bench() {
    local lb=$SRC/build/bin/llama-bench
    [ -x "$lb" ] || { echo "run '$0 build' first" >&2; exit 1; }
    cargo build --release -q -p tessera
    for m in "$@"; do
        echo "== $m ($(uptime | sed 's/.*load/load/'))"
        "$lb" -m "$m" -t 2 -p 64 -n 64 -r 3 | grep -E "pp64|tg64"
        target/release/tessera bench -t 2 -m "$m" | grep -E "prefill|decode"
    done
}

case "${1:-}" in
    build) build ;;
    bench) shift; DIR=/tmp/llama.cpp-build; SRC=$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp; bench "$@" ;;
    *) sed -n '2,10p' "$0"; exit 2 ;;
esac

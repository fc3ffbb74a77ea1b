#!/usr/bin/env bash
# Builds llama.cpp's CPU tools (llama-bench, llama-server, llama-eval-callback) for side-by-side
# comparisons, from the llama.cpp source vendored in the llama-cpp-python sdist on PyPI (the only
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
        url=$(curl -s --max-time 60 "https://pypi.org/pypi/llama-cpp-python/$VERSION/json" |
            python3 -c 'import json,sys; print([u["url"] for u in json.load(sys.stdin)["urls"] if u["filename"].endswith(".tar.gz")][0])')
        curl -s --max-time 600 -o "$DIR/src.tar.gz" "$url"
        tar xzf "$DIR/src.tar.gz" -C "$DIR"
    fi
    command -v cmake >/dev/null || python3 -m pip install -q cmake
    cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DGGML_NATIVE=ON >/dev/null
    cmake --build "$SRC/build" -j"$(nproc)" --target llama-bench llama-server llama-eval-callback
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

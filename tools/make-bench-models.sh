#!/usr/bin/env bash
# Writes the five benchmark-size synthetic models (random weights, real geometry) into
# bench-models/ (ignored by git): 254 MiB to 1.33 GiB each, 10–30 s each.
# Then: tessera bench -t 2 -m bench-models/bench-qwen3-dense-q4_0.gguf -m ...
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import gguf, numpy" 2>/dev/null || python3 -m pip install --quiet gguf numpy
mkdir -p bench-models
for spec in "qwen3-dense q4_0" "qwen3-dense q8_0" "qwen3moe q4_0" "qwen3moe q8_0" "gpt-oss mxfp4"; do
  set -- $spec
  out="bench-models/bench-$1-$2.gguf"
  [ -f "$out" ] || python3 tools/synth_gguf.py --preset "$1" --outtype "$2" \
      --tokenizer models/stories260K.gguf --out "$out"
done
ls -l bench-models

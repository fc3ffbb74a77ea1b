#!/usr/bin/env bash
# Writes the benchmark-size synthetic models (random weights, real geometry) into
# bench-models/ (ignored by git): six by synth_gguf.py (254 MiB to 1.33 GiB each, 10–30 s
# each), then a deepseek2 (DeepSeek-V3's geometry scaled down, F16, 1.34 GiB) that llama.cpp's
# llama-quantize turns into Q4_K_M (420 MiB) and IQ2_XXS (with an importance matrix from
# llama-imatrix on this repository's READMEs), a few minutes each on 2 cores; and
# bench-qwen3-dense-q4_k_m: the dense bench weights written as F16 and quantized to Q4_K_M (Q4_K
# with Q6_K for attn_v and half of ffn_down, as for a real checkpoint; ~2 min).
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
# The bigger-than-any lab scenario's model: bench-qwen3moe-q4_0's weights but an output head
# whose greedy text walks the vocabulary, so a greedy decode's routing changes with every token
# (the random model's greedy text loops on a few tokens and its routing repeats with it).
[ -f bench-models/bench-qwen3moe-walk-q4_0.gguf ] || python3 tools/synth_gguf.py --preset qwen3moe \
    --outtype q4_0 --walk --tokenizer models/stories260K.gguf --out bench-models/bench-qwen3moe-walk-q4_0.gguf
# IQ2_XXS rather than IQ4_XS: the 2-bit IQ files are what people download for the largest
# MoE models (DeepSeek-V3/R1, Kimi K2), and llama-quantize's IQ2_XXS mix also brings in the
# other types those files hold (Q2_K / Q4_K for some matrices, IQ4_NL where rows are 128 wide).
LLAMA_BIN=${LLAMA_BIN:-/tmp/llama.cpp-build/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin}
ds=bench-models/bench-deepseek2
if [ ! -f "$ds-q4_k_m.gguf" ] || [ ! -f "$ds-iq2_xxs.gguf" ]; then
  [ -x "$LLAMA_BIN/llama-quantize" ] || { echo "build llama.cpp first: tools/llama-cpp.sh build" >&2; exit 1; }
  [ -f "$ds-f16.gguf" ] || python3 tools/synth_gguf.py --preset deepseek2 --outtype f16 \
      --tokenizer models/stories260K.gguf --out "$ds-f16.gguf"
  [ -f "$ds-q4_k_m.gguf" ] || "$LLAMA_BIN/llama-quantize" "$ds-f16.gguf" "$ds-q4_k_m.gguf" Q4_K_M
  if [ ! -f "$ds-iq2_xxs.gguf" ]; then
    cat README.md models/README.md crates/*/README.md | head -c 200000 > "$ds.txt"
    "$LLAMA_BIN/llama-imatrix" -m "$ds-f16.gguf" -f "$ds.txt" -c 256 --chunks 8 -o "$ds.imatrix"
    "$LLAMA_BIN/llama-quantize" --imatrix "$ds.imatrix" "$ds-f16.gguf" "$ds-iq2_xxs.gguf" IQ2_XXS
  fi
fi
qd=bench-models/bench-qwen3-dense
if [ ! -f "$qd-q4_k_m.gguf" ]; then
  [ -x "$LLAMA_BIN/llama-quantize" ] || { echo "build llama.cpp first: tools/llama-cpp.sh build" >&2; exit 1; }
  [ -f "$qd-f16.gguf" ] || python3 tools/synth_gguf.py --preset qwen3-dense --outtype f16 \
      --tokenizer models/stories260K.gguf --out "$qd-f16.gguf"
  "$LLAMA_BIN/llama-quantize" "$qd-f16.gguf" "$qd-q4_k_m.gguf" Q4_K_M
fi
ls -l bench-models

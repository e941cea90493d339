#!/usr/bin/env bash
# Issue 16's GPU measurements in one go, on a machine with a CUDA GPU (its pieces took about 5 minutes on an H200):
#   bash benchmarks/gpu_check.sh [OUT_DIR]
# 1. the CUDA tests (tests/engine/test_gpu.py: graphs = eager, fp32 = HF greedy, bf16, startup capture);
# 2. verify-forward time, ours eager / ours graph / HF eager / a static CUDA-graph step / roofline,
#    for the SmolLM2-135M, Llama-3.2-1B and Llama-3.1-8B shapes (random weights, bf16);
# 3. the embedded model end to end, fp32 and bf16, one request and 8 at once, against HF greedy
#    (the JSON's results[].runner_steps.captures says whether a graph was captured while measuring);
#    then c=8 over 16 conversations with fixed γ and the drain price off beside full CoSine, each
#    priced run printing how the price cut its trees (results[].price);
# 4. bf16 speculative output against our own bf16 decode, every divergence with its logit gap;
# 5. torch.profiler over full CoSine's measured window at c=8 in bf16 (device and host time).
# Each step has its own time limit and the next one runs whatever happened; outputs go to OUT_DIR.
set -u
out=${1:-gpu-check}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
step() { echo "== $1 ($(date +%T))"; }

step "CUDA tests"
timeout 300 python3 -m pytest -q -m gpu tests/engine/test_gpu.py -p no:cacheprovider 2>&1 | tail -25 | tee "$out/gpu_tests.log"

step "verify forward, bf16"
timeout 300 python3 benchmarks/verify_forward.py --shapes smollm2-135m,llama-3.2-1b,llama-3.1-8b --batches 1,8,32 \
  --tokens 1,8 --device cuda --dtype bfloat16 --context 512 --reps 10 2>&1 | tee "$out/verify_forward.log"

for dtype in float32 bfloat16; do
  step "end to end, $dtype"
  timeout 400 python3 -m cosine_ray.cli bench --device cuda --dtype "$dtype" --prompts-per-domain 2 \
    --warmup-per-domain 2 --max-tokens 128 --systems "hf-greedy;none;default;ngram" --concurrency 1,8 \
    --out "$out/bench_$dtype.json" 2>&1 | grep -v "^routing" | tee "$out/bench_$dtype.log"
done

step "c=8, what cuts full CoSine's trees: 16 conversations, fixed γ and the drain price off beside it"
timeout 300 python3 -m cosine_ray.cli bench --device cuda --prompts-per-domain 4 --warmup-per-domain 1 \
  --max-tokens 96 --concurrency 8 --systems "none;default;default@adaptive=false;default@drain_pricing=false" \
  --out "$out/bench_c8_price.json" 2>&1 | grep -v "^routing" | tee "$out/bench_c8_price.log"

step "bf16 against our own bf16 decode"
timeout 300 python3 benchmarks/bf16_divergence.py --device cuda --prompts-per-domain 3 --max-tokens 128 \
  --drafters "default;ngram" 2>&1 | tee "$out/bf16_divergence.log"
step "profile, bf16, default drafters, c=8"
timeout 200 python3 benchmarks/step_profile.py --device cuda --dtype bfloat16 --drafters default --concurrency 8 \
  2>&1 | grep -v "^routing" | tee "$out/step_profile_bf16.log"
step "done"

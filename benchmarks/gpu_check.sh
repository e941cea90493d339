#!/usr/bin/env bash
# The GPU measurements in one go, on a machine with a CUDA GPU, most important first (about
# 9 minutes on an H200 in all; each step has its own time limit and the next one runs whatever happened):
#   bash benchmarks/gpu_check.sh [OUT_DIR]
# 1. the CUDA tests (tests/engine/test_gpu.py: graphs = eager, prompts in prefill buckets, fp32 =
#    HF greedy, bf16, startup capture);
# 2. the bar at c = 8: 16 conversations, no drafters / full CoSine / fixed γ, 3 rounds each in a
#    shuffled order (a GPU host's plain decoding speed drifts between runs, so one pair of runs
#    says little), fp32 then bf16; each priced run prints how the
#    price cut its trees (results[].price), the JSON's summary holds the medians and min-max;
# 3. one request end to end, fp32 and bf16, against HF greedy (the 5× bar);
# 4. verify-forward time, ours eager / ours graph / HF eager / a static CUDA-graph step / roofline,
#    for the SmolLM2-135M, Llama-3.2-1B and Llama-3.1-8B shapes (random weights, bf16);
# 5. bf16 speculative output against our own bf16 decode, every divergence with its logit gap;
# 6. torch.profiler over full CoSine's measured window at c=8 in bf16 (device and host time).
set -u
out=${1:-gpu-check}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
step() { echo "== $1 ($(date +%T))"; }

step "CUDA tests"
timeout 300 python3 -m pytest -q -m gpu tests/engine/test_gpu.py -p no:cacheprovider 2>&1 | tail -25 | tee "$out/gpu_tests.log"

for dtype in float32 bfloat16; do
  step "c=8, 16 conversations, 3 interleaved rounds, $dtype"
  timeout 330 python3 -m cosine_ray.cli bench --device cuda --dtype "$dtype" --prompts-per-domain 4 \
    --warmup-per-domain 1 --max-tokens 96 --concurrency 8 --rounds 3 --systems "none;default;default@adaptive=false" \
    --out "$out/bench_c8_$dtype.json" 2>&1 | grep -v "^routing" | tee "$out/bench_c8_$dtype.log"
done

for dtype in float32 bfloat16; do
  step "one request end to end, $dtype"
  timeout 200 python3 -m cosine_ray.cli bench --device cuda --dtype "$dtype" --prompts-per-domain 2 \
    --warmup-per-domain 1 --max-tokens 128 --systems "hf-greedy;none;default" --concurrency 1 \
    --out "$out/bench_c1_$dtype.json" 2>&1 | grep -v "^routing" | tee "$out/bench_c1_$dtype.log"
done

step "verify forward, bf16"
timeout 300 python3 benchmarks/kernels/verify_forward.py --shapes smollm2-135m,llama-3.2-1b,llama-3.1-8b --batches 1,8,32 \
  --tokens 1,8 --device cuda --dtype bfloat16 --context 512 --reps 10 2>&1 | tee "$out/verify_forward.log"

step "bf16 against our own bf16 decode"
timeout 300 python3 benchmarks/engine/bf16_divergence.py --device cuda --prompts-per-domain 3 --max-tokens 128 \
  --drafters "default;ngram" 2>&1 | tee "$out/bf16_divergence.log"
step "profile, bf16, default drafters, c=8"
timeout 200 python3 benchmarks/engine/step_profile.py --device cuda --dtype bfloat16 --drafters default --concurrency 8 \
  2>&1 | grep -v "^routing" | tee "$out/step_profile_bf16.log"
step "done"

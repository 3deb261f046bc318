#!/usr/bin/env bash
# Reproduce every figure in the README's "Measured" section (SmolLM2-135M-Instruct, float32, this CPU).
# Each bench command compares its methods in one process, warm, interleaved, medians.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p results
python -m infer.bench --methods ar,ngram:3,ngram:5,eagle3:5,eagle3:4,2,8,eagle3:5,4,16 --batch-sizes 1,4 \
    --prompts code --num-prompts 4 --max-new-tokens 96 --repeats 3 \
    --out results/bench_code.json --plots results/code | tee results/bench_code.txt
python -m infer.bench --methods ar,ngram:5,eagle3:5,eagle3:4,2,8,eagle3:5,4,16 --batch-sizes 1,4 \
    --prompts chat --num-prompts 4 --max-new-tokens 96 --repeats 3 \
    --out results/bench_chat.json --plots results/chat | tee results/bench_chat.txt
python scripts/bench_target.py | tee results/bench_target.txt

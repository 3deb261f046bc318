#!/usr/bin/env bash
# Reproduce every figure in the README's "Measured" section (SmolLM2-135M-Instruct, float32, this CPU).
# Each bench command compares its methods in one process, warm, interleaved, medians; speedups are
# relative to the autoregressive run of the same command.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p results
# Plain decoding's step against adaptive engines forced to draft nothing (strictly more work).
python scripts/baseline_step_check.py --prompts chat --batch-size 1 --repeats 9 | tee results/baseline_step_check_chat_b1.txt
# The same at depths 1 and 3 on real chat rows at batch 4, beside the costs the engine measures (adaptive.MARGIN).
python scripts/baseline_step_check.py --prompts chat --batch-size 4 --depths 0,1,3 --repeats 3 | tee results/baseline_step_check_chat_b4.txt
python scripts/baseline_step_check.py --prompts chat --batch-size 4 --repeats 7 | tee results/baseline_step_check_chat_b4_depth0.txt
# A static batch priced by its slowest row vs by the sum of its rows' tokens (counts and modelled time; costs fixed).
{ python scripts/static_batch_steps.py --prompts mt-bench --num-prompts 16 --batch-size 4 --method ngram:auto5 --costs 1,1.24,1.49,1.64,1.81,1.95
  python scripts/static_batch_steps.py --prompts mt-bench --num-prompts 16 --batch-size 4 --method eagle3+ngram:auto3 --costs 1,1.38,1.55,1.79
} | tee results/static_batch_steps_mtbench_b4.txt
# How often the first n-gram guess is right, by match length (why adaptive rows are priced per guess class).
python scripts/ngram_guess_accuracy.py --prompts chat --num-prompts 8 | tee results/ngram_guess_accuracy_chat.txt
python scripts/ngram_guess_accuracy.py --prompts mt-bench --num-prompts 16 | tee results/ngram_guess_accuracy_mtbench.txt
# Adaptive draft length on open chat (built-in set, MT-bench) and beside the fixed chains on code.
AUTO=ar,ngram:auto5,eagle3:auto3,eagle3+ngram:auto3
python -m infer.bench --methods $AUTO --batch-size 1,4 --prompts chat --num-prompts 8 --max-new-tokens 64 --repeats 5 \
    --out results/bench_auto_chat.json | tee results/bench_auto_chat.txt
python -m infer.bench --methods $AUTO --batch-size 1,4 --prompts mt-bench --num-prompts 16 --max-new-tokens 64 --repeats 3 \
    --out results/bench_auto_mtbench.json | tee results/bench_auto_mtbench.txt
python -m infer.bench --methods ar,eagle3+ngram:2,eagle3+ngram:3,eagle3+ngram:4,eagle3+ngram:5,eagle3+ngram:auto3,eagle3+ngram:auto5 \
    --batch-size 1 --prompts code --num-prompts 8 --max-new-tokens 64 --repeats 3 --out results/bench_auto_code.json | tee results/bench_auto_code.txt
# Self-distillation and TTT step throughput against earlier revisions (each on its own specjax for the TTT step).
python scripts/training_throughput.py distill --baseline ffdb866 | tee results/distill_throughput.txt
python scripts/training_throughput.py ttt --baseline ffdb866,7bd893c | tee results/ttt_throughput.txt
python scripts/training_throughput.py distill --methods ngram:auto5 | tee results/distill_methods.txt
# The lesson's table: a vanilla draft model, Medusa, EAGLE-1 (chain, static tree, EAGLE-2 tree),
# EAGLE-3 (chain, EAGLE-2 tree) and Lookahead, on code and MT-bench, batch 1 and 4. The draft model is
# trained here first if missing (it needs the corpus of scripts/build_smollm2_corpus.py).
DRAFT_LM=runs/draft_lm_smollm2/draft
[ -f $DRAFT_LM/config.json ] || python -m train.draft_lm --config configs/draft_lm_smollm2.yaml
LESSON=ar,draft:3,medusa:2,medusa:3,2,5,eagle1:3,eagle1-static:3,2,5,eagle1:3,2,5,eagle3:3,eagle3:3,2,5,lookahead:2,3,2
python -m infer.bench --methods $LESSON --draft draft=$DRAFT_LM --batch-size 1,4 --prompts code \
    --out results/bench_lesson_code.json --plots results/lesson_code | tee results/bench_lesson_code.txt
python -m infer.bench --methods $LESSON --draft draft=$DRAFT_LM --batch-size 1,4 --prompts mt-bench --num-prompts 8 --max-new-tokens 64 \
    --out results/bench_lesson_mtbench.json --plots results/lesson_mtbench | tee results/bench_lesson_mtbench.txt
# The default invocation (ar, ngram:5, eagle3:5 on the code set, batch 1 and 4), timed.
start=$SECONDS
python -m infer.bench --out results/bench_default.json --plots results/default | tee results/bench_default.txt
echo "bench default: $((SECONDS - start)) s wall, model loading and compilation included" | tee -a results/bench_default.txt
python -m infer.bench --methods ar,eagle3:3,eagle3:4,eagle3:4,2,8,eagle3+ngram:3,eagle3+ngram:4 --batch-size 1,4 --prompts code \
    --out results/bench_code_more.json --plots results/code_more | tee results/bench_code_more.txt
python -m infer.bench --methods ar,ngram:5,eagle3:3,eagle3:5,eagle3:4,2,8,eagle3+ngram:3 --batch-size 1,4 --prompts chat \
    --out results/bench_chat.json --plots results/chat | tee results/bench_chat.txt
start=$SECONDS
python -m infer.tune --task code --measure --markdown results/tune_code.md | tee results/tune_code.txt
echo "tune --measure: $((SECONDS - start)) s wall" | tee -a results/tune_code.txt
PYTHONPATH=. python scripts/bench_target.py | tee results/bench_target.txt
# Lookahead: the W,N,G sweep beside prompt lookup, on the code set and 16 MT-bench first turns (batch 1).
L=ar,ngram:5,lookahead:2,3,2,lookahead:4,3,4,lookahead:4,4,2,lookahead:8,3,2
python -m infer.bench --methods $L --batch-size 1 --prompts code --max-new-tokens 128 --repeats 2 \
    --out results/bench_lookahead_code.json | tee results/bench_lookahead_code.txt
python -m infer.bench --methods $L --batch-size 1 --prompts mt-bench --num-prompts 16 --max-new-tokens 128 --repeats 1 \
    --out results/bench_lookahead_mtbench.json | tee results/bench_lookahead_mtbench.txt

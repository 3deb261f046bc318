"""Target-model speed on SmolLM2-135M: specjax vs transformers+torch, and verify-block cost.

    python scripts/bench_target.py [--tokens 32] [--repeats 5]

Same process, same prompt (64 tokens), float32, batch 1, compile and warm-up excluded, medians
over repeats. Reports ms per greedy decoded token for both stacks, the cost of one forward over
T new tokens (a verification block) relative to a single-token forward, and a decode step with
a 4096-slot cache buffer relative to the 512-slot one (it should stay close to 1: attention
cost follows the live length, not the buffer).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import torch

from specjax import kv_cache
from specjax.checkpoints import default_model_path, gguf, load_model
from specjax.kv_cache import KVCache
from specjax.models import llama
from specjax.tokenizer import Tokenizer
from specjax.tree import causal_mask

PROMPT_LEN = 64
TEXT = (
    "Speculative decoding lets a small draft model propose several tokens that the large target "
    "model verifies in a single forward pass. Because verification is exact, the output follows "
    "the target distribution token for token, while the wall-clock time per token drops when the "
    "draft is cheap and often right. This benchmark measures the two costs that matter here."
)


@partial(jax.jit, static_argnames="config")
def prefill(params, config, tokens, cache):
    num_tokens = tokens.shape[1]
    mask = causal_mask(num_tokens)
    out = llama.forward(params, config, tokens, jnp.arange(num_tokens)[None], cache, mask)
    cache = kv_cache.append(cache, out.k, out.v, jnp.array([num_tokens]))
    return jnp.argmax(out.logits[:, -1], -1).astype(jnp.int32), cache


@partial(jax.jit, static_argnames="config", donate_argnames="cache")
def decode_step(params, config, token, cache):
    """token [1] -> (next greedy token [1], cache with the token committed)."""
    out = llama.forward(params, config, token[:, None], cache.lengths[:, None], cache, jnp.ones((1, 1), bool))
    cache = kv_cache.append(cache, out.k, out.v, jnp.ones_like(cache.lengths))
    return jnp.argmax(out.logits[:, -1], -1).astype(jnp.int32), cache


@partial(jax.jit, static_argnames="config")
def verify_block(params, config, tokens, cache):
    """One forward over a chain of T new tokens (no commit): the verifier's cost."""
    num_new = tokens.shape[1]
    positions = cache.lengths[:, None] + jnp.arange(num_new)
    return llama.forward(params, config, tokens, positions, cache, causal_mask(num_new)).logits


def interleaved_medians(runs: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """Median of each run's result (ms). Runs take turns, one untimed round first, so a change
    in machine load during the benchmark hits every configuration alike."""
    for run in runs.values():
        run()
    results = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            results[name].append(run())
    return {name: statistics.median(values) for name, values in results.items()}


def specjax_greedy(params, config, prompt, num_tokens: int, max_len: int) -> list[int]:
    cache = KVCache.init(config.num_layers, 1, max_len, config.num_kv_heads, config.head_dim)
    token, cache = prefill(params, config, jnp.asarray([prompt], jnp.int32), cache)
    generated = [token]
    for _ in range(num_tokens - 1):
        token, cache = decode_step(params, config, token, cache)
        generated.append(token)
    return [int(t[0]) for t in jax.block_until_ready(generated)]


def specjax_decode(params, config, prompt, num_tokens: int, max_len: int) -> Callable[[], float]:
    """A run: ms per decoded token over a num_tokens greedy loop after the prompt (prefill excluded)."""
    fresh = KVCache.init(config.num_layers, 1, max_len, config.num_kv_heads, config.head_dim)
    first, prefilled = prefill(params, config, jnp.asarray([prompt], jnp.int32), fresh)

    def run() -> float:
        token, cache = first, jax.tree.map(jnp.copy, prefilled)  # decode_step donates its cache
        jax.block_until_ready(cache)
        start = time.perf_counter()
        for _ in range(num_tokens):
            token, cache = decode_step(params, config, token, cache)
        jax.block_until_ready(token)
        return (time.perf_counter() - start) * 1e3 / num_tokens

    return run


def specjax_verify(params, config, cache, tokens, calls: int = 3) -> Callable[[], float]:
    """A run: ms per verify_block call (mean of `calls` back-to-back calls)."""

    def run() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            verify_block(params, config, tokens, cache).block_until_ready()
        return (time.perf_counter() - start) * 1e3 / calls

    return run


@torch.no_grad()
def torch_greedy(model, prompt, num_tokens: int) -> tuple[list[int], float]:
    """Greedy tokens and ms per decoded token (prefill excluded), with the model's KV cache."""
    out = model(torch.tensor([prompt]), use_cache=True)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    generated = [int(token)]
    start = time.perf_counter()
    for _ in range(num_tokens - 1):
        out = model(token, cache=out.cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        generated.append(int(token))
    return generated, (time.perf_counter() - start) * 1e3 / (num_tokens - 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32, help="decoded tokens per timed run")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per measurement (median)")
    args = parser.parse_args()
    torch.set_num_threads(2)

    path = default_model_path()
    tokenizer = Tokenizer.from_gguf(path)
    prompt = tokenizer.encode(tokenizer.chat_prompt(TEXT))[:PROMPT_LEN]
    config, params = load_model(path, jnp.float32)

    model = gguf.transformers_model(path)
    decode_ms = interleaved_medians(
        {
            "specjax": specjax_decode(params, config, prompt, args.tokens, 512),
            "specjax_4096": specjax_decode(params, config, prompt, args.tokens, 4096),
            "torch": lambda: torch_greedy(model, prompt, args.tokens)[1],
        },
        args.repeats,
    )
    same = torch_greedy(model, prompt, args.tokens)[0] == specjax_greedy(params, config, prompt, args.tokens, 512)

    cache = KVCache.init(config.num_layers, 1, 512, config.num_kv_heads, config.head_dim)
    _, cache = prefill(params, config, jnp.asarray([prompt], jnp.int32), cache)
    block_sizes = (1, 4, 8, 16, 32)
    block_ms = interleaved_medians(
        {size: specjax_verify(params, config, cache, jnp.asarray([prompt[:size]], jnp.int32)) for size in block_sizes},
        args.repeats,
    )

    print(f"SmolLM2-135M-Instruct (Q4_1 GGUF -> float32), batch 1, prompt {len(prompt)} tokens, "
          f"{args.tokens} greedy tokens, median of {args.repeats}; jax {jax.__version__}, torch {torch.__version__}")
    print(f"{'decode':<44}{'ms/token':>10}{'ratio':>8}")
    rows = {
        "specjax (jit forward+write+commit, 512 slots)": decode_ms["specjax"],
        "specjax, 4096-slot cache (64 live)": decode_ms["specjax_4096"],
        "transformers+torch (2 threads, KV cache)": decode_ms["torch"],
    }
    for name, ms in rows.items():
        print(f"{name:<44}{ms:>10.1f}{ms / decode_ms['specjax']:>8.2f}")
    print(f"greedy tokens identical: {same}")
    print(f"{'verify block (specjax forward, 64 cached)':<44}{'ms':>10}{'x T=1':>8}")
    for num_new, ms in block_ms.items():
        print(f"{f'T = {num_new}':<44}{ms:>10.1f}{ms / block_ms[1]:>8.2f}")


if __name__ == "__main__":
    main()

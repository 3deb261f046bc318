"""The two XLA:CPU pitfalls of docs/architecture.md, measured side by side in one process.

1. The layer loop: specjax's unrolled forward over per-layer weights against a `lax.scan` over
   weights stacked on an L axis (what specjax ran before), for plain decoding and `eagle3:3`.
2. The step's cache reads under a conditional: plain decoding as specjax runs it against the
   same step with the draft-and-verify called directly (no conditional).

Milliseconds per generated token per row, medians of interleaved repeats, greedy chat prompts:

    python scripts/xla_cpu_pitfalls.py --batch-size 1 --max-len 2048
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from infer import bench, common
from infer import prompts as prompt_sets
from specjax.drafters.registry import MethodSpec
from specjax.engine import Engine
from specjax.models import llama
from specjax.sampling import SamplingParams


def scan_forward(params, config, tokens, positions, cache, block_mask, *, taps, chunk_size):
    """llama.forward as a `lax.scan` over params whose layers are stacked on a leading L axis."""
    if cache is not None:
        chunk_size = min(chunk_size, cache.max_len)
    inv_freq = llama.rope_frequencies(config)

    def layer_step(x, inputs):
        w, layer = inputs
        attn_out, k, v = llama._attention_block(config, w, x, layer, positions, inv_freq, cache, block_mask, chunk_size, "xla")
        y = x + attn_out
        return y + llama._mlp_block(config, w, y, "xla"), (k, v, x)

    layers = (params["layers"], jnp.arange(config.num_layers))
    hidden, (k, v, layer_inputs) = lax.scan(layer_step, llama.embed(params, tokens), layers)
    normed = llama.rms_norm(hidden, params["norm"], config.rms_norm_eps)
    features = [layer_inputs[layer] for layer in taps.layer_inputs] + ([normed] if taps.final_hidden else [])
    return llama.ForwardOutput(
        logits=llama.project_logits(params, config, normed), k=k, v=v, features=jnp.concatenate(features, -1) if features else None
    )


class ScanEngine(Engine):
    """The engine with the scanned forward (its params' layers stacked)."""

    def _target(self, params, tokens, positions, cache, block_mask):
        return scan_forward(params, self.config, tokens, positions, cache, block_mask, taps=self.drafter.taps, chunk_size=self.attention_chunk)


class UnconditionalEngine(Engine):
    """The engine with a fixed drafter's draft-and-verify called directly, not under a conditional."""

    def _fixed_draft_and_verify(self, params, drafter_params, state, keys, ctx, sampling):
        return self._draft_and_verify(self.drafter, params, drafter_params, state, keys, ctx, sampling)


parser = common.parser("xla_cpu_pitfalls.py", __doc__)
common.add_model_args(parser)
parser.set_defaults(max_len=2048)
parser.add_argument("--prompts", default="chat")
parser.add_argument("--batch-size", type=int, default=1)
parser.add_argument("--num-prompts", type=int, default=4)
parser.add_argument("--max-new-tokens", type=int, default=48)
parser.add_argument("--repeats", type=int, default=5)
args = parser.parse_args()

config, params, tok = common.load_target(args)
stacked = dict(params, layers=jax.tree.map(lambda *layers: jnp.stack(layers), *params["layers"]))
ids = prompt_sets.token_ids(tok, args.prompts, args.num_prompts)
drafter = lambda spec: common.build_drafter(MethodSpec.parse(spec), args, config, params)
engines = {
    "ar": Engine(config, params, drafter("ar"), max_len=args.max_len, eos_ids=()),
    "ar, scanned layers": ScanEngine(config, stacked, drafter("ar"), max_len=args.max_len, eos_ids=()),
    "ar, no conditional": UnconditionalEngine(config, params, drafter("ar"), max_len=args.max_len, eos_ids=()),
    "eagle3:3": Engine(config, params, drafter("eagle3:3"), max_len=args.max_len, eos_ids=()),
    "eagle3:3, scanned layers": ScanEngine(config, stacked, drafter("eagle3:3"), max_len=args.max_len, eos_ids=()),
}
batches = [ids[i : i + args.batch_size] for i in range(0, len(ids) - args.batch_size + 1, args.batch_size)]
passes = bench.interleaved_passes(engines, batches, SamplingParams.make(args.batch_size), args.max_new_tokens, args.repeats)
per_token = {name: np.median([p[0] / sum(s.num_generated for s in p[2]) * args.batch_size * 1000 for p in runs]) for name, runs in passes.items()}
print(f"batch {args.batch_size}, {args.max_len}-slot cache, {args.prompts} prompts; ms per token per row (median of {args.repeats})")
for name, ms in per_token.items():
    base = name.split(",")[0]
    note = f"  {ms / per_token[base]:.2f}x the time of {base}" if name != base else ""
    print(f"{name:<26} {ms:7.2f}{note}")

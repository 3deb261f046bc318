"""How often the first n-gram guess is right, by the length of the matched suffix.

Greedy continuations of a prompt set (plain decoding), then at every generated position the
lookup `ngram.lookup` would make before that step (suffixes of 1 .. --max-ngram tokens): how many
steps had a match of each length and how often its first token was the one decoded. This is the
evidence behind pricing adaptive rows per guess class (docs/architecture.md, "Adaptive draft length"):

    python scripts/ngram_guess_accuracy.py --prompts chat --num-prompts 8
"""

import jax
import jax.numpy as jnp
import numpy as np

from infer import common
from infer import prompts as prompt_sets
from specjax.drafters.ngram import lookup
from specjax.drafters.registry import MethodSpec
from specjax.engine import Engine

parser = common.parser("ngram_guess_accuracy.py", __doc__)
common.add_model_args(parser)
parser.add_argument("--prompts", default="chat")
parser.add_argument("--num-prompts", type=int, default=8)
parser.add_argument("--max-new-tokens", type=int, default=64)
parser.add_argument("--max-ngram", type=int, default=3)
args = parser.parse_args()

config, params, tok = common.load_target(args)
ids = prompt_sets.token_ids(tok, args.prompts, args.num_prompts)
engine = Engine(config, params, common.build_drafter(MethodSpec.parse("ar"), args, config, params),
                max_len=args.max_len, eos_ids=tok.eos_token_ids)
outputs = engine.generate(ids, max_new_tokens=args.max_new_tokens).tokens
guess = jax.jit(jax.vmap(lambda h, n: lookup(h, n, 1, args.max_ngram, 1), in_axes=(None, 0)))
tried, right = np.zeros(args.max_ngram + 1, int), np.zeros(args.max_ngram + 1, int)
for prompt, out in zip(ids, outputs):
    sequence = np.asarray(list(prompt) + list(out), np.int32)
    ends = np.arange(len(prompt) - 1, len(sequence) - 1)  # the pending token's index before each step
    drafts, sizes = guess(jnp.asarray(sequence), jnp.asarray(ends, jnp.int32))
    sizes, hits = np.asarray(sizes), np.asarray(drafts)[:, 0] == sequence[ends + 1]
    np.add.at(tried, sizes, 1)
    np.add.at(right, sizes, hits & (sizes > 0))
print(f"# python scripts/ngram_guess_accuracy.py --prompts {args.prompts} --num-prompts {args.num_prompts} "
      f"--max-new-tokens {args.max_new_tokens}  ({sum(tried)} steps)")
for size in range(args.max_ngram + 1):
    share = right[size] / max(tried[size], 1)
    label = "no match" if size == 0 else f"{size}-token match"
    print(f"{label:<16} steps {tried[size]:5d} ({tried[size] / sum(tried):4.0%})  first guess right {right[size]:5d} ({share:4.0%})")

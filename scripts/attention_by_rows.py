"""A decode step with an earlier revision's attention against the current one, side by side (warm).

    python scripts/attention_by_rows.py --baseline 60927e7 --batch-size 16

SmolLM2 in float32, plain decoding, a batch whose rows hold prompts of equal or of random lengths
(64 .. 600 tokens): the current attention reads a prefix chunk only for the rows that reach it
(`specjax.models.attention`), the baseline's for the whole batch. Both engines are traced in this
process, the baseline's with its `attention` patched into `llama`; checks that both emit the same tokens.
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import jax  # noqa: E402

from revision import baseline_module  # noqa: E402
from specjax import checkpoints  # noqa: E402
from specjax.engine import Engine  # noqa: E402
from specjax.models import llama  # noqa: E402
from specjax.sampling import SamplingParams  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="the revision whose attention to compare with")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=9, help="timed calls of 8 steps per case and engine")
    args = parser.parse_args()
    batch = args.batch_size
    config, params = checkpoints.load_model(checkpoints.default_model_path())
    old_attention = baseline_module(args.baseline, "specjax/models/attention.py").attention
    engines = {name: Engine(config, params, max_len=768, attention_chunk=64, eos_ids=()) for name in ("before", "now")}
    greedy = SamplingParams.make(batch)
    cases = {
        "equal 300": [300] * batch,
        "equal 560": [560] * batch,
        "random 64..600": list(np.random.default_rng(1).integers(64, 600, batch)),
    }
    states = {}
    for case, lengths in cases.items():
        rng = np.random.default_rng(0)
        prompts = [list(rng.integers(100, 20000, length)) for length in lengths]
        for name, engine in engines.items():
            current, llama.attention = llama.attention, old_attention if name == "before" else llama.attention
            try:  # the first decode traces this engine's step
                states[case, name] = engine.decode(engine.admit(engine.init_state(batch), range(batch), prompts, 150), greedy, 2)
            finally:
                llama.attention = current
    seconds = {key: [] for key in states}
    for _ in range(args.repeats):
        for (case, name), state in states.items():
            start = time.perf_counter()
            states[case, name] = engines[name].decode(state, greedy, 8)
            jax.block_until_ready(states[case, name].pending)
            seconds[case, name].append((time.perf_counter() - start) / 8)
    print(f"SmolLM2 float32, plain decoding, batch {batch}, median ms per step over {args.repeats} x 8 steps")
    for case in cases:
        before, now = (np.median(seconds[case, name]) for name in ("before", "now"))
        print(f"{case:16s} {args.baseline} {1e3 * before:6.1f}  now {1e3 * now:6.1f}  ratio {before / now:.2f}x")
    same = all(engines["before"].outputs(states[c, "before"]) == engines["now"].outputs(states[c, "now"]) for c in cases)
    print("same tokens:", same)


if __name__ == "__main__":
    main()

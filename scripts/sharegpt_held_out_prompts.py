"""The first user turns of a ShareGPT config's held-out split, as a prompt file for `infer.bench`.

    python scripts/sharegpt_held_out_prompts.py --config configs/eagle3_sharegpt_smollm2.yaml \
        --out data/eagle3_sharegpt_smollm2/held_out_prompts.jsonl
    python -m infer.bench --prompts data/eagle3_sharegpt_smollm2/held_out_prompts.jsonl ...

The split is the one training cleans the data with (`train.core.load_sharegpt`: the fixed sha1 split,
`held_out_permille` of the conversations, never trained on), so a draft trained by that config is
measured on chat it has not seen. Writes one {"prompt": ...} line per held-out conversation.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specjax.checkpoints import default_model_path  # noqa: E402
from train import core, data  # noqa: E402
from train.config import load_config  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a training config with data: sharegpt (or a ShareGPT file)")
    parser.add_argument("--out", required=True, help="the jsonl prompt file to write")
    args = parser.parse_args()
    config = load_config(args.config)
    if not config.data:
        raise SystemExit(f"{args.config} trains on data_files, not ShareGPT: it has no held-out split")
    tokenizer = data.load_tokenizer(config.tokenizer or config.target or str(default_model_path()))
    held_out = core.load_sharegpt(config, tokenizer).held_out
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as out:
        for messages in held_out:
            out.write(json.dumps({"prompt": messages[0]["content"]}) + "\n")
    print(f"wrote {len(held_out)} held-out prompts of {config.data} to {args.out}")


if __name__ == "__main__":
    main()

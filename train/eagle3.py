"""Train an EAGLE-3 draft head for a frozen target, with training-time test.

    python -m train.eagle3 --config configs/eagle3_smollm2.yaml [--key value ...]

Any config field can be overridden (`--learning_rate 3e-4`, `--data_files '[a.jsonl, b.jsonl]'`).
Rerunning the same command resumes from the latest checkpoint in output_dir. At the end the
draft is evaluated on the held-out rows (TTT statistics, and tau from the engine when
tau_eval_every is set) and exported in the EAGLE-3 Hugging Face layout.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from train import trainer
from train.config import load_config, parse_overrides


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, type=Path, help="YAML file of TrainConfig fields")
    args, rest = parser.parse_known_args(argv)
    config = load_config(args.config, parse_overrides(rest))
    setup = trainer.prepare(config)
    print(
        f"{len(setup.train_rows)} training rows, {len(setup.eval_rows)} held out, "
        f"{int(setup.train_rows.loss_mask.sum())} response tokens; {setup.mesh.size} device(s)",
        file=sys.stderr,
    )
    evaluate_tau = trainer.tau_evaluator(setup) if config.tau_eval_every else None
    state, records = trainer.train(setup, evaluate_tau=evaluate_tau)
    result = trainer.evaluate(setup, state.params)
    if evaluate_tau is not None:
        result["engine"] = records[-1]["engine"] if records else evaluate_tau(state.params)
    path = trainer.export(setup, state.params)
    (Path(config.output_dir) / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"eval": result, "exported": str(path)}), file=sys.stderr)


if __name__ == "__main__":
    main()

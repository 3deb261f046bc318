"""Train an EAGLE-3 draft head for a frozen target, with training-time test.

    python -m train.eagle3 --config configs/eagle3_smollm2.yaml [--key value ...] [--overwrite]

Any config field can be overridden (`--learning_rate 3e-4`, `--data_files '[a.jsonl, b.jsonl]'`;
a bare `--flag` sets a boolean). Rerunning the same command resumes from the latest intact
checkpoint in output_dir. At the end the draft is evaluated on the held-out rows (TTT statistics,
and tau from the engine when tau_eval_every is set) and exported in the EAGLE-3 Hugging Face
layout; `--overwrite` allows exporting into a directory that holds something else.
"""

from __future__ import annotations

from train import core, eagle3_method


def main(argv: list[str] | None = None) -> None:
    core.main(argv, eagle3_method.prepare, __doc__)


if __name__ == "__main__":
    main()

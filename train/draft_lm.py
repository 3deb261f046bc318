"""Train a vanilla draft model for a frozen target: its first layers, fine-tuned on the target's outputs.

    python -m train.draft_lm --config configs/draft_lm_smollm2.yaml [--key value ...] [--overwrite]

Same core as train.eagle3 (data, self-distillation, optimizer, verified checkpoints with exact
resume, engine tau, metrics): rerunning the command resumes. At the end the draft is evaluated on
the held-out rows (loss, top-1 accuracy) and exported as a Hugging Face checkpoint, which
`python -m infer.generate --method draft --draft PATH` loads.
"""

from __future__ import annotations

from train import core, draft_lm_method


def main(argv: list[str] | None = None) -> None:
    core.main(argv, draft_lm_method.prepare, __doc__)


if __name__ == "__main__":
    main()

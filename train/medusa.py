"""Train Medusa-1 heads for a frozen target: each head predicts one more token ahead from the
target's last hidden state.

    python -m train.medusa --config configs/medusa_smollm2.yaml [--key value ...] [--overwrite]

Same core as train.eagle3 (data, self-distillation, offline target outputs, optimizer, verified
checkpoints with exact resume, engine tau, metrics): rerunning the command resumes. At the end
the heads are evaluated on the held-out rows (per-head loss, accuracy and rank hit rates) and
exported in vLLM's Medusa layout.
"""

from __future__ import annotations

from train import core, medusa_method


def main(argv: list[str] | None = None) -> None:
    core.main(argv, medusa_method.prepare, __doc__)


if __name__ == "__main__":
    main()

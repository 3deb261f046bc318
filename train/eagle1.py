"""Train an EAGLE-1 draft for a frozen target: one layer regressing the target's next top-layer feature.

    python -m train.eagle1 --config configs/eagle1_smollm2.yaml [--key value ...] [--overwrite]

Same core as train.eagle3 (data, self-distillation, offline target features, optimizer, verified
checkpoints with exact resume, engine tau, metrics): rerunning the command resumes. The loss is
smooth-L1 on the features plus eagle1_cls_weight times the cross-entropy through the frozen LM
head (train/eagle1_method.py). At the end the draft is evaluated on the held-out rows and
exported in vLLM's EagleLlamaForCausalLM layout.
"""

from __future__ import annotations

from train import core, eagle1_method


def main(argv: list[str] | None = None) -> None:
    core.main(argv, eagle1_method.prepare, __doc__)


if __name__ == "__main__":
    main()

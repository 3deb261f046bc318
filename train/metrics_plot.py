"""metrics.png of a training run: loss, held-out acc_k and engine tau against updates (from metrics.jsonl)."""

from __future__ import annotations

import json
from pathlib import Path


def metric_series(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Records of metrics.jsonl -> {"loss": [(update, training loss)], "acc_k": [(update, held-out
    top-1 accuracy at draft step k)] for each k, "tau": [(update, engine tau)]}."""
    series: dict[str, list[tuple[int, float]]] = {"loss": []}
    for record in records:
        update = record["update"]
        series["loss"].append((update, record["total"]))
        for k, acc in enumerate(record.get("eval", {}).get("acc", [])):
            series.setdefault(f"acc_{k}", []).append((update, acc))
        if "engine" in record:
            series.setdefault("tau", []).append((update, record["engine"]["tau"]))
    return series


def plot_metrics(output_dir: str | Path) -> Path:
    """Write output_dir/metrics.png from output_dir/metrics.jsonl; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    output_dir = Path(output_dir)
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    series = metric_series([json.loads(line) for line in lines if line.strip()])
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot(*zip(*series["loss"]), lw=0.8)
    axes[0].set(xlabel="update", ylabel="training loss", title="Loss")
    for name in sorted(n for n in series if n.startswith("acc_")):
        axes[1].plot(*zip(*series[name]), marker="o", label=name)
    axes[1].set(xlabel="update", ylabel="held-out top-1 accuracy", title="acc_k (draft step k)", ylim=(0, 1))
    if any(n.startswith("acc_") for n in series):
        axes[1].legend()
    if "tau" in series:
        axes[2].plot(*zip(*series["tau"]), marker="o")
    axes[2].set(xlabel="update", ylabel="tokens per verifier call", title="Engine tau (held-out prompts)")
    fig.tight_layout()
    path = output_dir / "metrics.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

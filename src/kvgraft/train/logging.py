"""A run's log: one JSON object per line in ``log.jsonl`` plus a PNG of the loss curves."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvgraft.atomic import atomic_write_text


class RunLog:
    def __init__(self, out_dir: str | Path, enabled: bool = True) -> None:
        self.path = Path(out_dir) / "log.jsonl"
        self.png = Path(out_dir) / "loss.png"
        self.enabled = enabled

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        rows = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a kill: drop it
                continue
        return rows

    def truncate_after(self, step: int) -> None:
        """On resume, drop records past the checkpoint's step (they will be produced again)."""
        if not self.enabled or not self.path.exists():
            return
        kept = [r for r in self.read() if r.get("step", 0) <= step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def plot(self) -> None:
        if self.enabled:
            plot_losses(self.read(), self.png)


def plot_losses(rows: list[dict[str, Any]], png: str | Path, title: str = "loss") -> None:
    """Train and validation loss against tokens seen."""
    import matplotlib  # lazy: matplotlib is heavy and only plotting needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib is heavy and only plotting needs it

    train = [(r["tokens"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["tokens"], r["val_loss"]) for r in rows if "val_loss" in r]
    if not train and not val:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train", lw=1, alpha=0.8)
    if val:
        ax.plot(*zip(*val), "o-", label="validation", ms=3)
    ax.set_xlabel("tokens")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = Path(png).with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, png)

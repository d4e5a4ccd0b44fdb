"""A side-by-side report of several evaluated models: markdown, JSON and PNG plots.

Used by ``kvgraft eval --compare ORIGINAL CONVERTED HEALED ... --out DIR``: one column per model,
ratios to the first (the original), and plots of perplexity, KV bytes per token, and decode
tokens/s and latency by context length.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvgraft.atomic import atomic_write_text
from kvgraft.eval.report import _label, compare_table


def write_compare_report(results: list[dict[str, Any]], out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "compare.json", json.dumps(results, indent=2) + "\n")
    md = [
        "# kvgraft comparison",
        "",
        "Ratios are to the first model, measured in the same run.",
        "",
        "```",
        compare_table(results),
        "```",
        "",
        "![perplexity and KV](compare.png)",
        "",
        "![decode speed](decode.png)",
        "",
    ]
    atomic_write_text(out / "compare.md", "\n".join(md))
    _plots(results, out)
    return out


def _plots(results: list[dict[str, Any]], out: Path) -> None:
    import matplotlib  # lazy: matplotlib is heavy and only plotting needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib is heavy and only plotting needs it

    labels = [r.get("name") or _label(r) for r in results]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(12, 3.8))
    a.bar(labels, [r["perplexity"]["ppl"] for r in results], color="tab:blue")
    a.set_title("held-out perplexity")
    b.bar(labels, [r["kv_memory"]["bytes_per_token_measured"] for r in results], color="tab:green")
    b.set_title(f"KV bytes / token ({results[0]['kv_memory']['dtype']})")
    c.bar(labels, [r["params"] / 1e6 for r in results], color="tab:gray")
    c.set_title("parameters (M)")
    for ax in (a, b, c):
        ax.tick_params(axis="x", rotation=20, labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "compare.png", dpi=110)
    plt.close(fig)

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for r, label in zip(results, labels):
        for batch in sorted({p["batch_size"] for p in r["speed"]["points"]}):
            pts = sorted(
                (p["context"], p["tokens_per_s"], p["ms_per_token_median"])
                for p in r["speed"]["points"]
                if p["batch_size"] == batch
            )
            ctx = [p[0] for p in pts]
            a.plot(ctx, [p[1] for p in pts], "o-", label=f"{label} b{batch}")
            b.plot(ctx, [p[2] for p in pts], "o-", label=f"{label} b{batch}")
    a.set_title("decode tokens/s")
    b.set_title("decode latency (ms / step)")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "decode.png", dpi=110)
    plt.close(fig)

"""The seed's placement study on the healed real causal encoder-decoder (issue 35 part 2).

Two studies, each one ``kvgraft experiment placement`` command over the healed pivot-18 CED
(``bench/real_heal.py build --student ced`` -> ``runs/real-ced/healed``), in the chat format SmolLM2 knows:

- ``recall``: a ledger of codes, the queried line ending 160+ tokens before the answer (beyond every 128-token
  window, so only the shared stream carries it), 256-token examples;
- ``ui-reply``: a described form -> a reply with its JSON, 384-token examples.

Five configurations (the pivot's KV writers frozen first: the cheapest, and the one the product serves),
3 seeds, 100 steps of 4 examples, LR by plateau from a sweep of 30-step all-linear-r16 runs, validation
the mean of the evaluations at steps 50, 70 and 100. Every run is resumable: rerunning ``run`` continues
the study where it stopped (finished runs are read back)::

    .venv/bin/python bench/real_placement.py run --task recall        # runs/real-placement/recall
    .venv/bin/python bench/real_placement.py collect --task recall    # raw runs -> bench/real_ced/placement-recall

``collect`` copies what a reader needs of every finished run (``result.json``, ``log.jsonl``; not the
adapters) and the study's summary, when it is complete, into ``bench/real_ced/placement-<task>/``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE = "runs/real-ced/healed"
CONFIGS = [
    "decoder-half-r16+frozen-kv-writers",
    "decoder-half-r16",
    "encoder-half-r16",
    "all-linear-r16",
    "all-linear-r8",
]
COMMON = ["--prompt-format", "chat", "--seeds", "3", "--steps", "100", "--micro-batch-size", "4", "--configs", *CONFIGS]
STUDIES = {
    "recall": [
        "--window", "128", "--max-tokens", "256", "--sweep-lrs", "1e-3", "3e-3", "1e-2",
        "--val-examples", "32", "--test-examples", "128", "--accuracy-examples", "64",
    ],
    "ui-reply": [
        "--max-tokens", "384", "--sweep-lrs", "3e-4", "1e-3", "3e-3",
        "--val-examples", "32", "--test-examples", "64", "--accuracy-examples", "16",
    ],
}  # fmt: skip
KEEP = ("result.json", "log.jsonl", "study.json", "study.md", "study_config.json", "curves.png")


def command(task: str) -> list[str]:
    out = f"runs/real-placement/{task}"
    return [sys.executable, "-m", "kvgraft", "experiment", "placement", "--base", BASE, "--task", task, "--out", out]


def run(task: str) -> int:
    if not (ROOT / BASE / "config.json").is_file():
        raise SystemExit(f"{BASE} is missing: build it first with `.venv/bin/python bench/real_heal.py build --student ced`")
    cmd = command(task) + COMMON + STUDIES[task]
    print("running:", " ".join(cmd[1:]), flush=True)
    return subprocess.call(cmd, cwd=ROOT)


def collect(task: str) -> None:
    src, dst = ROOT / "runs/real-placement" / task, ROOT / "bench/real_ced" / f"placement-{task}"
    if not src.is_dir():
        raise SystemExit(f"{src.relative_to(ROOT)} does not exist: run the study first")
    copied = 0
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if path.name not in KEEP or "checkpoints" in rel.parts or "adapter" in rel.parts:
            continue
        if path.name == "log.jsonl" and not (path.parent / "result.json").is_file():
            continue  # a run still going: its log is not final
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, dst / rel)
        copied += 1
    print(f"{copied} files -> {dst.relative_to(ROOT)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["run", "collect"])
    p.add_argument("--task", required=True, choices=sorted(STUDIES))
    args = p.parse_args()
    if args.action == "run":
        raise SystemExit(run(args.task))
    collect(args.task)


if __name__ == "__main__":
    main()

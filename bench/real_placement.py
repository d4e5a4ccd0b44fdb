"""The seed's placement study on the healed real causal encoder-decoder (issue 35 part 2).

Two studies, each one ``kvgraft experiment placement`` command over the healed pivot-18 CED
(``bench/real_heal.py build --student ced`` -> ``runs/real-ced/healed``), in the chat format SmolLM2 knows:

- ``recall``: a ledger of codes, the queried line ending 160+ tokens before the answer (beyond every 128-token
  window, so only the shared stream carries it), 256-token examples;
- ``ui-reply``: a described form -> a reply with its JSON, 384-token examples.

Five configurations (the pivot's KV writers frozen first: the cheapest, and the one the product serves),
3 seeds, 100 steps of 4 examples, LR by plateau from a sweep of 30-step all-linear-r16 runs, validation
the mean of the evaluations at steps 50, 70 and 100. Every run is resumable: rerunning ``run`` continues
the study where it stopped (finished runs are read back; on a fresh machine, from the committed raw runs)::

    .venv/bin/python bench/real_placement.py run --task recall        # runs/real-placement/recall
    .venv/bin/python bench/real_placement.py collect --task recall    # raw runs -> bench/real_ced/placement-recall
    .venv/bin/python bench/real_placement.py report --task recall     # per-seed gaps from the committed raw runs
    .venv/bin/python bench/real_placement.py curve --task recall      # the placement curve at the study's LR (3 seeds)
    .venv/bin/python bench/real_placement.py collect --task recall --curve

``collect`` copies what a reader needs of every finished run (``result.json``, ``log.jsonl``; not the
adapters) and the study's summary, when it is complete, into ``bench/real_ced/placement-<task>/``. ``report``
reads those committed runs and prints, per seed, every configuration's validation loss (the protocol's mean),
test loss and accuracy, and the three differences the issue asks for: decoder half minus encoder half, decoder
half minus all-linear r16, and the cost of freezing the pivot's KV writers (decoder half frozen minus decoder
half); negative loss differences favour the first named. Writes ``gaps.json`` beside the runs.

``curve``: adapters on layers k..29 at rank 16 with the pivot's KV writers frozen (every one shares the cache),
for k = 20, 24 and 28 (k = 18 is the study's frozen decoder half), ``--seeds`` seeds (3; 1 for a first look),
at the LR the study's sweep picked -> ``runs/real-placement/<task>-curve``; validation and test loss against k
(no accuracy: the curve's runs answer no problems). Finished seeds are read back, so more seeds extend it.
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
COMMON = ["--prompt-format", "chat", "--steps", "100", "--micro-batch-size", "4"]
SIZING = {"recall": ["--window", "128", "--max-tokens", "256"], "ui-reply": ["--max-tokens", "384"]}
SWEEP_LRS = {"recall": ["1e-3", "3e-3", "1e-2"], "ui-reply": ["3e-4", "1e-3", "3e-3"]}
SCORED = {  # validation, test and greedy-answered problems per run
    "recall": ["--val-examples", "32", "--test-examples", "128", "--accuracy-examples", "64"],
    "ui-reply": ["--val-examples", "32", "--test-examples", "64", "--accuracy-examples", "16"],
}
KEEP = ("result.json", "log.jsonl", "study.json", "study.md", "study_config.json", "curves.png")
KEEP_CURVE = ("curve.json", "curve.md", "curve.png")
CURVE_LAYERS = ["20", "24", "28"]


def command(task: str, out: str) -> list[str]:
    return [sys.executable, "-m", "kvgraft", "experiment", "placement", "--base", BASE, "--task", task, "--out", out]


def restore(name: str) -> None:
    """Copy the committed raw runs (``bench/real_ced/placement-<name>``) into ``runs/real-placement/<name>``
    where that has no such file: a finished run is read back from its ``result.json`` alone, so a study
    continued on a fresh machine skips what was committed."""
    src, dst = ROOT / "bench/real_ced" / f"placement-{name}", ROOT / "runs/real-placement" / name
    restored = 0
    for path in sorted(src.glob("**/result.json")) if src.is_dir() else []:
        for f in (path, path.parent / "log.jsonl"):
            target = dst / f.relative_to(src)
            if f.is_file() and not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(f, target)
                restored += f.name == "result.json"
    if restored:
        print(f"{restored} finished runs restored from {src.relative_to(ROOT)}", flush=True)


def run(task: str) -> int:
    if not (ROOT / BASE / "config.json").is_file():
        raise SystemExit(f"{BASE} is missing: build it first with `make real-ced`")
    restore(task)
    cmd = command(task, f"runs/real-placement/{task}") + COMMON + ["--seeds", "3", "--configs", *CONFIGS]
    cmd += SIZING[task] + ["--sweep-lrs", *SWEEP_LRS[task]] + SCORED[task]
    print("running:", " ".join(cmd[1:]), flush=True)
    return subprocess.call(cmd, cwd=ROOT)


def curve(task: str, seeds: int) -> int:
    import json

    study = ROOT / "runs/real-placement" / task / "study.json"
    if not study.is_file():
        raise SystemExit(f"{study.relative_to(ROOT)} is missing: the curve runs at the study's LR; finish the study first")
    lr = json.loads(study.read_text())["lr"]
    restore(f"{task}-curve")
    cmd = command(task, f"runs/real-placement/{task}-curve") + COMMON + ["--seeds", str(seeds), "--sweep-first-layer"]
    cmd += ["--lr", str(lr), "--first-layers", *CURVE_LAYERS] + SIZING[task] + SCORED[task][:4]
    print("running:", " ".join(cmd[1:]), flush=True)
    return subprocess.call(cmd, cwd=ROOT)


def collect(task: str, is_curve: bool = False) -> None:
    name = f"{task}-curve" if is_curve else task
    src, dst = ROOT / "runs/real-placement" / name, ROOT / "bench/real_ced" / f"placement-{name}"
    if not src.is_dir():
        raise SystemExit(f"{src.relative_to(ROOT)} does not exist: run the study first")
    copied = 0
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if path.name not in KEEP + KEEP_CURVE or "checkpoints" in rel.parts or "adapter" in rel.parts:
            continue
        if path.name == "log.jsonl" and not (path.parent / "result.json").is_file():
            continue  # a run still going: its log is not final
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, dst / rel)
        copied += 1
    print(f"{copied} files -> {dst.relative_to(ROOT)}")


GAPS = {
    "decoder - encoder": ("decoder-half-r16", "encoder-half-r16"),
    "decoder - all-linear": ("decoder-half-r16", "all-linear-r16"),
    "frozen writers - trained": ("decoder-half-r16+frozen-kv-writers", "decoder-half-r16"),
}
METRICS = (("val", "val_loss_protocol"), ("test", "test_loss"), ("accuracy", "test_accuracy"))


def report(task: str) -> None:
    import json
    import statistics

    from kvgraft.atomic import atomic_write_json

    src = ROOT / "bench/real_ced" / f"placement-{task}"
    runs: dict[str, dict[int, dict]] = {}
    for f in sorted(src.glob("runs/*/seed*/result.json")):
        runs.setdefault(f.parent.parent.name, {})[int(f.parent.name.removeprefix("seed"))] = json.loads(f.read_text())
    if not runs:
        raise SystemExit(f"no finished runs in {src.relative_to(ROOT)}: `collect --task {task}` after the study ran")
    print(
        f"| {task}: configuration | seed | validation (mean of 50/70/100) | test loss | accuracy | trainable | s a step | run |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in CONFIGS:
        for seed, r in sorted(runs.get(name, {}).items()):
            acc = r["test_accuracy"]
            print(
                f"| {name} | {seed} | {r['val_loss_protocol']:.3f} | {r['test_loss']:.3f} | "
                f"{'-' if acc is None else f'{acc:.3f}'} | {r['trainable_parameters']:,} | {r['step_time_s']:.2f} | "
                f"{r['wall_s'] / 60:.1f} min |"
            )
    print(f"\n| {task}: configuration | validation, mean (min-max) over seeds | test loss | accuracy |")
    print("|---|---:|---:|---:|")
    for name in CONFIGS:
        rs = list(runs.get(name, {}).values())
        if rs:
            cells = []
            for _, field in METRICS:
                v = [r[field] for r in rs if r[field] is not None]
                cells.append(f"{statistics.fmean(v):.3f} ({min(v):.3f}-{max(v):.3f})" if v else "-")
            print(f"| {name} ({len(rs)} seeds) | " + " | ".join(cells) + " |")
    out: dict[str, list[dict]] = {}
    print(f"\n| {task}: per-seed difference | seed | validation | test loss | accuracy |")
    print("|---|---:|---:|---:|---:|")
    for label, (a, b) in GAPS.items():
        rows = out.setdefault(label, [])
        for seed in sorted(set(runs.get(a, {})) & set(runs.get(b, {}))):
            ra, rb = runs[a][seed], runs[b][seed]
            row = {"seed": seed}
            for key, field in METRICS:
                row[key] = None if ra[field] is None or rb[field] is None else ra[field] - rb[field]
            rows.append(row)
            cells = " | ".join("-" if row[k] is None else f"{row[k]:+.3f}" for k, _ in METRICS)
            print(f"| {label} | {seed} | {cells} |")
        if len(rows) > 1:
            means = [statistics.fmean(r[k] for r in rows) if all(r[k] is not None for r in rows) else None for k, _ in METRICS]
            print(f"| {label} | mean | " + " | ".join("-" if m is None else f"{m:+.3f}" for m in means) + " |")
    atomic_write_json(src / "gaps.json", {"task": task, "differences": out, "pairs": GAPS})
    print(f"\n-> {(src / 'gaps.json').relative_to(ROOT)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["run", "collect", "report", "curve"])
    p.add_argument("--task", required=True, choices=sorted(SIZING))
    p.add_argument("--curve", action="store_true", help="collect: the placement curve's runs")
    p.add_argument("--seeds", type=int, default=3, choices=[1, 2, 3], help="curve: seeds per layer k (3)")
    args = p.parse_args()
    if args.action == "run":
        raise SystemExit(run(args.task))
    if args.action == "curve":
        raise SystemExit(curve(args.task, args.seeds))
    if args.action == "collect":
        collect(args.task, args.curve)
    else:
        report(args.task)


if __name__ == "__main__":
    main()

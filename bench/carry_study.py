"""Carry an unfinished ``kvgraft experiment placement`` study into the repository, so a later machine continues it
where it stopped (issue 25's studies take longer than one machine lives).

    python bench/carry_study.py runs/placement-recall-deep training/placement-recall-deep \\
        --command "kvgraft experiment placement --base kvgraft-ced-8m-deep --task recall ... --out runs/placement-recall-deep"

Copies each finished run's ``result.json`` and ``log.jsonl`` (the LR sweep's ``sweep/lr_*`` and the runs'
``runs/<configuration or from<k>>/seed<k>``; a run is finished when its ``result.json`` exists, which the study
writes last and atomically), never adapters or checkpoints, into DEST (replacing what DEST held), writes DEST's
README with the number of finished runs and the command that continues the study, and fails if git would
ignore any copied file (a carried run that is not committed is lost with the machine).

With ``--finished`` the study is complete (its ``study.json`` exists, written by the full command after every run
finished): the same files, plus ``study.json`` and ``study.md`` (a curve's ``curve.json``, ``curve.md``), are
kept as the study's raw data (for example ``bench/placement/recall-deep-runs``), so the per-seed figures behind its table stay in the repository and
``bench/placement_gaps.py`` can be rerun on them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

CARRIED = ("result.json", "log.jsonl")

README = """# Study in progress (issue 25): `{name}`

{n_runs} finished runs of the study below{sweep}, carried across machines: each run's `result.json` (what the
study reads back for a finished run: rerunning the command skips it) and `log.jsonl`. Adapters and checkpoints
are not carried (an interrupted run restarts from its first step). Written by `bench/carry_study.py`; removed
when the study is complete and its table, curves and JSON are in `bench/placement/`.

Finished runs per configuration: {per_config}

## Continue (same command, same data)
```
make install
mkdir -p runs && cp -r {dest} runs/{name} && rm runs/{name}/README.md
OMP_NUM_THREADS=1 .venv/bin/python -m {command}
```
On two cores, run it twice at once with disjoint `--configs` subsets (a curve: `--first-layers` subsets), each at
`nice -n 19` with one thread: every run has its own directory, finished runs are read back, and the full command
run last writes the whole table. The task is regenerated deterministically from its name and seed. What is finished so far is in
bench/RESULTS.md, "Placement study with the shared cache in use".
"""

FINISHED_README = """# Finished study (issue 25): `{name}`

The raw data of a complete study: each of its {n_runs} runs' `result.json` and `log.jsonl`{sweep}, and the table
the full command wrote from them (`study.*` or `curve.*`). Per configuration: {per_config}. Written by
`bench/carry_study.py --finished`; the write-up is in bench/RESULTS.md, "Placement study with the shared cache in
use".

## Reproduce
```
make install
OMP_NUM_THREADS=1 .venv/bin/python -m {command}
```
({wall} per run, from the runs' own `wall_s`, each on one core of a 2-core machine beside a second study; to read
these results back instead, `cp -r {dest} runs/{name}` first: finished runs are skipped.) Per-seed gaps: `python bench/placement_gaps.py {dest}`.
"""


def finished_runs(study: Path) -> list[Path]:
    """The directories (relative to ``study``) of the runs whose ``result.json`` exists."""
    return sorted(f.parent.relative_to(study) for f in study.glob("**/result.json"))


def wall_range(study: Path, runs: list[Path]) -> str:
    """The finished runs' wall time as ``a-b min`` (from each ``result.json``'s ``wall_s``), or ``time not recorded``."""
    walls = [json.loads((study / r / "result.json").read_text()).get("wall_s") for r in runs]
    minutes = [w / 60 for w in walls if isinstance(w, (int, float))]
    if not minutes:
        return "time not recorded"
    return f"{min(minutes):.1f}-{max(minutes):.1f} min"


def carry(src: Path, dest: Path, command: str, finished: bool = False) -> list[Path]:
    if not src.is_dir():
        raise SystemExit(f"{src} is not a study directory")
    tables = [n for n in ("study.json", "study.md", "curve.json", "curve.md") if (src / n).is_file()]
    if finished and not any(n.endswith(".json") for n in tables):
        raise SystemExit(
            f"--finished: {src}/study.json (or curve.json) does not exist (run the full command once every run is done)"
        )
    if not command.startswith("kvgraft experiment placement") or f"--out {src.as_posix()}" not in command:
        raise SystemExit(f"--command must be the `kvgraft experiment placement ... --out {src}` that continues it")
    runs = finished_runs(src)
    if not runs:
        raise SystemExit(f"{src} holds no finished run (no result.json)")
    staging = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    copied = []
    for run in runs:
        (staging / run).mkdir(parents=True)
        for name in CARRIED:
            if (src / run / name).is_file():
                shutil.copy2(src / run / name, staging / run / name)
                copied.append(run / name)
    if finished:
        for name in tables:
            shutil.copy2(src / name, staging / name)
            copied.append(Path(name))
    sweeps = [r for r in runs if r.parts[0] == "sweep"]
    trained = [r for r in runs if r.parts[0] == "runs"]
    per_config: dict[str, int] = {}
    for r in trained:
        per_config[r.parts[1]] = per_config.get(r.parts[1], 0) + 1
    (staging / "README.md").write_text(
        (FINISHED_README if finished else README).format(
            name=src.name,
            dest=dest.as_posix(),
            n_runs=len(trained),
            sweep=f" and its LR sweep ({len(sweeps)} runs)" if sweeps else "",
            per_config=", ".join(f"{k} {v}" for k, v in sorted(per_config.items())) or "none",
            command=command,
            wall=wall_range(src, trained),
        )
    )
    shutil.rmtree(dest, ignore_errors=True)
    staging.rename(dest)
    check = subprocess.run(["git", "check-ignore", "--no-index", *map(str, copied)], cwd=dest, capture_output=True, text=True)
    if check.returncode not in (0, 1):  # 0: some are ignored, 1: none is; anything else: git could not tell
        raise SystemExit(f"git check-ignore failed in {dest}: {check.stderr.strip()}")
    ignored = check.stdout.split()
    if ignored:
        raise SystemExit(f"git ignores {len(ignored)} carried files (first: {ignored[0]}): fix .gitignore")
    return trained


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="the study's directory (the command's --out)")
    ap.add_argument("dest", type=Path, help="where it is carried in the repository (training/<name>)")
    ap.add_argument("--command", required=True, help="the `kvgraft experiment placement ...` that continues it")
    ap.add_argument("--finished", action="store_true", help="the study is complete: keep its runs and study.json as its raw data")
    args = ap.parse_args(argv)
    trained = carry(args.src, args.dest, args.command, finished=args.finished)
    print(f"{args.dest}: {len(trained)} finished runs carried", file=sys.stderr)


if __name__ == "__main__":
    main()

"""Peak memory of ``kvgraft convert`` (``--to mla`` or ``--to ced``, kvgraft format): the whole-model executor
against the layer-by-layer one (issue 26, "Conversion at the scale users have").

Each conversion runs as its own process (``kvgraft.cli.main(["convert", ...])``; the whole-model run with
``execute(..., executor="whole")`` forced), and its peak resident set size is read from ``os.wait4``'s
``ru_maxrss`` (what ``/usr/bin/time -v`` prints as "Maximum resident set size"). A process that only imports
kvgraft and torch gives the baseline. The two outputs are then compared tensor by tensor (bit for bit), in a
child process too: Linux records the parent's peak RSS in a child's ``ru_maxrss`` when the child execs (the
spawning process's high-water mark is the floor of every child's), so the parent must never grow (it imports
torch: its ~0.35 GiB is that floor).

    python bench/random_checkpoint.py --shape llama-mid-4l --out runs/ckpt/mid4
    python bench/random_checkpoint.py --shape llama-mid-16l --out runs/ckpt/mid16
    python bench/convert_memory.py runs/ckpt/mid4 runs/ckpt/mid16 --calibration-tokens 2048
    python bench/convert_memory.py runs/ckpt/mid4 runs/ckpt/mid16 --calibration-tokens 2048 --to ced

Without ``--calibration`` a .npy of ``--calibration-tokens`` random ids below the vocabulary is written under
``--work`` (seed 0). Prints a table and writes it as JSON (``--json``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

EXECUTORS = ("whole", "layerwise")


def _child(executor: str, argv: list[str]) -> int:
    """In the measured process: ``kvgraft convert`` with ``executor`` ("none": import only)."""
    import functools

    import kvgraft.graft.convert as conv
    from kvgraft.cli import main

    if executor == "none":
        return 0
    conv.execute = functools.partial(conv.execute, executor=executor)  # type: ignore[assignment]
    return main(["convert", *argv])


def peak_rss(executor: str, argv: list[str]) -> tuple[int, float]:
    """(peak RSS bytes, seconds) of one child process running ``_child(executor, argv)``."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--child", executor, "--", *argv], env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{executor} conversion failed (exit {proc.returncode}): {argv}")
    return usage.ru_maxrss * 1024, time.perf_counter() - t0  # ru_maxrss is in KiB on Linux


def _same_tensors(a: Path, b: Path) -> bool:
    import torch

    from kvgraft.hf.load import read_state

    sa, sb = read_state(a), read_state(b)
    return sorted(sa) == sorted(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return _child(argv[1], argv[3:])
    if argv[:1] == ["--compare"]:
        return 0 if _same_tensors(Path(argv[1]), Path(argv[2])) else 1
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoints", nargs="+", type=Path)
    p.add_argument("--calibration", type=Path, default=None)
    p.add_argument("--calibration-tokens", type=int, default=2048)
    p.add_argument("--to", choices=("mla", "ced"), default="mla", help="the conversion's target (kvgraft convert --to)")
    p.add_argument("--work", type=Path, default=Path("runs/convert-memory"))
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    import numpy as np

    from kvgraft.atomic import atomic_write_json
    from kvgraft.hf.load import load_config
    from kvgraft.model.shapes import num_parameters

    args.work.mkdir(parents=True, exist_ok=True)
    base, _ = peak_rss("none", [])
    rows = []
    for ckpt in args.checkpoints:
        config = load_config(ckpt)
        calibration = args.calibration
        if calibration is None:
            calibration = args.work / f"calibration-{config.vocab_size}-{args.calibration_tokens}.npy"
            rng = np.random.default_rng(0)
            np.save(calibration, rng.integers(0, config.vocab_size, args.calibration_tokens).astype(np.int64))
        row: dict[str, object] = {
            "checkpoint": ckpt.name,
            "to": args.to,
            "layers": config.num_layers,
            "parameters": num_parameters(config),
        }
        for executor in EXECUTORS:
            out = args.work / f"{ckpt.name}-{args.to}-{executor}"
            rss, seconds = peak_rss(
                executor,
                [
                    str(ckpt),
                    "--to",
                    args.to,
                    "--out",
                    str(out),
                    "--calibration",
                    str(calibration),
                    "--calibration-tokens",
                    str(args.calibration_tokens),
                    "--overwrite",
                ],
            )
            row[executor] = {"peak_rss_bytes": rss, "seconds": seconds}
        row["ratio"] = row["whole"]["peak_rss_bytes"] / row["layerwise"]["peak_rss_bytes"]  # type: ignore[index]
        outs = [str(args.work / f"{ckpt.name}-{args.to}-{e}") for e in EXECUTORS]
        row["identical_tensors"] = subprocess.run([sys.executable, __file__, "--compare", *outs]).returncode == 0
        rows.append(row)
    gib = 2**30
    print(f"--to {args.to}; baseline (python + torch + kvgraft imported): {base / gib:.2f} GiB")
    print(
        f"{'checkpoint':<12} {'layers':>6} {'params':>12} {'whole GiB':>10} {'layerwise GiB':>14} {'ratio':>6} {'identical':>9}"
    )
    for r in rows:
        w, lw = r["whole"], r["layerwise"]  # type: ignore[index]
        print(
            f"{r['checkpoint']:<12} {r['layers']:>6} {r['parameters']:>12,} {w['peak_rss_bytes'] / gib:>10.2f} "
            f"{lw['peak_rss_bytes'] / gib:>14.2f} {r['ratio']:>6.2f} {str(r['identical_tensors']):>9}"
        )
    if args.json:
        atomic_write_json(args.json, {"baseline_rss_bytes": base, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())

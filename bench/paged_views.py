"""Decode over views of the paged pools vs gathering the batch's blocks (``BatchContext.views``), side by side.

A decode row whose blocks are consecutive (the allocator grows each sequence in a claimed run of ids) is
read as a view of the pools, per row, instead of a gathered copy of every row's blocks per layer; a lone
row (any step) likewise. ``kvgraft.eval.decode_speed`` on each reference model, 1 thread, fp32, with views
on and off alternated ``--rounds`` times in the same process (which goes first alternates too); medians of the per-round medians, in ms per
decode step (all rows), and the ratio gather / views (above 1: views faster).

    .venv/bin/python bench/paged_views.py
    .venv/bin/python bench/paged_views.py --contexts 256 1024 4096 --batch-sizes 1 8 16
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["kvgraft-llama-8m", "kvgraft-ced-8m"])
    ap.add_argument("--contexts", nargs="+", type=int, default=[256, 1024])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    for name, values in (("contexts", args.contexts), ("batch sizes", args.batch_sizes)):
        if not values or min(values) < 1:
            ap.error(f"{name} must be positive integers, got {values}")
    if args.rounds < 1 or args.threads < 1:
        ap.error(f"--rounds ({args.rounds}) and --threads ({args.threads}) must be >= 1")

    from kvgraft.eval.speed import decode_speed
    from kvgraft.hf import load_pretrained
    from kvgraft.model.batch import BatchContext
    from kvgraft.reference import resolve_model

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*max_position_embeddings.*")
    print("| model | context x batch | views ms/step | gather ms/step | gather / views |")
    print("|---|---|---|---|---|")
    for name in args.models:
        model = load_pretrained(resolve_model(name)).eval()
        times: dict[bool, dict[tuple[int, int], list[float]]] = {True: {}, False: {}}
        for i in range(args.rounds):
            for views in ((True, False) if i % 2 == 0 else (False, True)):  # alternate which goes first
                BatchContext.views = views
                for p in decode_speed(model, contexts=tuple(args.contexts), batch_sizes=tuple(args.batch_sizes),
                                      new_tokens=16, warmup=4, repeats=2):
                    times[views].setdefault((p.context, p.batch_size), []).append(p.ms_per_token_median)
        BatchContext.views = True
        for key in times[True]:
            on, off = statistics.median(times[True][key]), statistics.median(times[False][key])
            print(f"| {name} | {key[0]} x {key[1]} | {on:.2f} | {off:.2f} | {off / on:.2f}x |", flush=True)


if __name__ == "__main__":
    main()

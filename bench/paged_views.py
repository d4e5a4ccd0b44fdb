"""Decode over views of the paged pools vs gathering the batch's blocks (``BatchContext.views``), side by side.

A decode row whose blocks are consecutive (the allocator grows each sequence in a claimed run of ids) is
read as a view of the pools, per row, instead of a gathered copy of every row's blocks per layer; a lone
row (any step) likewise. ``kvgraft.eval.decode_speed`` on each reference model, 1 thread, fp32, with views
on and off alternated ``--rounds`` times in the same process (which goes first alternates too); medians of the per-round medians, in ms per
decode step (all rows), and the ratio gather / views (above 1: views faster). Then ``--prefix-rows`` rows
restored from the prefix cache (the kept prompt's shared blocks, then their own: several pieces per row).

    .venv/bin/python bench/paged_views.py
    .venv/bin/python bench/paged_views.py --contexts 256 1024 4096 --batch-sizes 1 8 16
    .venv/bin/python bench/paged_views.py --models --prefix-rows 8     # only the prefix-cache rows
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--models",
        nargs="*",
        default=["kvgraft-llama-8m", "kvgraft-ced-8m"],
        help="reference models for the context x batch table (none: skip it)",
    )
    ap.add_argument("--contexts", nargs="+", type=int, default=[256, 1024])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--prefix-rows", type=int, default=8, help="also time this many rows restored from the prefix cache (0: skip)"
    )
    args = ap.parse_args()
    for name, values in (("contexts", args.contexts), ("batch sizes", args.batch_sizes)):
        if not values or min(values) < 1:
            ap.error(f"{name} must be positive integers, got {values}")
    if args.prefix_rows < 0:
        ap.error(f"--prefix-rows ({args.prefix_rows}) must be >= 0")
    if args.rounds < 1 or args.threads < 1:
        ap.error(f"--rounds ({args.rounds}) and --threads ({args.threads}) must be >= 1")

    from kvgraft.eval.speed import decode_speed
    from kvgraft.hf import load_pretrained
    from kvgraft.model.batch import BatchContext
    from kvgraft.reference import resolve_model

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*max_position_embeddings.*")
    if args.models:
        print("| model | context x batch | views ms/step | gather ms/step | gather / views |")
        print("|---|---|---|---|---|")
    for name in args.models:
        model = load_pretrained(resolve_model(name)).eval()
        times: dict[bool, dict[tuple[int, int], list[float]]] = {True: {}, False: {}}
        for i in range(args.rounds):
            for views in (True, False) if i % 2 == 0 else (False, True):  # alternate which goes first
                BatchContext.views = views
                for p in decode_speed(
                    model, contexts=tuple(args.contexts), batch_sizes=tuple(args.batch_sizes), new_tokens=16, warmup=4, repeats=2
                ):
                    times[views].setdefault((p.context, p.batch_size), []).append(p.ms_per_token_median)
        BatchContext.views = True
        for key in times[True]:
            on, off = statistics.median(times[True][key]), statistics.median(times[False][key])
            print(f"| {name} | {key[0]} x {key[1]} | {on:.2f} | {off:.2f} | {off / on:.2f}x |", flush=True)

    if args.prefix_rows:
        prefix_rows(args.prefix_rows, args.rounds)


def prefix_rows(n_rows: int, rounds: int) -> None:
    """Rows restored from the prefix cache: ``n_rows`` requests over one kept 1,000-token prompt on the Llama
    reference hold the prompt's shared blocks, then their own, so each row is a few pieces; decode steps with
    views on and off alternate in blocks of 4 in the same engine (medians, ms per step)."""
    from kvgraft.hf import load_pretrained
    from kvgraft.model.batch import BatchContext
    from kvgraft.reference import resolve_model
    from kvgraft.runtime.engine import Engine
    from kvgraft.runtime.options import EngineOptions
    from kvgraft.runtime.sampling import SamplingParams

    model = load_pretrained(resolve_model("kvgraft-llama-8m")).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1000,), generator=torch.Generator().manual_seed(0)).tolist()
    engine = Engine(model, EngineOptions(max_seqs=n_rows, max_batch_tokens=2048, max_seq_len=1200, prefix_cache=True))
    first = engine.add_request(prompt, SamplingParams(max_new_tokens=2))
    while engine.requests[first].status != "finished":
        engine.step()
    rids = [engine.add_request(prompt + [i], SamplingParams(max_new_tokens=8 * 4 * rounds + 8)) for i in range(n_rows)]
    while not all(engine.requests[r].output for r in rids):
        engine.step()
    table = engine.cache.block_table(engine.requests[rids[-1]].seq)
    pieces = 1 + sum(1 for a, b in zip(table, table[1:]) if b != a + 1)
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(2 * rounds):
        views = i % 2 == 0
        BatchContext.views = views
        for _ in range(4):
            t = time.perf_counter()
            engine.step()
            times[views].append(time.perf_counter() - t)
    BatchContext.views = True
    on, off = (statistics.median(times[v]) * 1e3 for v in (True, False))
    print(
        f"\n{n_rows} rows restored from the prefix cache (1,000-token kept prompt, {pieces} pieces per row): "
        f"{on:.2f} ms per decode step over views, {off:.2f} ms gathering ({off / on:.2f}x)",
        flush=True,
    )


if __name__ == "__main__":
    main()

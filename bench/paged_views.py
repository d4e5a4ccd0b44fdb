"""Decode step with and without pool views for a lone request (``BatchContext.views``), side by side.

One request at ~480 tokens on each reference model, 1 thread; steps with and without views alternate in
the same engine (16 each), medians printed in ms per decode step.

    .venv/bin/python bench/paged_views.py
"""

from __future__ import annotations

import statistics
import time

import torch


def main() -> None:
    from kvgraft.hf import load_pretrained
    from kvgraft.model.batch import BatchContext
    from kvgraft.reference import resolve_model
    from kvgraft.serve.engine import Engine
    from kvgraft.serve.sampling import SamplingParams

    torch.set_num_threads(1)
    for name in ("kvgraft-llama-8m", "kvgraft-ced-8m"):
        model = load_pretrained(resolve_model(name)).eval()
        prompt = torch.randint(0, model.config.vocab_size, (460,), generator=torch.Generator().manual_seed(0)).tolist()
        engine = Engine(model, max_seqs=1, max_batch_tokens=512)
        rid = engine.add_request(prompt, SamplingParams(max_new_tokens=39))
        while not engine.requests[rid].output:
            engine.step()
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(8):
            for views in (True, False):
                BatchContext.views = views
                for _ in range(2):
                    t = time.perf_counter()
                    engine.step()
                    times[views].append(time.perf_counter() - t)
        BatchContext.views = True
        on, off = (statistics.median(times[v]) * 1e3 for v in (True, False))
        print(f"{name}: {on:.2f} ms per decode step with views, {off:.2f} ms gathering ({off / on:.2f}x)")


if __name__ == "__main__":
    main()

"""Where a real model's MLA graft loses: quick in-memory grafts (``graft_mla``) of some or all layers, scored on the
first windows of the held-out texts. A proxy for bench/real_oneshot.py, minutes instead of a quarter hour.

    .venv/bin/python bench/real_graft_proxy.py --threads 1 --windows 4 --calibration-sequences 32 \\
        '{"kv_lora_rank":48,"qk_rope_head_dim":48}' '{"kv_lora_rank":384,"qk_rope_head_dim":48}' \\
        '{"kv_lora_rank":48,"qk_rope_head_dim":48,"layers":10,"refine_epochs":4,"refine_lr":1e-3}'

Each argument is a JSON object of ``GraftConfig`` fields on top of convert's defaults for the kvgraft format
(objective "attention", rope selection "norm", complex rotation, layer-wise); ``"layers": K`` grafts layers
0..K-1 only (progressive). Calibration: the first N sequences of 512 tokens of kvgraft's default calibration
text. Held-out: the first ``--windows`` windows of 512 tokens of runs/real-texts/{manual,glossary}.npy
(bench/real_texts.py). Prints each setting's perplexity ratios to the original's and, with refinement, each
layer's held-out calibration error before and after it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from kvgraft.eval.perplexity import perplexity
from kvgraft.graft.calibration import DEFAULT_TEXT
from kvgraft.graft.mla import GraftConfig, graft_mla
from kvgraft.hf.load import load_pretrained, load_tokenizer_dir
from kvgraft.reference import resolve_model

DEFAULTS = {"objective": "attention", "rope_selection": "norm", "rope_rotation": "complex"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("settings", nargs="+", help="JSON objects of GraftConfig fields")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--texts", type=Path, default=Path("runs/real-texts"))
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--calibration-sequences", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    path = resolve_model(a.model)
    model = load_pretrained(path, dtype=torch.float32).eval()
    ids = np.asarray(load_tokenizer_dir(path)(DEFAULT_TEXT.read_text(), add_special_tokens=False)["input_ids"])
    n = a.calibration_sequences
    calib = torch.from_numpy(ids[: n * 512].astype(np.int64)).view(n, 512)
    texts = {name: np.load(a.texts / f"{name}.npy")[: a.windows * 512 + 1] for name in ("manual", "glossary")}

    def score(m: torch.nn.Module) -> dict[str, float]:
        with torch.no_grad():
            return {name: perplexity(m, s, seq_len=512).ppl for name, s in texts.items()}

    base = score(model)
    print("original", {k: round(v, 3) for k, v in base.items()}, flush=True)
    for spec in a.settings:
        kw = DEFAULTS | json.loads(spec)
        if isinstance(kw.get("layers"), int):
            kw["layers"] = tuple(range(kw["layers"]))
        clock: dict[str, float] = {}
        refinement: dict = {}
        t0 = time.perf_counter()
        new = graft_mla(model, GraftConfig(**kw), calib, progress=False, timings=clock, refinement=refinement)
        wall = time.perf_counter() - t0
        r = score(new)
        for layer, e in refinement.get("layers", {}).items():
            print(f"  layer {layer}: held-out error {e['before']:.4g} -> {e['after']:.4g} ({e['steps']} steps)")
        ratios = {k: round(r[k] / base[k], 3) for k in r}
        print(json.dumps(json.loads(spec)), ratios, f"graft {wall:.0f} s", {k: round(v) for k, v in clock.items()}, flush=True)


if __name__ == "__main__":
    main()

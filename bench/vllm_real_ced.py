"""The real causal encoder-decoder on vLLM through kvgraft's plugin: greedy tokens against kvgraft's own engine.

    PYTHONPATH=src .venv-vllm/bin/python bench/vllm_real_ced.py [--model runs/real-ced/healed] [--new-tokens 24]

Prompts are slices of the held-out manual text (``bench/real_texts.py``) of ``--lengths`` tokens (default: inside
the 128-token window, across it and past it, up to 900), run as one batch by vLLM on the CPU in its default
compiled mode (fp32, prefix caching off) and by ``kvgraft.runtime.Engine``; prints and writes (``--out``,
atomically) which prompts' tokens agree. Exit status 1 when any differs.

``--adapters NAME=DIR ...`` (e.g. the placement study's cache-sharing adapters, ``bench/real_placement.py``): vLLM
runs with ``enable_lora`` (the plugin's adapter path) and the prompts go, in turn, to the base and to each
adapter, all in the one batch; kvgraft's engine loads the same adapters by name (as ``kvgraft serve`` does).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process: the plugin below

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check_vllm_ced as vllm_check  # noqa: E402

import kvgraft.vllm  # noqa: E402
from kvgraft.atomic import atomic_write_json  # noqa: E402
from kvgraft.hf import load_pretrained  # noqa: E402
from kvgraft.runtime.engine import Engine  # noqa: E402
from kvgraft.runtime.options import EngineOptions
from kvgraft.runtime.sampling import SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=ROOT / "runs" / "real-ced" / "model")
    p.add_argument("--texts", type=Path, default=ROOT / "runs" / "real-texts")
    p.add_argument("--lengths", type=int, nargs="+", default=[20, 150, 300, 700, 900, 64, 129, 400])
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "vllm_real_ced.json")
    p.add_argument("--adapters", nargs="+", default=[], metavar="NAME=DIR", help="LoRA adapters (PEFT directories)")
    a = p.parse_args()
    adapters = {}
    for spec in a.adapters:
        name, _, path = spec.partition("=")
        if not name or not (Path(path) / "adapter_config.json").is_file() or name in adapters:
            raise SystemExit(f"--adapters {spec!r}: expected a new NAME=DIR, DIR holding adapter_config.json")
        adapters[name] = Path(path)
    if not (a.model / "config.json").is_file():
        raise SystemExit(f"{a.model} is not a model directory: `bench/real_heal.py build --student ced` makes one")
    if any(n < 1 for n in a.lengths) or a.new_tokens < 1:
        raise SystemExit(f"--lengths ({a.lengths}) and --new-tokens ({a.new_tokens}) must be positive")
    ids = np.load(a.texts / "manual.npy").astype(np.int64)
    if max(a.lengths) >= len(ids):
        raise SystemExit(f"--lengths: the held-out text has {len(ids)} tokens, fewer than {max(a.lengths)}")
    rng = np.random.default_rng(0)
    offsets = rng.integers(0, len(ids) - max(a.lengths), size=len(a.lengths)).tolist()
    prompts = [ids[o : o + n].tolist() for o, n in zip(offsets, a.lengths)]
    max_len = max(a.lengths) + a.new_tokens
    names = list(adapters)
    use = [([None] + names)[i % (len(names) + 1)] for i in range(len(prompts))]
    kvgraft.vllm.register()
    lora_kwargs = {}
    lora = None
    if adapters:
        from vllm.lora.request import LoRARequest

        ranks = [json.loads((d / "adapter_config.json").read_text())["r"] for d in adapters.values()]
        lora_kwargs = dict(enable_lora=True, max_lora_rank=max(ranks), max_loras=len(adapters))
        ids = {n: i + 1 for i, n in enumerate(names)}
        lora = [None if u is None else LoRARequest(u, ids[u], str(adapters[u])) for u in use]
    llm = vllm_check._llm(
        a.model,
        "float32",
        "cpu",
        eager=False,
        max_model_len=max_len,
        max_num_batched_tokens=2048,
        max_num_seqs=len(prompts),
        **lora_kwargs,
    )
    theirs, seconds = vllm_check._generate(llm, prompts, a.new_tokens, lora)
    vllm_check._close(llm)
    model = load_pretrained(a.model, dtype=torch.float32)
    with torch.no_grad():
        engine = Engine(model, EngineOptions(max_seqs=len(prompts)))
        for name, path in adapters.items():
            engine.load_adapter(name, path)
        ours = engine.generate(prompts, SamplingParams(max_new_tokens=a.new_tokens), use)
        base = engine.generate(prompts, SamplingParams(max_new_tokens=a.new_tokens)) if adapters else ours
    changed = [u is not None and x != y for u, x, y in zip(use, ours, base)]  # so the check can fail
    same = [x == y for x, y in zip(theirs, ours)]
    result = dict(
        model=str(a.model),
        lengths=a.lengths,
        new_tokens=a.new_tokens,
        adapters={n: str(d) for n, d in adapters.items()},
        adapter_per_prompt=use,
        same_tokens=same,
        first_divergence=vllm_check._divergence(theirs, ours),
        adapter_changed_tokens=changed,
    )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(a.out, result, indent=2)
    print(f"same greedy tokens as kvgraft's engine on {sum(same)}/{len(same)} prompts of {a.lengths} tokens")
    if adapters:
        n = sum(u is not None for u in use)
        print(f"{n} prompts went to adapters; on {sum(changed)} of them the adapter changed the base's tokens")
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main())

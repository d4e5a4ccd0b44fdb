"""8 adapters over one 2K-token prompt on vLLM with the kvgraft plugin: KV-cache blocks in use, with the plugin's
prefix-cache keys against vLLM's default (issue 21 part 4).

    VLLM_TARGET_DEVICE=cpu .venv-vllm/bin/python bench/vllm_ced_adapters.py [--out DIR] [--prompt-tokens 2048]

models/kvgraft-ced-8m (trained on 512 positions; past them it is still one deterministic function, which is all a
memory count needs: ``VLLM_ALLOW_LONG_MAX_MODEL_LEN``), prefix caching on, fp32, engine core in this process.
The base request runs first to completion (its blocks stay cached), then 8 requests for 8 different adapters over
the same prompt run together (4 new tokens each); the figure is the peak number of blocks in use during those 8
(pool size minus free blocks after every step; cached blocks a request hits count once) times the bytes one block
id spans. Two kinds of adapter, 8 of each, made from models/adapters/kvgraft-ced-8m-geometry with its B factors
scaled by 0.6-1.3 (8 different functions on the same modules):

- decoder-side (the adapter's own modules, layers 4-7: certified to leave the encoder windows, the stream and the
  pending rows untouched; its decoder windows change);
- KV-neutral (cut to layer 7's q/o/kv_b/MLP modules: touches no cache group).

Each kind runs twice: with the plugin's keys (``kvgraft.vllm.lora.install_hash_keys``, what ``register()``
installs) and with vLLM's own ``_gen_lora_extra_hash_keys`` put back. Writes ``vllm_ced_adapters.json`` under
--out atomically.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")

import numpy as np  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from kvgraft.adapters.certificate import certify  # noqa: E402
from kvgraft.atomic import atomic_write_json  # noqa: E402
from kvgraft.model.config import ModelConfig  # noqa: E402
from kvgraft.vllm.memory import cache_groups, engine_core  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CED = ROOT / "models" / "kvgraft-ced-8m"
GEO = ROOT / "models" / "adapters" / "kvgraft-ced-8m-geometry"
SCALES = (0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3)


def make_adapter(out: Path, scale: float, last_layer_only: bool) -> Path:
    shutil.copytree(GEO, out)
    meta = json.loads((GEO / "kvgraft_adapter.json").read_text())
    weights = load_file(str(GEO / "adapter_model.safetensors"))
    modules = meta["modules"]
    if last_layer_only:
        modules = [m for m in modules if m.startswith("layers.7.") and not m.endswith(("k_proj", "v_proj"))]
        meta["modules"] = modules
        meta["certificate"] = certify(ModelConfig.from_dict(meta["base_config"]), modules).to_dict()
        (out / "kvgraft_adapter.json").write_text(json.dumps(meta))
        peft = json.loads((GEO / "adapter_config.json").read_text())
        peft["target_modules"] = ["model." + m for m in modules]
        (out / "adapter_config.json").write_text(json.dumps(peft))
        weights = {k: v for k, v in weights.items() if any(f".{m}." in k for m in modules)}
    save_file({k: (v * scale if "lora_B" in k else v) for k, v in weights.items()}, str(out / "adapter_model.safetensors"))
    return out


def peak_blocks(llm, prompt: list[int], adapters: list[Path]) -> tuple[int, list[int]]:
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    engine = llm.llm_engine
    pool = engine_core(llm).scheduler.kv_cache_manager.block_pool
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)
    engine.add_request("base", {"prompt_token_ids": prompt}, sp)
    while engine.has_unfinished_requests():
        engine.step()
    total = pool.num_gpu_blocks - 1  # the null block is never handed out
    for i, path in enumerate(adapters):
        engine.add_request(
            f"a{i}", {"prompt_token_ids": prompt}, sp, lora_request=LoRARequest(f"a{i}-{path.name}", i + 1, str(path))
        )
    peak, cached = 0, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                cached[out.request_id.split("-")[0]] = out.num_cached_tokens
        peak = max(peak, total - pool.get_num_free_blocks())
    return peak, [cached.get(f"a{i}", -1) for i in range(len(adapters))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/bench/vllm_ced_adapters"))
    p.add_argument("--prompt-tokens", type=int, default=2048)
    args = p.parse_args(argv)
    if args.prompt_tokens < 96:
        p.error(f"--prompt-tokens ({args.prompt_tokens}) must be at least 96 (one scheduler block)")
    from vllm import LLM
    from vllm.v1.core import kv_cache_utils

    import kvgraft.vllm
    import kvgraft.vllm.lora as bridge

    kvgraft.vllm.register()
    plugin_keys = kv_cache_utils._gen_lora_extra_hash_keys
    ids = np.load(CED / "eval" / "heldout.npy").astype(np.int64)
    prompt = ids[30000 : 30000 + args.prompt_tokens].tolist()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        kinds = {
            "decoder-side": [make_adapter(Path(tmp) / f"dec{i}", s, False) for i, s in enumerate(SCALES)],
            "kv-neutral": [make_adapter(Path(tmp) / f"neu{i}", s, True) for i, s in enumerate(SCALES)],
        }
        for kind, paths in kinds.items():
            for keys in ("plugin", "vllm default"):
                # vLLM's own salt back for "vllm default" (the plugin's wrapper keeps it as its fallback)
                kv_cache_utils._gen_lora_extra_hash_keys = plugin_keys if keys == "plugin" else bridge.vllm_hash_keys()
                bridge.kv_neutral.cache_clear()
                llm = LLM(
                    model=str(CED),
                    dtype="float32",
                    enforce_eager=True,
                    max_model_len=args.prompt_tokens + 64,
                    skip_tokenizer_init=True,
                    enable_prefix_caching=True,
                    max_num_seqs=8,
                    max_num_batched_tokens=2048,
                    enable_lora=True,
                    max_lora_rank=16,
                    max_loras=8,
                    seed=0,
                )
                peak, cached = peak_blocks(llm, prompt, paths)
                _, per_block = cache_groups(llm)
                rows.append(dict(kind=kind, keys=keys, peak_blocks=peak, peak_bytes=peak * per_block, cached_tokens=cached))
                print(f"{kind:13} {keys:13} peak {peak:5d} blocks = {peak * per_block / 2**20:7.1f} MiB, cached tokens {cached}")
                llm.llm_engine.engine_core.shutdown()
                del llm
    kv_cache_utils._gen_lora_extra_hash_keys = plugin_keys
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out / "vllm_ced_adapters.json", dict(prompt_tokens=args.prompt_tokens, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

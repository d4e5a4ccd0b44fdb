"""Cache-sharing adapters on vLLM (``enable_lora``) through the plugin (``kvgraft.vllm.lora``, docs/vllm.md):
requests for the base and for two adapters in one vLLM batch give kvgraft's engine's tokens with the same
adapters loaded by name (``Engine.load_adapter``, as ``kvgraft serve`` runs them).

- ``models/adapters/kvgraft-ced-8m-geometry`` (``kvgraft adapt``, decoder half: layers 4-7, q/k/v/o, kv_b and the
  MLP, rank 16), and a second adapter made from it here (its B factors negated: another function on the same
  modules, same certificate), prompts of 5-300 held-out tokens (past the window: kv_b reads the stream);
- prefix caching on: vLLM 0.32 salts every block of a LoRA request with the adapter's name and path, so a prompt
  already cached for the base or another adapter is recomputed (0 tokens reused) and only the same adapter's
  repeat hits; both asserted, with the tokens;
- what the plugin changes there (``kvgraft.vllm.lora.install_hash_keys``): adapters whose recomputed certificate
  touches no cache group (made here from the geometry adapter's last-layer q/o/kv_b/MLP modules) get the base's
  key, so they reuse the base's cached prompt and each other's; the tokens stay kvgraft's engine's.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from engines import VllmRunner, kvgraft_engine_greedy, load_kvgraft

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
CED = ROOT / "models" / "kvgraft-ced-8m"
GEO = ROOT / "models" / "adapters" / "kvgraft-ced-8m-geometry"
N_NEW = 24


def _negated(src: Path, out: Path) -> Path:
    """A copy of the adapter at ``src`` with its B factors negated: the same modules, another function."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    weights = load_file(str(src / "adapter_model.safetensors"))
    save_file({k: (-v if "lora_B" in k else v) for k, v in weights.items()}, str(out / "adapter_model.safetensors"))
    return out


def _with_kv_b(src: Path, out: Path) -> Path:
    """A copy of the adapter at ``src`` whose ``kv_b_proj`` B factors (zero in the shipped adapter: its short
    training examples never read the stream) are seeded random: the stream read's up-projection changes."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    weights = load_file(str(src / "adapter_model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    for k, v in weights.items():
        if "kv_b_proj.lora_B" in k:
            weights[k] = torch.randn(v.shape, generator=gen, dtype=v.dtype) * 0.5
    save_file(weights, str(out / "adapter_model.safetensors"))
    return out


def _kv_neutral(src: Path, out: Path, layer: int) -> Path:
    """The adapter at ``src`` cut down to ``layer``'s modules that write no cache (all but k/v), with its
    certificate recomputed: it changes no cached row of the base."""
    from safetensors.torch import load_file, save_file

    from kvgraft.adapters.certificate import certify
    from kvgraft.model.config import ModelConfig

    shutil.copytree(src, out)
    meta = json.loads((src / "kvgraft_adapter.json").read_text())
    modules = [m for m in meta["modules"] if m.startswith(f"layers.{layer}.") and not m.endswith(("k_proj", "v_proj"))]
    meta["modules"] = modules
    meta["certificate"] = certify(ModelConfig.from_dict(meta["base_config"]), modules).to_dict()
    assert modules and meta["certificate"]["touched"] == []
    (out / "kvgraft_adapter.json").write_text(json.dumps(meta))
    peft = json.loads((src / "adapter_config.json").read_text())
    peft["target_modules"] = ["model." + m for m in modules]
    (out / "adapter_config.json").write_text(json.dumps(peft))
    weights = load_file(str(src / "adapter_model.safetensors"))
    save_file({k: v for k, v in weights.items() if any(f".{m}." in k for m in modules)}, str(out / "adapter_model.safetensors"))
    return out


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    last = _kv_neutral(GEO, root / "last-layer", 7)
    return {
        "geo": GEO,
        "neg": _negated(GEO, root / "geometry-negated"),
        "kvb": _with_kv_b(GEO, root / "geometry-kv-b"),
        "last": last,
        "last-neg": _negated(last, root / "last-neg"),
    }


@pytest.fixture(scope="module")
def prompts():
    ids = np.load(CED / "eval" / "heldout.npy").astype(np.int64)
    return [ids[o : o + n].tolist() for o, n in [(0, 5), (1000, 70), (5000, 200), (9000, 300), (12000, 130), (15000, 64)]]


def _requests(adapters, use):
    from vllm.lora.request import LoRARequest

    ids = {name: i + 1 for i, name in enumerate(sorted(adapters))}
    return [None if u is None else LoRARequest(u, ids[u], str(adapters[u])) for u in use]


def _generate(runner, prompts, requests, n_new=N_NEW):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True, detokenize=False)
    outs = runner.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False, lora_request=requests)
    return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]


def _scheduler_block() -> int:
    """vLLM's scheduler block (prefix-cache hit granularity) for the plugin's groups: the lcm of their block sizes."""
    from kvgraft.vllm.geometry import page_geometry

    g = page_geometry(load_kvgraft(CED).config, 4)
    return math.lcm(g.window_block, g.stream_block, g.pending_block or 1)


@pytest.mark.parametrize("path", ["batched", "per-request"])
def test_mixed_batch_of_base_and_two_adapters_matches_kvgraft_engine(adapters, prompts, path, monkeypatch):
    """In vLLM's default compiled mode (no ``enforce_eager``): with ``enable_lora`` the plugin asks vLLM not to
    compile the model, and the tokens are the engine's, on the batched path (the adapters' deltas per token of
    the packed axis, their kv_b per tile in the stream read) and on kvgraft's layer code per request."""
    monkeypatch.setenv("KVGRAFT_VLLM_CED_PATH", path)
    use = [None, "geo", "neg", "kvb", None, "neg"]
    with VllmRunner(CED, max_model_len=512, enable_lora=True, max_lora_rank=16, max_loras=3, enforce_eager=False) as runner:
        assert runner.apply_model(lambda model: model.do_not_compile), "compiled with enable_lora"
        theirs, _ = _generate(runner, prompts, _requests(adapters, use))
        steps = runner.apply_model(lambda model: dict(model.steps))
    print(f"\nforwards per path ({path}):", steps)
    assert steps.get("batched+adapters", 0) > 0 if path == "batched" else steps.get("per-request", 0) > 0, steps
    ours = kvgraft_engine_greedy(load_kvgraft(CED), prompts, N_NEW, adapters=adapters, use=use)
    base = kvgraft_engine_greedy(load_kvgraft(CED), prompts, N_NEW)
    assert theirs == ours
    # the adapters change what is generated (so the check above can fail), and differently
    assert all(ours[i] != base[i] for i, u in enumerate(use) if u is not None and len(prompts[i]) > 5)
    assert ours[2] != kvgraft_engine_greedy(load_kvgraft(CED), [prompts[2]], N_NEW, adapters=adapters, use=["geo"])[0]
    # the kv_b delta of the stream's readers changes what is generated (so the batched path's kv_b term is checked)
    assert ours[3] != kvgraft_engine_greedy(load_kvgraft(CED), [prompts[3]], N_NEW, adapters=adapters, use=["geo"])[0]


def test_prefix_cache_is_salted_per_adapter(adapters, monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    ids = np.load(CED / "eval" / "heldout.npy").astype(np.int64)
    p = ids[30000:30500].tolist()
    use = [None, "geo", "neg", "geo"]
    with VllmRunner(CED, max_model_len=1024, enable_prefix_caching=True, enable_lora=True, max_lora_rank=16, max_loras=2) as r:
        runs = [_generate(r, [p], _requests(adapters, [u]), 8) for u in use]
    tokens, cached = [t[0] for t, _ in runs], [c[0] for _, c in runs]
    print("\nnum_cached_tokens: base, geo, neg, geo again:", cached)
    ours = kvgraft_engine_greedy(load_kvgraft(CED), [p] * 4, 8, adapters=adapters, use=use, max_seq_len=1024)
    assert tokens == ours
    assert cached[:3] == [0, 0, 0] and cached[3] == 499 // _scheduler_block() * _scheduler_block(), cached


def test_kv_neutral_adapters_share_the_base_prefix_cache(adapters, monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    ids = np.load(CED / "eval" / "heldout.npy").astype(np.int64)
    p = ids[30000:30500].tolist()
    use = [None, "last", "last-neg", "geo"]
    with VllmRunner(CED, max_model_len=1024, enable_prefix_caching=True, enable_lora=True, max_lora_rank=16, max_loras=2) as r:
        runs = [_generate(r, [p], _requests(adapters, [u]), 8) for u in use]
    tokens, cached = [t[0] for t, _ in runs], [c[0] for _, c in runs]
    print("\nnum_cached_tokens: base, last, last-neg (KV-neutral), geo (decoder-side):", cached)
    ours = kvgraft_engine_greedy(load_kvgraft(CED), [p] * 4, 8, adapters=adapters, use=use, max_seq_len=1024)
    assert tokens == ours
    assert tokens[1] != tokens[0] and tokens[2] != tokens[1], "the KV-neutral adapters must change the output"
    hit = 499 // _scheduler_block() * _scheduler_block()
    assert cached == [0, hit, hit, 0], cached
